"""benchmarks/device_check.sh on a machine without a GPU: a clean refusal, and steps that name real options.

The script itself runs only where a CUDA GPU is (NCCL, the GPU bench);
here it must refuse at once (exit status 2, one line on stderr, nothing
written), and its dry run must list the six steps with commands whose
files and options exist. The NCCL conformance script's CPU twin (gloo, the
same code) runs with ``TPLOWER_SLOW=1``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=ROOT)


@needs_bash
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script would run")
def test_refuses_cleanly_without_a_gpu(tmp_path: Path) -> None:
    out = tmp_path / "check"
    res = _run(str(out))
    assert res.returncode == 2, res
    assert res.stdout == "", res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("device_check: refused: no CUDA GPU"), res.stderr
    assert not out.exists()


def _options(command: list[str]) -> set[str]:
    return {a for a in command if a.startswith("--")}


_HELPS = """
import contextlib, io
from tplower.cli import main
for command in ("run", "bench"):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        main([command, "--help"])
    print(buf.getvalue() + "\\f")
"""


def _helps() -> tuple[str, str]:
    """``tplower run --help`` and ``tplower bench --help`` from one process (one import of torch)."""
    out = subprocess.run([sys.executable, "-c", _HELPS], capture_output=True, text=True, timeout=120, cwd=ROOT)
    run_help, bench_help, *_ = out.stdout.split("\f")
    return run_help, bench_help


@pytest.mark.slow  # the refusal without a GPU runs in CI
@needs_bash
def test_dry_run_lists_every_step_with_real_files_and_options(tmp_path: Path) -> None:
    res = _run("--dry-run", str(tmp_path / "check"), env={"DEVICE_CHECK_GPUS": "4"})
    assert res.returncode == 0, res
    steps = dict(re.match(r"(\w+) \((\d+)s\): (.*)", line).group(1, 3)  # type: ignore[union-attr]
                 for line in res.stdout.splitlines())
    assert list(steps) == ["env", "conformance", "run", "bench_micro", "bench_share", "bench_moe",
                           "bench_model"], res.stdout
    assert not (tmp_path / "check").exists()  # a dry run writes nothing
    conformance, micro = steps["conformance"].split(), steps["bench_micro"].split()
    assert "--nproc-per-node" in conformance and conformance[conformance.index("--nproc-per-node") + 1] == "4"
    assert Path(conformance[conformance.index("--nproc-per-node") + 2]).is_file()
    assert Path(micro[micro.index("--nproc-per-node") + 2]).is_file()
    run, model = steps["run"].split(), steps["bench_model"].split()
    assert run[run.index("--nproc") + 1] == "4"  # 4 GPUs: one rank each, a tp that divides llama-tiny's heads
    run_help, bench_help = _helps()
    assert "--backend" in run_help and "--device" in bench_help, (run_help, bench_help)
    assert _options(run) <= set(re.findall(r"--[a-z-]+", run_help)), run
    micro_options = _options(micro) - {"--nproc-per-node", "--standalone"}
    assert (micro_options | _options(model)) <= set(re.findall(r"--[a-z-]+", bench_help)), (micro, model)
    assert "--compile" in model and "model" in model[model.index("--phases") + 1]
    moe = steps["bench_moe"].split()
    assert _options(moe) <= set(re.findall(r"--[a-z-]+", bench_help)), moe
    assert "--compile" in moe and moe[moe.index("--phases") + 1] == "moe"
    share = steps["bench_share"].split()
    assert Path(share[1]).name == "comm_share.py" and Path(share[1]).is_file(), share
    share_help = subprocess.run([sys.executable, share[1], "--help"], capture_output=True, text=True, timeout=120,
                                cwd=ROOT).stdout
    assert _options(share) <= set(re.findall(r"--[a-z-]+", share_help)), (share, share_help)
    assert share[share.index("--device") + 1] == "cuda"


@pytest.mark.slow
def test_nccl_conformance_script_runs_on_gloo(tmp_path: Path) -> None:
    import json

    out = tmp_path / "conformance.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "benchmarks" / "nccl_conformance.py"), "--device", "cpu", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world"] == 2 and report["backend"] == "gloo"
    for suite in ("1d", "1d_random"):
        counts = report[suite]["counts"]
        assert counts["cases"] > 0 and not report[suite]["failures"], report[suite]
