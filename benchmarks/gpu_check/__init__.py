"""The device acceptance check: ``python -m benchmarks.gpu_check --out FILE`` on a lent GPU
(:mod:`benchmarks.gpu_check.run`), its sections in :mod:`.exact`, :mod:`.rates`, :mod:`.speed` and
:mod:`.train`."""
