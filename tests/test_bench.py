"""Smoke tests of ``tplower bench``: it runs, writes its table, JSON and plots. No timing is asserted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tplower.bench_cases import global_shape, size_label
from tplower.cli import main
from tplower.cli_bench import parse_size


def test_sizes_and_shapes() -> None:
    assert parse_size("64KiB") == 64 << 10
    assert parse_size("4M") == 4 << 20
    assert size_label(64 << 20) == "64 MiB"
    for nbytes in (1 << 10, 64 << 10, 4 << 20, 64 << 20):
        rows, cols = global_shape(nbytes, 4)
        assert rows * cols * 4 == nbytes and rows % 4 == 0 and cols % 4 == 0
    with pytest.raises(argparse.ArgumentTypeError, match="not valid"):
        parse_size("lots")


def test_bad_arguments_are_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["bench", "--phases", "micro,nope", "--out", str(tmp_path)]) == 2
    assert "phases=['nope']" in capsys.readouterr().err


def test_tiny_bench_writes_table_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench"
    code = main(["bench", "--quick", "--out", str(out), "--worlds", "2", "--sizes", "1KiB",
                 "--cases", "S(0)->R;P(sum)->S(0)", "--reps", "2", "--phases", "micro,fake,memory"])
    assert code == 0
    text = capsys.readouterr().out
    assert "| world | transition |" in text and "tplower/raw" in text
    data = json.loads((out / "bench.json").read_text())
    impls = {r["impl"] for r in data["micro"]}
    assert {"raw", "tplower", "seed_op", "dtensor"} <= impls
    assert all(len(r["samples_us"]) == 2 for r in data["micro"])
    assert {r["impl"] for r in data["fake"]} >= {"tplower", "megatron", "funcol", "dtensor"}
    assert {r["impl"] for r in data["memory"]} == {"raw", "tplower", "dtensor"}
    assert (out / "bench.md").read_text().startswith("# tplower bench")
    for name in ("latency_fwd.png", "latency_fwd_bwd.png", "overhead.png"):
        assert (out / name).stat().st_size > 1000
