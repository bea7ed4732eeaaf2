"""The sections of the commands' configs (docs/configuration.md): the model, the data, the optimisation, the
processes, the output and the evaluation of a run. ``loongtrain train`` holds them all (with ``parallel`` and
the objective's section), ``loongtrain plan`` and ``loongtrain eval`` reuse the model and data sections."""
