"""What is applied to a plain model from outside, one step a module, composed by
:func:`loongtrain.wrap.parallelize.parallelize` (docs/design.md §7)."""
