"""Reliability: disagreeing ranks, dying ranks and long mixed runs never hang, corrupt or leak.

Numbers (bad inputs tried, faults injected, transitions soaked, memory) are
printed at the end of the run. ``TPLOWER_SOAK=N`` runs N transitions per
soak instead of the short CI version.
"""

from __future__ import annotations

import contextlib
import glob
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tplower import TPLowerError, redistribute_local
from tplower.conformance import check_cases, failures, quiet_dtensor_logs, random_cases, summarize
from tplower.testing import RankFailure, run_processes, run_threaded

SOAK = int(os.environ.get("TPLOWER_SOAK", "0"))

# mode -> what rank 1 does differently from rank 0
DISAGREEMENTS = {
    "dtype": "float64 instead of float32",
    "placement": "P(sum) instead of S(0)",
    "uneven": "3 rows against 2, no global_shape",
    "bad_string": "a malformed placement",
    "grad": "grad P(sum) instead of the default",
}


def _call(rank, mesh, mode, check):
    x = torch.ones(4, 3)
    src, grad = "S(0)", None
    if rank == 1:
        if mode == "dtype":
            x = x.double()
        elif mode == "placement":
            src = "P(sum)"
        elif mode == "uneven":
            x = torch.ones(2, 3)
        elif mode == "bad_string":
            src = "S(zero)"
        elif mode == "grad":
            grad = "P(sum)"
    if mode == "uneven" and rank == 0:
        x = torch.ones(3, 3)
    return redistribute_local(x, mesh, src, "R", grad=grad, check=check)


def _debug_body(rank, world, modes, use_env):
    quiet_dtensor_logs()
    if use_env:
        os.environ["TPLOWER_DEBUG"] = "1"
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for mode in modes:
        try:
            _call(rank, mesh, mode, None if use_env else True)
            out[mode] = "no error"
        except TPLowerError as exc:
            out[mode] = str(exc)
    ok = redistribute_local(torch.full((2, 3), float(rank)), mesh, "S(0)", "R", check=True)
    out["agreeing call"] = ok[:, 0].tolist()
    return out


@pytest.mark.parametrize("use_env", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["check=True", "TPLOWER_DEBUG=1"])  # the env switch: the same check, with TPLOWER_SLOW=1
def test_debug_check_raises_on_every_rank_naming_ranks(use_env, reliability_report):
    results = run_processes(2, _debug_body, list(DISAGREEMENTS), use_env)
    assert results[0] == results[1]  # every rank raises the same message
    msgs = results[0]
    assert "dtype differs: 'torch.float32' on ranks [0]; 'torch.float64' on ranks [1]" in msgs["dtype"]
    assert "src differs: 'S(0)' on ranks [0]; 'P(sum)' on ranks [1]" in msgs["placement"]
    assert "global_shape differs: (6, 3) on ranks [0]; (4, 3) on ranks [1]" in msgs["uneven"]
    assert "rank 1: TPLowerError: src='S(zero)' is not a valid placement" in msgs["bad_string"]
    assert "grad differs: None on ranks [0]; 'P(sum)' on ranks [1]" in msgs["grad"]
    assert msgs["agreeing call"] == [0.0, 0.0, 1.0, 1.0]
    reliability_report["bad inputs tried with the debug check (per switch)"] = len(DISAGREEMENTS)


def _mismatch_body(rank, world, mode):
    quiet_dtensor_logs()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    _call(rank, mesh, mode, False)
    # gloo can complete the mismatched collective on one rank (the one that expected more bytes
    # received fewer) while aborting the other; the next collective then fails on the survivor.
    return redistribute_local(torch.ones(2, 2), mesh, "P(sum)", "R")


@pytest.mark.parametrize("mode", [pytest.param("placement", marks=pytest.mark.slow), "dtype"])  # one waits enough
def test_without_check_disagreement_ends_in_an_error_within_the_timeout(mode):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        # grace=60: the harness must not end a rank here; each rank's own error is what is checked
        run_processes(2, _mismatch_body, mode, timeout=120, pg_timeout=5, grace=60)
    elapsed = time.monotonic() - start
    # each rank ended by itself (the backend's error or its timeout), not by the harness's deadline
    assert sorted(info.value.failures) == [0, 1]
    assert not any("no result within" in m for m in info.value.failures.values()), info.value.failures
    assert elapsed < 60


def _dying_body(rank, world, how, stamp):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = torch.ones(4, 3)
    redistribute_local(x, mesh, "P(sum)", "R")  # everyone completes one transition
    if rank == 1:
        with open(stamp, "w") as f:  # when it died, for the test to measure how soon its peer was ended
            f.write(repr(time.time()))
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "aborts":  # as glibc's heap checks end a process: SIGABRT (no core file of this one)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.abort()
        raise RuntimeError("rank 1 gives up mid-run")
    return redistribute_local(x, mesh, "P(sum)", "R")  # rank 0 now waits for a peer that is gone


