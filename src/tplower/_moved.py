"""Module paths from before the layer sub-packages, still importable (``tplower.collectives``, ...).

An old path names the very module object of the new one (``sys.modules``
holds it under both names), so ``import tplower.collectives as C`` and
``from tplower.models import load_model`` keep working, and patching an
attribute through either name patches the one module. Modules the package
has already imported are aliased at once; the others when first imported,
through a finder on ``sys.meta_path``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED", "install"]

#: old module name -> new module name
MOVED: dict[str, str] = {
    **{f"tplower.{m}": f"tplower.core.{m}" for m in (
        "placements", "transitions", "collectives", "redistribute", "lowering", "agreement", "errors", "argcheck",
        "cache", "explain")},
    **{f"tplower.{m}": f"tplower.nn.{m}" for m in (
        "plans", "boundaries", "parallelize", "params", "hf_plans", "uneven", "codegen", "codegen_ops",
        "codegen_text", "verify", "verify_compare", "verify_record", "verify_report")},
    **{f"tplower.{m}": f"tplower.run.{m}" for m in ("models", "quiet", "hf_table")},
    **{f"tplower.bench_{m}": f"tplower.bench.{m}" for m in ("cases", "model", "report")},
    **{f"tplower.cli_{m}": f"tplower.cli.{m}" for m in ("bench", "codegen", "demo", "explain", "run", "verify")},
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name and loads it as the module of its new name."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module is already executed."""


def install() -> None:
    """Alias every moved module already imported, and put the finder on ``sys.meta_path`` (once)."""
    for old, new in MOVED.items():
        if new in sys.modules and old not in sys.modules:
            sys.modules[old] = sys.modules[new]
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
