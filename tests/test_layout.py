"""The package layout: the layer contract holds and can fail, no two modules import each other, public names stay,
no file is longer and no folder fuller than the project keeps to.

Layers, top to bottom (``[tool.importlinter]`` in ``pyproject.toml``): the
command line; the benchmarks; the main job; the code generator and the
verifier (independent of each other); installation (``tplower.nn``), the test
harness and the conformance checks; adapters and context parallelism
(independent of each other); state in and out; the runtime of installed
boundaries; the plan language; model-family helpers; the core, itself four
rooms: model-level operations (expert dispatch, the vocabulary-parallel loss)
above the lowering and call path, above the transition language, above
housekeeping (errors, argument checks, teardown).
``lint-imports`` checks that no import points up, and every planted upward
import below must break it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tplower

ROOT = Path(__file__).parent.parent
LINT = shutil.which("lint-imports")

#: ``tplower.__all__``: the public API (names are added, never removed)
PUBLIC = ["BoundaryEntry", "BoundaryForm", "DispatchPlan", "LayoutCandidate", "plan_layout", "all_to_all_splits",
          "combine_tokens", "dispatch_tokens", "plan_dispatch", "MeshLowerer", "Step", "TPCollectiveLowerer",
          "TPExecutionOp",
          "TPLowerError", "TPLowerTypeError", "TPOperators", "TransitionPlan", "VerifyReport", "__version__",
          "classify_axis", "classify_boundary_form", "classify_tp_transition", "create_tp_collective_lowerer",
          "explain_plan_lines", "format_placement", "format_placements", "full_state_dict", "gather_sequence",
          "load_plan", "load_safetensors", "mesh_lowerer", "parallelize", "plan_for",
          "parse_placement", "parse_placements", "plan_steps", "plan_transition", "redistribute_local",
          "replicate_partials", "set_cache_size", "shard_sequence", "shutdown", "sum_context_in_fsdp", "verify",
          "vocab_parallel_cross_entropy"]


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
    placements = tmp_path / "src" / "tplower" / "core" / "language" / "placements.py"
    placements.write_text(placements.read_text() + "\nfrom ...plans import entries  # noqa: E402\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    done = _lint(tmp_path / "pyproject.toml", tmp_path / "src")
    assert done.returncode == 1 and "0 kept, 1 broken" in done.stdout, done.stdout + done.stderr
    assert "tplower.core.language.placements -> tplower.plans.entries" in done.stdout


def test_public_names_unchanged() -> None:
    assert sorted(tplower.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(tplower, name) is not None
    assert callable(tplower.parallelize) and callable(tplower.verify)  # functions, not the modules of the same name


_LAZY = """
import sys, tplower
before = sorted(m for m in ("tplower.codegen", "tplower.verification.derived") if m in sys.modules)
got = [tplower.codegen.emit, tplower.verification.derived.verify_derived]  # before any import names them
same = [got[0] is sys.modules["tplower.codegen.emit"].emit,
        got[1] is sys.modules["tplower.verification.derived"].verify_derived]
missing = []
for owner, name in ((tplower, "codegenn"), (tplower.verification, "derivd"), (tplower, "_private")):
    try:
        getattr(owner, name)
    except AttributeError as exc:
        missing.append(str(exc))
