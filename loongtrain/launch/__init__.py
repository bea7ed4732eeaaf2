"""The launch path of the commands that start workers (``loongtrain train``, ``loongtrain eval``): ``TrainConfig``,
their command lines, the checks before any worker starts, ``--plan auto``, torchrun restarts, the workers, and the
trainer's step on fake ranks at full size (the simulation; docs/launching.md)."""
