"""``loongtrain eval``: long-context evaluation under the training layout (docs/design.md §14).

:mod:`~loongtrain.eval.job` (options, checks), :mod:`~loongtrain.eval.source` (MODEL: run, checkpoint or
HF directory), :mod:`~loongtrain.eval.forward` (one sharded forward), the tasks
:mod:`~loongtrain.eval.position_loss` and :mod:`~loongtrain.eval.passkey`, :mod:`~loongtrain.eval.report`
(results.json, table, plots) and :mod:`~loongtrain.launch.eval_run` (processes).
"""