print(before, same, missing, sep="\\n")
"""


def test_subpackages_are_attributes_imported_on_first_use() -> None:
    """In a fresh interpreter: ``import tplower`` leaves the code generator and the derived-plan verifier unimported,
    and ``tplower.codegen.emit`` / ``tplower.verification.derived.verify_derived`` are the functions their modules
    define; a name that is no module is the usual ``AttributeError``."""
    done = subprocess.run([sys.executable, "-c", _LAZY], capture_output=True, text=True, timeout=120,
                          env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(ROOT / "src"),
                               "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "[]", "[True, True]",
        "[\"module 'tplower' has no attribute 'codegenn'\", \"module 'tplower.verification' has no attribute "
        "'derivd'\", \"module 'tplower' has no attribute '_private'\"]"]


@pytest.mark.skipif(LINT is None, reason="import-linter is not installed (pip install -e '.[dev]')")
@pytest.mark.parametrize(("where", "line", "shown"), [
    ("nn/parallelize.py", "from ..codegen import emit", "tplower.nn.parallelize -> tplower.codegen"),
    ("codegen/writer.py", "from ..verification import report", "tplower.codegen.writer -> tplower.verification"),
    ("state/full_state.py", "from ..adapters import lora", "tplower.state.full_state -> tplower.adapters"),
    ("adapters/lora.py", "from ..context import layout", "tplower.adapters.lora -> tplower.context"),
    ("runtime/boundary.py", "from ..nn import coverage", "tplower.runtime.boundary -> tplower.nn"),
    ("runtime/params.py", "from ..state import full_state", "tplower.runtime.params -> tplower.state"),
    ("plans/forms.py", "from ..runtime import operators", "tplower.plans.forms -> tplower.runtime"),
    ("families/conv1d.py", "from ..plans import styles", "tplower.families.conv1d -> tplower.plans"),
    ("core/support/errors.py", "from ...cli import main", "tplower.core.support.errors -> tplower.cli"),
    ("core/lower/redistribute.py", "from ..ops import dispatch", "tplower.core.lower.redistribute -> tplower.core.ops"),
    ("core/lower/program.py", "from ..ops.vocab_loss import vocab_parallel_cross_entropy",
     "tplower.core.lower.program -> tplower.core.ops.vocab_loss"),
    ("core/language/transitions.py", "from ..lower import collectives", "tplower.core.language.transitions -> "
     "tplower.core.lower.collectives"),
    ("core/support/argcheck.py", "from ..language import placements", "tplower.core.support.argcheck -> "
     "tplower.core.language.placements"),
], ids=["nn->codegen", "codegen->verification", "state->adapters", "adapters->context", "runtime->nn",
        "runtime->state", "plans->runtime", "families->plans", "core->cli", "lowering->model-level op",
        "call path->model-level op", "language->lowering", "support->language"])
def test_every_planted_upward_import_breaks_the_contract(tmp_path: Path, where: str, line: str, shown: str) -> None:
    shutil.copytree(ROOT / "src" / "tplower", tmp_path / "src" / "tplower",
                    ignore=shutil.ignore_patterns("__pycache__"))
    planted = tmp_path / "src" / "tplower" / where
    planted.write_text(planted.read_text() + f"\n{line}  # noqa: E402\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    done = _lint(tmp_path / "pyproject.toml", tmp_path / "src")
    assert done.returncode == 1 and "0 kept, 1 broken" in done.stdout, done.stdout + done.stderr
    assert shown in done.stdout, done.stdout


#: the longest a source file of the package may be (one idea a file)
MAX_LINES = 420


def test_no_file_is_longer_than_the_project_keeps_to() -> None:
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "src" / "tplower").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"files over {MAX_LINES} lines: {long}"


#: the most modules (``__init__.py`` aside) a folder of the package may hold (a room a reader takes in at once)
MAX_MODULES = 18


def test_no_folder_holds_more_modules_than_the_project_keeps_to() -> None:
    big = {str(d.relative_to(ROOT)): n for d in sorted((ROOT / "src" / "tplower").rglob("*")) if d.is_dir()
           if (n := sum(1 for p in d.glob("*.py") if p.name != "__init__.py")) > MAX_MODULES}
    assert big == {}, f"folders over {MAX_MODULES} modules: {big}"


def test_every_room_says_its_one_idea() -> None:
    for init in sorted((ROOT / "src" / "tplower").glob("**/__init__.py")):
        doc = init.read_text().split('"""')
        assert len(doc) >= 3 and len(doc[1].strip()) > 80, f"{init.relative_to(ROOT)} has no docstring of its room"


_PAIRS = """
import json, grimp
graph = grimp.build_graph("tplower", cache_dir=None)
print(json.dumps(sorted((a, b) for a in graph.modules for b in graph.find_modules_directly_imported_by(a)
                        if a < b and graph.direct_import_exists(importer=b, imported=a))))
"""


def _mutual_imports(src: Path) -> list[tuple[str, str]]:
    """Pairs of modules that import each other, from import-linter's own graph (grimp), in a fresh interpreter
    that finds ``tplower`` under ``src`` (``TYPE_CHECKING`` imports count)."""
    pytest.importorskip("grimp")
    done = subprocess.run([sys.executable, "-c", _PAIRS], capture_output=True, text=True, cwd=src,
                          env={"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(src)}, timeout=120)
    assert done.returncode == 0, done.stderr
    return [tuple(p) for p in json.loads(done.stdout)]


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert _mutual_imports(ROOT / "src") == []


def test_a_planted_circle_is_found(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "src" / "tplower", tmp_path / "tplower", ignore=shutil.ignore_patterns("__pycache__"))
    planted = tmp_path / "tplower" / "core" / "language" / "placements.py"
    planted.write_text(planted.read_text() + "\nfrom . import transitions  # noqa: E402\n")
    assert ("tplower.core.language.placements", "tplower.core.language.transitions") in _mutual_imports(tmp_path)
