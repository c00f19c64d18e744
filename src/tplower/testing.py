"""Harnesses that run one body on many ranks: real processes, or threads.

Both call ``fn(rank, world_size, *args)`` on every rank after the default
process group is up and return the per-rank results in rank order. Both
end every rank they started, and raise :class:`RankFailure` naming the
failed ranks when any rank raises, dies or outlives ``timeout`` (seconds).

* :func:`run_processes`: ``torch.multiprocessing`` spawn, gloo by default,
  a ``FileStore`` rendezvous in a temporary folder (no port to collide on),
  ``OMP_NUM_THREADS=1`` in each rank. ``fn`` and ``args`` must pickle.
  With ``start_method="forkserver"`` (:data:`START_METHOD` sets the default)
  ranks fork from a server that imported torch and tplower once: a rank
  starts in well under a second instead of the 4 s those imports take here.
* :func:`run_threaded`: PyTorch's threaded test process group
  (``torch.testing._internal``), many ranks in one process in about a
  second, with a watchdog: a failing rank wakes the others.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import pickle
import queue
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .core.support.teardown import shutdown
from .core.support.words import count

__all__ = ["RankFailure", "run_processes", "run_threaded"]

RankFn = Callable[..., Any]

#: how :func:`run_processes` starts ranks when not told: ``spawn`` (a fresh
#: interpreter per rank) or ``forkserver`` (a fork of a server process that
#: imported :data:`PRELOAD` once; Linux and macOS). The test suite sets
#: ``forkserver``.
START_METHOD = "spawn"
#: what a ``forkserver`` imports once, before it forks any rank
PRELOAD = ("tplower.testing",)


class RankFailure(RuntimeError):
    """One or more ranks raised, died or timed out; ``failures`` maps rank to its report."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = dict(sorted(failures.items()))
        lines = [f"rank {r} failed:\n{msg}" for r, msg in self.failures.items()]
        super().__init__(f"{count(len(self.failures), 'rank')} failed: {sorted(self.failures)}\n" + "\n".join(lines))


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _exit_with(caller: int, folder: str, every: float = 1.0) -> None:
    """End this rank soon after the process that started the run (``caller``) is gone, killed with SIGKILL, which
    runs no cleanup: a rank left behind would wait in a collective until its process group's timeout, holding a
    core. Spawned ranks are the caller's children (re-parented when it dies); a fork server's outlive it, so the
    caller's pid is watched too. The run's temporary ``folder`` (the caller's, left by its death) goes first."""
    parent = os.getppid()

    def gone() -> bool:
        if os.getppid() != parent:
            return True
        try:
            os.kill(caller, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # exists, another user's: not the caller any more, but alive
            return False
        return False

    def watch() -> None:
        while not gone():
            time.sleep(every)
        shutil.rmtree(folder, ignore_errors=True)  # every rank tries; whichever comes first removes it
        os._exit(1)

    threading.Thread(target=watch, name="tplower-parent-watch", daemon=True).start()


def _process_entry(rank: int, world_size: int, backend: str, init_file: str, timeout: float,
                   results: Any, fn: RankFn, args: tuple[Any, ...], env: dict[str, str] | None = None,
                   caller: int | None = None) -> None:
    if env is not None:  # a fork of the server has the server's environment: take the caller's, as spawn does
        os.environ.clear()
        os.environ.update(env)
    if caller is not None:
        _exit_with(caller, os.path.dirname(init_file))
    # a rank killed by a signal (a native abort, a segfault) leaves every thread's Python stack in this file,
    # which the harness names with the rank's death (:func:`_name_the_dead`)
    fault = open(_fault_file(init_file, rank), "w")
    faulthandler.enable(file=fault, all_threads=True)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            # pickled here, by value: a tensor put as it is travels as a file descriptor that the parent can
            # only open while this process lives, and this process exits right after
            results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        finally:
            shutdown()  # destroys the group and joins gloo's workers while Python is whole
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _collect(procs: list[Any], results: Any, timeout: float, grace: float, out: dict[int, Any],
             failures: dict[int, str], init_file: str) -> None:
    """Fill ``out``/``failures`` from the ranks' reports until every rank reported or the run must stop.

    The run stops ``grace`` seconds after the first rank fails or dies (its peers are then
    usually blocked in a collective that will never complete), or at ``timeout``, the last resort;
    the ranks still running are named as failed, with the reason.
    """
    start = time.monotonic()
    first_failure: float | None = None
    reason = ""
    while len(out) + len(failures) < len(procs):
        now = time.monotonic()
        if first_failure is not None and now - first_failure >= grace:
            ranks = "rank" if len(failures) == 1 else "ranks"
            reason = f"ended by the harness {grace:g} s after {ranks} {sorted(failures)} failed"
            break
        if now - start >= timeout:
            reason = f"no result within {timeout:.0f} s"
            break
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            _name_the_dead(procs, out, failures, init_file)
        else:
            _report(out, failures, rank, ok, value)
        if failures and first_failure is None:
            first_failure = time.monotonic()
    _drain(procs, results, out, failures, init_file)
    for r in range(len(procs)):
        if r not in out and r not in failures:
            failures[r] = reason


def _report(out: dict[int, Any], failures: dict[int, str], rank: int, ok: bool, value: Any) -> None:
    """File one rank's report: its result (unpickled: see :func:`_process_entry`) or its traceback."""
    if ok:
        out[rank] = pickle.loads(value)
    else:
        failures[rank] = value


def _drain(procs: list[Any], results: Any, out: dict[int, Any], failures: dict[int, str], init_file: str) -> None:
    """Last look before the run is ended: reports already queued, and ranks already dead, named as such.

    A rank that died just before the deadline is then named for its death,
    not for the deadline, however slow the machine made the others.
    """
    while True:
        try:
            rank, ok, value = results.get(timeout=0.05)
        except queue.Empty:
            break
        _report(out, failures, rank, ok, value)
    _name_the_dead(procs, out, failures, init_file)


def _fault_file(init_file: str, rank: int) -> str:
    """Where rank ``rank``'s ``faulthandler`` writes, beside the store (removed with it)."""
    return os.path.join(os.path.dirname(init_file), f"fault-rank{rank}.txt")


def _name_the_dead(procs: list[Any], out: dict[int, Any], failures: dict[int, str], init_file: str) -> None:
    """Ranks whose process has exited without a report, named by their exit code, with the Python stacks
    ``faulthandler`` wrote when a signal ended it (a native abort: glibc's heap checks, a segfault)."""
    for r, p in enumerate(procs):
        if not p.is_alive() and r not in out and r not in failures and p.exitcode != 0:
            failures[r] = f"process exited with code {p.exitcode}"
            try:
                with open(_fault_file(init_file, r)) as f:
                    trace = f.read().strip()
            except OSError:
                trace = ""
            if trace:
                failures[r] += f"; its threads when the signal came (faulthandler):\n{trace}"


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored inside (in the main thread): processes started there keep ignoring it, even across exec."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def run_processes(world_size: int, fn: RankFn, *args: Any, backend: str = "gloo",
                  timeout: float = 300.0, pg_timeout: float | None = None, grace: float = 3.0,
                  start_method: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    Args:
        world_size: number of ranks (1 or more).
        fn: a module-level function (it must pickle).
        backend: ``gloo`` (CPU) or ``nccl``.
        timeout: seconds for the whole run (the last resort).
        pg_timeout: the process group's timeout in seconds (default ``timeout``):
            a collective waiting longer raises in that rank.
        grace: once a rank has failed or died, seconds the others get to
            report (ranks that fail alike, as the debug check makes them,
            all report within it) before the harness ends them: a peer
            blocked in a collective with the failed rank would otherwise
            wait for ``pg_timeout``.
        start_method: ``spawn`` or ``forkserver`` (default :data:`START_METHOD`).
            A forked rank gets the caller's environment at this call (as a
            spawned one does), but modules the server imported read theirs
            when it started.

    Returns:
        ``fn``'s return values, in rank order (each pickled by value in its rank, tensors included, so it
        must pickle; a value that does not is that rank's failure).

    Raises:
        RankFailure: a rank raised (its traceback is included), died, or the
            run outlived ``timeout``; every process is ended first, and
            ranks ended by the harness are named with the reason.

    The ranks ignore SIGINT: a Ctrl-C at the terminal (which signals the
    whole process group) interrupts this process only, and its clean-up
    ends every rank (at once, without the usual wait) and removes the
    temporary folder, whatever exception interrupted it.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    method = START_METHOD if start_method is None else start_method
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method={method!r}: expected 'spawn' or 'forkserver'")
    ctx: Any = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts (the first call)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="tplower-") as tmp, _env(OMP_NUM_THREADS="1"):
        init_file = os.path.join(tmp, "store")
        env = dict(os.environ) if method == "forkserver" else None
        procs = [ctx.Process(target=_process_entry, daemon=True,
                             args=(r, world_size, backend, init_file, pg_timeout or timeout, results, fn, args,
                                   env, os.getpid()))
                 for r in range(world_size)]
        with _sigint_ignored():  # inherited: a Ctrl-C at the terminal reaches this process, which ends the ranks
            for p in procs:
                p.start()
        out: dict[int, Any] = {}
        failures: dict[int, str] = {}
        stopped = False  # interrupted (Ctrl-C, a signal turned into an exception): end the ranks at once
        try:
            _collect(procs, results, timeout, grace, out, failures, init_file)
        except BaseException:
            stopped = True
            raise
        finally:
            for p in procs:
                # a rank that returned its result exits by itself; under load its teardown (a compile worker
                # pool, the group) can take seconds, and a rank ended mid-teardown leaks what it held
                p.join(timeout=0 if stopped else 10 if not failures else 0.1)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
            results.close()
            results.join_thread()
    if failures:
        raise RankFailure(failures)
    return [out[r] for r in range(world_size)]


