"""``tplower bench`` at the terminal: no profiler noise (its numbers kept), and malformed values named.

kineto prints ``profiler_start``/``profiler_stop`` to file descriptor 2 on
every profiling window (about 120 lines in ``tplower bench --quick``). The
check reads descriptor 2 itself (``capfd``), where those lines appear.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tplower.bench import peak_bytes
from tplower.cli import main
from tplower.run.quiet import KINETO_NOISE, filtered_stderr


def test_peak_bytes_is_exact_and_quiet(capfd: pytest.CaptureFixture[str]) -> None:
    def allocate() -> torch.Tensor:
        os.write(2, b"a warning of our own\n")  # what else reaches stderr in the window must still show
        keep = torch.empty(1000, dtype=torch.float32)  # 4000 bytes, kept
        tmp = torch.empty(500, dtype=torch.float64)  # 4000 more at the peak, freed before the end
        del tmp
        return keep

    for _ in range(3):
        peak, out = peak_bytes(allocate, torch.device("cpu"))
        assert peak == 8000 and isinstance(out, torch.Tensor) and out.numel() == 1000
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err
    assert err.count("a warning of our own") == 3


def test_filter_drops_only_kineto_status_lines(capfd: pytest.CaptureFixture[str]) -> None:
    noise = ["USDT:2026-11-30 07:51:55 8992:8992 SyncActivityProfilerHandler.cpp:52] profiler_start",
             "USDT:2026-11-30 07:51:55 8992:8992 SyncActivityProfilerHandler.cpp:59] profiler_stop",
             "STAGE:2026-11-30 07:52:02 9102:9102 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up"]
    kept = ["ERROR:2026-11-30 07:51:55 8992:8992 CuptiActivityProfiler.cpp:1] profiler_start failed",
            "profiler_stop", "USDT: something else"]
    assert all(KINETO_NOISE.match(n) for n in noise) and not any(KINETO_NOISE.match(k) for k in kept)
    with pytest.raises(RuntimeError), filtered_stderr():
        os.write(2, "".join(f"{line}\n" for line in noise + kept).encode())
        raise RuntimeError("the lines are written back even when the block raises")
    assert capfd.readouterr().err.splitlines() == kept


@pytest.mark.parametrize(("argv", "message"), [
    (["--worlds", "2,x"], "argument --worlds: '2,x': 'x' is not a whole number; give world sizes of at least 2, "
                          "comma separated, e.g. 2,4"),
    (["--sizes", "100"], "--sizes: 100 B does not split into a float32 [a, b] tensor with a and b divisible by world "
                         "2 (--worlds 2); give multiples of 16 B (e.g. 112)"),  # 16 = 4 bytes x 2 x 2; 112 = 7 x 16
    (["--sizes", "0"], "--sizes: 0 B does not split"),
    (["--context-seqs", "8192,x"], "argument --context-seqs: '8192,x': 'x' is not a whole number of at least 1"),
    (["--context-seqs", "8"], "--context-seqs: 8 tokens is below 16; give lengths of at least 16 (e.g. 8192)"),
    (["--context-cps", "1"], "--context-cps: 1 is below 2; a cp size is at least 2 ranks (e.g. 2,4)"),
    (["--context-cps", "2,100000"], "--context-cps 2,100000 would spawn 100000 local processes"),
    (["--context-budget", "lots"], "argument --context-budget: size 'lots' is not valid"),
], ids=["worlds", "size", "zero-size", "context-seqs-word", "context-seqs-short", "context-cps-one",
        "context-cps-many", "context-budget"])
def test_malformed_values_exit_2_naming_the_option(argv: list[str], message: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["bench", "--phases", "micro", "--worlds", "2", "--out", str(tmp_path), *argv])
    except SystemExit as exc:  # argparse's own exit for a value its type function refuses
        code = int(exc.code or 0)
    assert code == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "bench.json").exists()
