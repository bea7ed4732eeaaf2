"""The launch path of the commands that start workers (``loongtrain train``, ``loongtrain eval``): their
command lines, the checks before any worker starts, ``--plan auto``, torchrun restarts, and the workers
(docs/launching.md)."""
