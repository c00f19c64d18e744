"""The package layout: the layer contract holds and can fail, and every name and module path of before still imports.

Layers, top to bottom (``[tool.importlinter]`` in ``pyproject.toml``): the
command line; the benchmarks; the main job; the module layer, the test
harness and the conformance checks; the core. ``lint-imports`` checks that
no import points up. Before the sub-packages every module sat directly under
``tplower``; those paths are aliases of the moved modules (the same objects).
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tplower
from tplower._moved import MOVED

ROOT = Path(__file__).parent.parent
LINT = shutil.which("lint-imports")

#: ``tplower.__all__``: the public API (names are added, never removed)
PUBLIC = ["BoundaryEntry", "BoundaryForm", "DispatchPlan", "all_to_all_splits", "combine_tokens",
          "dispatch_tokens", "plan_dispatch", "MeshLowerer", "Step", "TPCollectiveLowerer", "TPExecutionOp",
          "TPLowerError", "TPLowerTypeError", "TPOperators", "TransitionPlan", "VerifyReport", "__version__",
          "classify_axis", "classify_boundary_form", "classify_tp_transition", "create_tp_collective_lowerer",
          "explain_plan_lines", "format_placement", "format_placements", "full_state_dict",
          "load_plan", "load_safetensors", "mesh_lowerer", "parallelize",
          "parse_placement", "parse_placements", "plan_steps", "plan_transition", "redistribute_local",
          "replicate_partials", "set_cache_size", "shutdown", "verify", "vocab_parallel_cross_entropy"]


def _lint(config: Path, src: Path) -> subprocess.CompletedProcess[str]:
    assert LINT is not None
    return subprocess.run([LINT, "--config", str(config), "--no-cache"], capture_output=True, text=True,
                          cwd=src.parent, env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(src)})


@pytest.mark.skipif(LINT is None, reason="import-linter is not installed (pip install -e '.[dev]')")
def test_the_layer_contract_holds() -> None:
    done = _lint(ROOT / "pyproject.toml", ROOT / "src")
    assert done.returncode == 0 and "1 kept, 0 broken" in done.stdout, done.stdout + done.stderr


@pytest.mark.skipif(LINT is None, reason="import-linter is not installed (pip install -e '.[dev]')")
def test_an_import_pointing_up_breaks_the_contract(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "src" / "tplower", tmp_path / "src" / "tplower",
                    ignore=shutil.ignore_patterns("__pycache__"))
    placements = tmp_path / "src" / "tplower" / "core" / "placements.py"
    placements.write_text(placements.read_text() + "\nfrom ..nn import plans  # noqa: E402\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    done = _lint(tmp_path / "pyproject.toml", tmp_path / "src")
    assert done.returncode == 1 and "0 kept, 1 broken" in done.stdout, done.stdout + done.stderr
    assert "tplower.core.placements -> tplower.nn.plans" in done.stdout


def test_public_names_unchanged() -> None:
    assert sorted(tplower.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(tplower, name) is not None
    assert callable(tplower.parallelize) and callable(tplower.verify)  # functions, not the modules of the same name


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_paths_are_the_moved_modules(old: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(MOVED[old])
