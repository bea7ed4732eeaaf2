"""What is applied to a plain model from outside, one step a module, composed by
:func:`loongtrain.parallelize.compose.parallelize` (docs/memory.md)."""