@pytest.mark.parametrize("how", ["killed", "aborts", "raises"])
def test_a_dying_rank_is_named_and_nothing_is_left(how, reliability_report, tmp_path, monkeypatch):
    # the run's temp folders go to a folder of this test's own: other tplower processes on the machine leave theirs
    # in the shared one meanwhile
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    stamp = str(tmp_path / "died_at")
    # Deadlines far beyond the run's length on a quiet machine (a few seconds): on a loaded one, starting the
    # ranks alone can take a minute, and the death must still be what is reported. What is measured is the
    # time from the death to the end of the run, against the process group's timeout (300 s).
    with pytest.raises(RankFailure) as info:
        run_processes(2, _dying_body, how, stamp, timeout=900, pg_timeout=300)
    after_death = time.time() - float(open(stamp).read())
    failed = info.value.failures
    said = {"killed": "exited with code -9", "raises": "rank 1 gives up mid-run",
            # an abort leaves the rank's Python stack (faulthandler), down to the line that aborted
            "aborts": "exited with code -6; its threads when the signal came (faulthandler)"}[how]
    assert 1 in failed and said in failed[1], failed
    if how == "aborts":
        assert "_dying_body" in failed[1], failed[1]
    assert after_death < 30  # the survivor is ended soon after, not at the process group's timeout
    assert multiprocessing.active_children() == []
    assert not glob.glob(os.path.join(private, "tplower-*"))  # nothing of this run is left
    reliability_report["faults injected"] = reliability_report.get("faults injected", 0) + 1


def _raising_thread(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    if rank == 2:
        raise ValueError("rank 2 refuses")
    return redistribute_local(torch.ones(2, 2), mesh, "P(sum)", "R")


def test_threaded_failure_wakes_the_others():
    with pytest.raises(RankFailure) as info:
        run_threaded(4, _raising_thread, timeout=60)
    assert list(info.value.failures) == [2] and "rank 2 refuses" in info.value.failures[2]


def _rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _soak_body(rank, world, cases):
    # Two passes over the same cases: the first warms caches (DTensor, the oracle, makes flattened
    # groups on first use); the second must add no process group and no memory.
    quiet_dtensor_logs()
    meshes: dict = {}
    first = check_cases(rank, world, cases, meshes)
    pgs, rss0 = len(dist.distributed_c10d._world.pg_map), _rss_mib()
    second = check_cases(rank, world, cases, meshes)
    return first + second, rss0, _rss_mib(), pgs, len(dist.distributed_c10d._world.pg_map)


def _soak(run, world, mesh_shape, count, label, report):
    cases = random_cases(seed=1234 + world, count=count // 2, mesh_shape=mesh_shape)
    per_rank = run(world, _soak_body, cases)
    results = [r[0] for r in per_rank]
    assert not failures(results), "\n".join(failures(results)[:10])
    rss0, rss1, pg0, pg1 = per_rank[0][1:]
    assert pg0 == pg1  # no process group leaked
    assert rss1 - rss0 < 64  # MiB; no growth beyond allocator noise
    s = summarize(results)
    equal = s.get("match", 0) + s.get("match_semantic", 0)
    report[label] = (f"{s['cases']} transitions ({len(cases)} distinct, twice), {equal} equal to DTensor "
                     f"or the placements' meaning, {s['refused']} refused by both, 0 mismatches; rank 0 RSS "
                     f"{rss0:.0f} -> {rss1:.0f} MiB over the second pass; process groups {pg0} -> {pg1}")


@pytest.mark.slow  # a soak
def test_soak_world2_gloo(reliability_report):
    _soak(run_processes, 2, (2,), SOAK or 400, "soak, world 2 gloo, 1-D mesh", reliability_report)


@pytest.mark.slow  # a soak
def test_soak_world8_threaded(reliability_report):
    _soak(run_threaded, 8, (2, 4), SOAK or 240, "soak, world 8 threaded, 2x4 mesh", reliability_report)


def _env_body(rank, world):
    return os.environ.get("TPLOWER_TEST_MARK"), os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


def test_forked_ranks_take_the_callers_environment_at_the_call(monkeypatch):
    # the forkserver started long before (an earlier test): its environment is not the caller's now
    for mark in ("first", "second"):
        monkeypatch.setenv("TPLOWER_TEST_MARK", mark)
        assert run_processes(2, _env_body, start_method="forkserver") == [(mark, "1", 1)] * 2
    with pytest.raises(ValueError, match="start_method='fork'"):
        run_processes(2, _env_body, start_method="fork")


_ORPHAN_SCRIPT = """
import os, sys, time
from tplower.testing import run_processes

def body(rank, world, folder):
    open(os.path.join(folder, f"rank{rank}.pid"), "w").write(str(os.getpid()))
    time.sleep(120)  # far beyond the test: only the parent's death can end it early

if __name__ == "__main__":
    run_processes(2, body, sys.argv[1], timeout=300, start_method=sys.argv[2])
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited; only its parent's wait is missing
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_ranks_end_when_their_parent_is_killed(tmp_path, method):
    # SIGKILL runs no cleanup in the parent: each rank watches for it and ends by itself, not at the group's timeout
    script = tmp_path / "orphans.py"
    script.write_text(_ORPHAN_SCRIPT)
    private = tmp_path / "tmp"  # the run's temporary folder lands here, apart from other processes' folders
    private.mkdir()
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path), method],
                              env=os.environ | {"OMP_NUM_THREADS": "1", "TMPDIR": str(private)})
    pids: list[int] = []
    try:
        deadline = time.time() + 120
        while len(pids) < 2 and time.time() < deadline:
            time.sleep(0.2)
            pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid") if p.read_text()]
        assert len(pids) == 2, "the ranks did not start"
        parent.kill()
        parent.wait()
        deadline = time.time() + 20
        while any(_alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "ranks outlived their killed parent"
        assert not list(private.glob("tplower-*")), "the run's temporary folder was left"
    finally:
        parent.kill()
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