def _clear_dtensor_caches() -> None:
    # DTensor caches redistribution plans process-wide, keyed by meshes that compare equal across
    # runs (thread idents are reused); a plan cached for a rank of an earlier run would be wrong here.
    from torch.distributed.tensor import _redistribute

    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()


def run_threaded(world_size: int, fn: RankFn, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` threads of one process.

    Uses PyTorch's threaded process group (backend name ``threaded``): real
    collective semantics, no data leaves the process. One rank at a time
    may be inside a collective per group; a rank that raises wakes the
    others, which then end too.

    Raises:
        RankFailure: a rank raised, or a rank outlived ``timeout`` seconds.
    """
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    c10d: Any = torch._C._distributed_c10d

    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    _clear_dtensor_caches()
    c10d._set_thread_isolation_mode(True)
    world = mtpg._install_threaded_pg()
    store = c10d.HashStore()
    out: list[Any] = [None] * world_size
    failures: dict[int, str] = {}

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            out[rank] = fn(rank, world_size, *args)
        except BaseException as exc:
            if not (isinstance(exc, SystemExit) and failures):  # woken by another rank's failure
                failures[rank] = traceback.format_exc()
            mtpg.ProcessLocalGroup.exception_handle(exc)
        finally:
            if world == dist.distributed_c10d._world:
                dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        for rank, t in enumerate(threads):
            t.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
            if t.is_alive():
                failures.setdefault(rank, f"no result within {timeout:.0f} s")
        if any(t.is_alive() for t in threads):
            mtpg.ProcessLocalGroup.exception_handle(TimeoutError("tplower.testing watchdog"))
            for t in threads:
                t.join(5)
    finally:
        mtpg.ProcessLocalGroup.reset()
        mtpg._uninstall_threaded_pg()
        c10d._set_thread_isolation_mode(False)
        _clear_dtensor_caches()
    if failures:
        raise RankFailure(failures)
    return out
