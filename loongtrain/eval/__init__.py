"""Long-context evaluation under the training layout (docs/design.md §14): the tasks and what they run on.

:mod:`~loongtrain.eval.job` (options, checks, :func:`~loongtrain.eval.job.evaluate`),
:mod:`~loongtrain.eval.source` (MODEL: run, checkpoint or HF directory), :mod:`~loongtrain.eval.forward`
(one sharded forward), the tasks :mod:`~loongtrain.eval.position_loss` and :mod:`~loongtrain.eval.passkey`,
:mod:`~loongtrain.eval.report` (results.json, table, plots). The ``loongtrain eval`` command line and its
processes are in :mod:`loongtrain.launch.eval_cli` and :mod:`loongtrain.launch.eval_run`.
"""
