"""``python -m tplower.planner.worker``: trace the candidates it is sent, each result written back as it is done.

Stdin: one pickled list of ``(index, task)``; stdout: one pickled ``(index, StepTrace | reason)`` per task, in the
order they finish. A separate interpreter (not ``multiprocessing``): it needs no ``if __name__ == "__main__"``
guard in the caller's script and no process group of the caller's (the trace makes a fake one).
"""

from __future__ import annotations

import pickle
import sys


def main() -> None:
    """Read the tasks, trace each (:func:`tplower.planner.search._task`), write each result."""
    import torch

    torch.set_num_threads(1)
    from .search import _task

    tasks = pickle.load(sys.stdin.buffer)
    out = sys.stdout.buffer
    for index, task in tasks:
        pickle.dump((index, _task(*task)), out)
        out.flush()


if __name__ == "__main__":
    main()
