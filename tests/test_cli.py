"""The command line: explain (table, JSON, errors), the demo, and dispatch of subcommands."""

from __future__ import annotations

import json

import pytest

from tplower.cli import main
from tplower.cli_explain import parse_mesh
from tplower.errors import TPLowerError
from tplower.explain import format_bytes


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
])
def test_explain_errors_exit_2_with_the_reason(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().out


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
