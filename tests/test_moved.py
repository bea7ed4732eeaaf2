"""The module paths before the package split stay importable for one release (loongtrain/_moved.py)."""

from __future__ import annotations

import importlib
import sys

import pytest

from loongtrain._moved import MOVED


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_path_imports_the_new_module_with_a_warning(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_old_names_inside_moved_modules_are_aliases():
    from loongtrain.wrap import mlp_tiles, recompute, zero

    assert zero.uses_fsdp is zero.uses_zero and zero.apply_fsdp is zero.apply_zero
    assert zero.fsdp_applies is zero.zero_applies and zero.fsdp_device_mesh is zero.zero_device_mesh
    assert recompute.checkpointed_layers is recompute.recomputed_layers
    assert mlp_tiles.TiledFeedForward is mlp_tiles.TiledMLP


def test_the_documented_old_entry_points_still_resolve():
    from loongtrain.launch.train_run import resolve_run
    from loongtrain.wrap.parallelize import parallelize

    for name in ("loongtrain.train.parallelize", "loongtrain.train.launch"):
        sys.modules.pop(name, None)
    with pytest.warns(DeprecationWarning):
        from loongtrain.train.launch import resolve_run as old_resolve_run
        from loongtrain.train.parallelize import parallelize as old_parallelize
    assert old_parallelize is parallelize and old_resolve_run is resolve_run
