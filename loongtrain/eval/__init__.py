"""Long-context evaluation under the training layout (docs/evaluation.md): the tasks and what they run on.

:mod:`~loongtrain.eval.config` (options, checks, :func:`~loongtrain.eval.config.evaluate`),
:mod:`~loongtrain.eval.source` (MODEL: run, checkpoint or HF directory), :mod:`~loongtrain.eval.forward`
(one sharded forward), the tasks :mod:`~loongtrain.eval.position_loss` and :mod:`~loongtrain.eval.passkey`,
:mod:`~loongtrain.eval.report` (results.json, table, plots). The ``loongtrain eval`` command line and its
processes are in :mod:`loongtrain.commands.eval` and :mod:`loongtrain.launch.eval_run`.
"""
