"""The processes that trace :func:`tplower.planner.plan_layout`'s candidates: :func:`run_tasks` hands them out;
``python -m tplower.planner.worker`` traces the candidates it is sent, each result written back as it is done.

Stdin: the pickled function to run, then pickled ``(index, task)`` pairs, one after another (the caller sends the
next when a result comes back, so busy workers share the tasks evenly); stdout: one pickled ``(index, StepTrace |
reason)`` per task. A separate interpreter (not ``multiprocessing``): it needs no ``if __name__ == "__main__"``
guard in the caller's script and no process group of the caller's (the trace makes a fake one).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["main", "run_tasks"]


def run_tasks(run: Callable[..., Any], tasks: list[tuple[Any, ...]], start: list[int], workers: int,
              follow: Callable[[int, Any], list[int]]) -> Iterator[tuple[int, Any]]:
    """``(index, run(*tasks[index]))`` for the tasks of ``start`` and every index ``follow(index, outcome)``
    returns after each, as each finishes: in this process (``workers == 1`` and no process group here), or in
    ``workers`` interpreters of this module, each sent a task when it is free (a process group here would refuse
    the fake one a trace makes). ``run`` is what a worker runs (:func:`tplower.planner.search._task`).

    A worker that ends (killed, out of memory) gives the task it held, and those nobody took, the reason
    ``"could not be traced: the worker ended (<its last line on stderr>)"``.
    """
    import torch.distributed as dist

    if not start:
        return
    if workers == 1 and not (dist.is_available() and dist.is_initialized()):
        waiting = deque(start)
        while waiting:
            index = waiting.popleft()
            outcome = run(*tasks[index])
            yield index, outcome
            waiting.extend(follow(index, outcome))
        return
    results: queue.Queue[tuple[int, Any] | None] = queue.Queue()
    todo: queue.Queue[int | None] = queue.Queue()
    for index in start:
        todo.put(index)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ended: list[str] = []

    def drive() -> None:
        log = tempfile.TemporaryFile()  # its warnings (a pipe left unread would fill and stop it)
        proc = subprocess.Popen([sys.executable, "-m", "tplower.planner.worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, env=env)
        assert proc.stdin is not None and proc.stdout is not None
        index: int | None = None
        try:
            pickle.dump(run, proc.stdin)  # (by its module and name)
            while (index := todo.get()) is not None:
                pickle.dump((index, tasks[index]), proc.stdin)
                proc.stdin.flush()
                results.put(pickle.load(proc.stdout))
                index = None
        except (EOFError, pickle.UnpicklingError, BrokenPipeError, OSError):
            proc.kill()
            proc.wait()
            log.seek(0)
            err = log.read().decode(errors="replace").strip().splitlines()
            ended.append(f"could not be traced: the worker ended ({err[-1] if err else f'exit code {proc.poll()}'})")
            if index is not None:
                results.put((index, ended[-1]))
        finally:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            proc.wait()
            log.close()
            results.put(None)

    threads = [threading.Thread(target=drive, daemon=True) for _ in range(min(workers, len(start)))]
    for t in threads:
        t.start()
    running, outstanding = len(threads), len(start)
    left: list[int] = []
    try:
        while running and outstanding:
            item = results.get()
            if item is None:
                running -= 1
                continue
            index, outcome = item
            outstanding -= 1
            yield index, outcome
            for more in follow(index, outcome):
                todo.put(more)
                outstanding += 1
        while True:  # (tasks nobody took: every worker ended early)
            try:
                leftover = todo.get_nowait()
            except queue.Empty:
                break
            if leftover is not None:
                left.append(leftover)
    finally:  # (also when the caller stops early or follow raises: no worker is left waiting)
        for _ in threads:
            todo.put(None)  # each worker ends when it reads the end of its input
        for t in threads:
            t.join()
    for index in left:
        yield index, ended[-1] if ended else "could not be traced: no worker took it"


def main() -> None:
    """Read the function to run, then each task: run it, write the result."""
    import torch

    torch.set_num_threads(1)
    run = pickle.load(sys.stdin.buffer)
    out = sys.stdout.buffer
    while True:
        try:
            index, task = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        pickle.dump((index, run(*task)), out)
        out.flush()


if __name__ == "__main__":
    main()
