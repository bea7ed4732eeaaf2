"""One rank's training run: :class:`~loongtrain.train.trainer.Trainer` and what it is built from and
writes (the run's sections, its step context and what it asks of its objective, batch sharding, the run's model,
optimizer, gradient sync, checkpoints, validation, metrics, export), and the memory report (docs/launching.md)."""
