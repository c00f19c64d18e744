"""The command line: explain (table, JSON, errors), the demo, and dispatch of subcommands."""

from __future__ import annotations

import json

import pytest
import torch

from tplower.cli import main
from tplower.cli.explain import parse_mesh
from tplower.core.language.explain import format_bytes
from tplower.core.support.errors import TPLowerError


def test_explain_table_hand_computed(capsys):
    # reduce_scatter of a (4, 1024, 4096) bf16 partial over tp=4: 3 padded (4, 256, 4096) pieces of 2 bytes
    assert main(["explain", "S(0),P(sum)", "R,S(1)", "--mesh", "dp=2,tp=4", "--shape", "8,1024,4096",
                 "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "reduce_scatter  1    sum" in out and "24.0 MiB" in out
    assert "total bytes sent per rank: forward 32.0 MiB, backward 24.0 MiB" in out


def test_explain_json_and_coordinates(capsys):
    assert main(["explain", "S(0)", "S(1)", "--shape", "7,5", "--coord", "1", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    # rank 1 of 2 holds rows 4..6 of 7 (torch.chunk): 3 rows in, all 7 rows and 2 of 5 columns out
    assert info["local_in_shape"] == [3, 5] and info["local_out_shape"] == [7, 2]
    assert [s["collective"] for s in info["steps"]] == ["all_to_all", "all_to_all"]
    assert info["mesh"] == {"tp": 2}


@pytest.mark.parametrize(("argv", "message"), [
    (["explain", "P(sum)", "P(max)"], "cannot change its reduce op"),
    (["explain", "S(0)", "R", "--mesh", "tp2"], "is not name=size"),
    (["explain", "S(0)"], "needs SRC and DST"),
    (["explain", "S(7)", "R", "--shape", "4,4"], "out of range"),
    (["explain", "S(0)", "R", "--coord", "5"], "--coord '5': index 5 on axis 'tp' is outside 0..1 (--mesh tp=2)"),
    (["explain", "S(0)", "R", "--mesh", "dp=2,tp=2", "--coord", "1"],
     "--coord '1' has 1 index but --mesh dp=2,tp=2 has 2 axes (dp, tp); give one index per axis"),
    (["explain", "S(0)", "R", "--coord", "-1"], "--coord '-1': '-1' is not a non-negative integer"),
    (["explain", "S(0)", "R", "--shape", "8,x"],
     "--shape '8,x': 'x' is not a non-negative integer; give the global shape as comma-separated integers, "
     "e.g. 8,1024,4096"),
    (["explain", "S(0)", "R", "--mesh", "tp=0"],
     "--mesh 'tp=0': axis 'tp' has size '0'; a size is a whole number of ranks, at least 1 (e.g. tp=2)"),
    (["explain", "S(0)", "R", "--mesh", "tp=two"], "--mesh 'tp=two': axis 'tp' has size 'two'"),
    (["explain", "P(max),P(sum)", "R,R", "--mesh", "a=2,b=2"], "mixes Partial reduce ops ['max', 'sum']"),
])
def test_explain_errors_exit_2_with_the_reason(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_explain_default_shape_is_documented(capsys):
    # no --shape: the documented default 8,16; S(0) over tp=2 leaves 4 of 8 rows on rank 0
    assert main(["explain", "S(0)", "R", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["global_shape"] == [8, 16] and info["local_in_shape"] == [4, 16]
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    assert "global shape of the tensor, e.g. 8,1024,4096 (default 8,16)" in " ".join(capsys.readouterr().out.split())


def test_explain_mixed_sum_avg_partials(capsys):
    # P(avg) over dp and P(sum) over tp, to R: one all_reduce per axis (avg, then sum), no refusal
    assert main(["explain", "P(avg),P(sum)", "R,R", "--mesh", "dp=2,tp=2", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [(s["axis"], s["collective"], s["reduce_op"]) for s in info["steps"] if s["direction"] == "forward"] == [
        ("dp", "all_reduce", "avg"), ("tp", "all_reduce", "sum")]


def test_explain_plan_file(capsys):
    assert main(["explain", "--plan", "examples/plans/block_sp.yaml", "--mesh", "tp=2"]) == 0
    out = capsys.readouterr().out
    assert "attn: tp_collective" in out and "==> all_gather(dim=1)" in out


def test_mesh_parsing_and_bytes():
    assert parse_mesh("dp=2,tp=4") == (("dp", "tp"), (2, 4))
    with pytest.raises(TPLowerError, match="appears twice"):
        parse_mesh("tp=2,tp=2")
    assert [format_bytes(n) for n in (0, 1023, 1024, 3 << 20, 5 << 30)] == ["0 B", "1023 B", "1.0 KiB", "3.0 MiB",
                                                                          "5.0 GiB"]


def test_demo_matches_dtensor(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "all 7 transitions match DTensor forward and backward on every rank" in out


def test_demo_table_columns_fit_their_longest_cell():
    from tplower.cli.demo import demo_table

    rows = [{"transition": "P(sum)->S(0)", "forward": "reduce_scatter(dim=0, op=sum)", "backward": "all_gather(dim=0)",
             "status": "match"},
            {"transition": "R->R", "forward": "", "backward": "", "status": "match"}]
    assert demo_table(rows, [True, False]) == [
        "transition    forward                        backward           vs DTensor",
        "P(sum)->S(0)  reduce_scatter(dim=0, op=sum)  all_gather(dim=0)  match",
        "R->R          identity                       identity           FAIL (match)",
    ]


def _needs_an_argument(size):  # a --module factory that cannot be called with no arguments
    return torch.nn.Linear(size, size)


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "llama-tiny", "--mesh", "dp=2", "--plan", "auto"], "--axis 'tp' is not an axis of --mesh dp=2"),
    (["--model", "llama-tiny", "--mesh", "tp=2", "--axis", "x"], "--axis 'x' is not an axis of --mesh tp=2"),
    (["--model", "llama-tiny", "--mesh", "tp=3"], "--mesh tp=3 does not divide"),
    (["--model", "llama-tiny", "--plan", "auto", "-o", "/nonexistent-dir/out.py"],
     "the folder '/nonexistent-dir' does not exist"),
    (["--module", "test_cli:_needs_an_argument", "--plan", "auto"],
     "--module 'test_cli:_needs_an_argument': calling it raised TypeError"),
    (["--module", "test_cli:_needs_an_argument"], "--module needs --plan FILE, --plan auto or --plan derive"),
])
def test_codegen_errors_exit_2_naming_the_option(argv, message, capsys):
    assert main(["codegen", *argv]) == 2
    assert message in capsys.readouterr().err


def test_explain_plan_on_a_model_prints_the_resolved_modules(capsys: pytest.CaptureFixture[str]) -> None:
    # llama-tiny's shipped plan, resolved on its skeleton at tp=2: q_proj colwise, o_proj rowwise (hand table)
    assert main(["explain", "--plan", "auto", "--model", "llama-tiny", "--mesh", "tp=2"]) == 0
    out = capsys.readouterr().out.splitlines()
    q = out.index("model.layers.0.self_attn.q_proj: tp_collective, lowered")
    assert out[q + 1:q + 3] == ["  0: tp R -> R (grad P(sum)) ==> identity; backward all_reduce(op=sum)",
                                "  param weight: tp S(0)"]
    o = out.index("model.layers.0.self_attn.o_proj: tp_collective, lowered")
    assert out[o + 1:o + 3] == ["  out: tp P(sum) -> R ==> all_reduce(op=sum)", "  param weight: tp S(1)"]


def test_explain_context_tables_both_modes_and_names_a_missing_axis(capsys: pytest.CaptureFixture[str]) -> None:
    # hand-computed: 2048-token pieces of one head of 128 bf16 = 512 KiB; Ulysses moves q and the output (16 local
    # heads, 3/4 of them leave) 4 times a layer: 3 * 4 * 512 KiB * 4 * 32 layers = 768 MiB
    assert main(["explain", "--context", "batch=1,seq=8192,hidden=4096,heads=32,kv_heads=8,layers=32",
                 "--mesh", "cp=4,tp=2", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "query, output (S(seq) <-> S(heads))  all_to_all  128    768.0 MiB" in out
    assert "key, value (S(seq) -> R)                 all_gather      64     384.0 MiB" in out
    assert main(["explain", "--context", "batch=1,seq=64,hidden=64,heads=4,kv_heads=2", "--mesh", "tp=2"]) == 2
    assert capsys.readouterr().err.strip() == ("tplower explain: error: --context needs a cp axis in --mesh "
                                               "(e.g. cp=2,tp=2); --mesh tp=2 has tp")
