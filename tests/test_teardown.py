"""No gloo worker outlives a script, and no exit-time abort (tplower.core.support.teardown).

The scripts run under ``torch.distributed.run``, as a user runs them: the abort lives in interpreter
finalization, after the script's last line.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import tplower
from tplower.core.support import teardown
from tplower.testing import run_processes

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("exit_script.py")
ABORT = "terminate called without an active exception"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    scratch = tempfile.mkdtemp(prefix="tplower-test-exit-")
    try:  # TMPDIR: torchrun's agent leaves its log folder there; it goes with the rest
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": scratch}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(_free_port()), str(SCRIPT), *args]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# --queued 50 leaves gloo's workers holding 50 Python-made tensors when the last line runs. With tplower imported
# after init_process_group and the script ending with destroy_process_group(), every one of 20 runs of such a
# script aborted at exit before the teardown existed (0 of 20 since); this script, run 3 times on the tree
# before it, exited 17 each time (3 gloo threads alive at its last atexit handler). The handler the script
# registers first runs last and sees every thread. The second case imports tplower first and ends with
# tplower.shutdown() instead.
@pytest.mark.parametrize("args", [
    ("--import-late", "--queued", "50"),
    pytest.param(("--queued", "50", "--tplower-shutdown"), marks=pytest.mark.slow),  # test_release_... covers it
], ids=lambda a: "-".join(x.lstrip("-") for x in a))
def test_a_training_script_ends_with_no_gloo_thread_and_no_abort(args: tuple[str, ...]) -> None:
    proc = _torchrun(*args)
    output = proc.stdout + proc.stderr
    assert ABORT not in output, output
    assert proc.returncode == 0, output
    for rank in (0, 1):
        assert f"rank {rank}: done" in proc.stdout, output
        assert f"rank {rank}: no gloo thread alive at exit" in proc.stdout, output


# A script that never calls destroy_process_group(): tplower's exit handler destroys the default group (a local
# call) and joins gloo's workers. On the tree before it, both cases below exited 17 (3 gloo threads alive at the
# script's last handler) on the ranks whose group was still up. With rank 1 gone before rank 0's handlers run,
# the handler must neither wait for it nor hang. Run 5 times in a row with TPLOWER_SLOW=1.
NO_TEARDOWN = [("--no-teardown", "--rank1-leaves-first"),
               pytest.param(("--no-teardown", "--import-late", "--queued", "50"), marks=pytest.mark.slow)]


@pytest.mark.parametrize("args", NO_TEARDOWN, ids=lambda a: "-".join(x.lstrip("-") for x in a))
def test_a_script_that_never_destroys_the_group_ends_cleanly(args: tuple[str, ...]) -> None:
    proc = _torchrun(*args)
    output = proc.stdout + proc.stderr
    assert ABORT not in output, output
    assert proc.returncode == 0, output
    for rank in (0, 1):
        assert f"rank {rank}: done" in proc.stdout, output
        assert f"rank {rank}: no gloo thread alive at exit" in proc.stdout, output
    if "--rank1-leaves-first" in args:
        assert "rank 0: rank 1 has exited" in proc.stdout, output


@pytest.mark.slow
@pytest.mark.parametrize("run", range(5))
def test_a_script_that_never_destroys_the_group_ends_cleanly_every_time(run: int) -> None:
    test_a_script_that_never_destroys_the_group_ends_cleanly(("--no-teardown", "--queued", "50"))


def _released_after_destroy(rank: int, world: int) -> dict[str, object]:
    import torch.distributed as dist

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    lowerer = tplower.mesh_lowerer(mesh)
    x = torch.arange(6.0).reshape(3, 2).requires_grad_()
    program = lowerer.program("P(sum)", "R", x.shape, "cpu")
    y = program(x)  # a graph awaiting backward holds the program
    had_threads = len(teardown.live_gloo_worker_threads()) > 0
    released_alive = teardown.release_destroyed_groups()  # the group is up: nothing of tplower's is released
    dist.destroy_process_group()
    released = teardown.release_destroyed_groups()
    out: dict[str, object] = {"had_threads": had_threads, "released_alive": released_alive,
                              "released": released, "threads": teardown.live_gloo_worker_threads(),
                              "registry": dict(mesh._pg_registry)}
    for what, call in (("groups", lambda: lowerer.groups), ("program", lambda: program(x.detach())),
                       ("new", lambda: lowerer.program("S(0)", "R", (3, 2), "cpu")),
                       ("backward", lambda: y.sum().backward())):
        try:
            call()
            out[what] = "ran"
        except tplower.TPLowerError as exc:
            out[what] = str(exc)
    return out


def test_release_after_destroy_joins_the_workers_and_names_the_cause() -> None:
    for out in run_processes(2, _released_after_destroy):
        assert out["had_threads"] and out["released_alive"] == 0
        assert out["released"] >= 2  # the lowerer and its program, at least
        assert out["threads"] == [] and out["registry"] == {}
        for what in ("groups", "program", "new", "backward"):
            assert "destroyed" in str(out[what]) and "init_process_group" in str(out[what]), (what, out[what])
