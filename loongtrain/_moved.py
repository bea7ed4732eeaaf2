"""Module paths that moved when ``train/`` was split into ``wrap/``, ``train/`` and ``launch/``
(docs/design.md §1), kept importable for one release: importing an old path returns the module at its
new path (the same object) with a ``DeprecationWarning`` naming it. The README lists the moves."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: old module path -> new module path
MOVED = {
    "loongtrain.train.parallelize": "loongtrain.wrap.parallelize",
    "loongtrain.train.offload": "loongtrain.wrap.offload",
    "loongtrain.train.mlp_tiles": "loongtrain.wrap.mlp_tiles",
    "loongtrain.train.norm_linear": "loongtrain.wrap.norm_linear",
    "loongtrain.train.compile": "loongtrain.wrap.compile",
    "loongtrain.train.cli": "loongtrain.launch.train_cli",
    "loongtrain.train.launch": "loongtrain.launch.train_run",
    "loongtrain.train.torchrun": "loongtrain.launch.torchrun",
    "loongtrain.train.preflight": "loongtrain.launch.preflight",
    "loongtrain.train.autoplan": "loongtrain.launch.autoplan",
    "loongtrain.train.models": "loongtrain.train.run_model",
    "loongtrain.eval.cli": "loongtrain.launch.eval_cli",
    "loongtrain.eval.launch": "loongtrain.launch.eval_run",
    "loongtrain.plan.options": "loongtrain.plan.config",
    "loongtrain.data.prepare_cli": "loongtrain.data.cli",
    "loongtrain.train.fault_injection": "loongtrain.parallel.failures",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds only the old paths of :data:`MOVED` (it sits last on ``sys.meta_path``)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(name, self) if name in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path is removed in the next release",
                      DeprecationWarning, stacklevel=3)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: :meth:`create_module` returned the imported new module."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
