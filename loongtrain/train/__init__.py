"""One rank's training run: :class:`~loongtrain.train.trainer.Trainer` and what it is built from and
writes (options, batch sharding, the run's model, optimizer, gradient sync, checkpoints, validation,
metrics, export), and what measures it (the memory report, the full-size simulation; docs/launching.md)."""
