"""``python -m tplower.planner.worker``: trace the candidates it is sent, each result written back as it is done.

Stdin: pickled ``(index, task)`` pairs, one after another (the caller sends the next when a result comes back, so
busy workers share the tasks evenly); stdout: one pickled ``(index, StepTrace | reason)`` per task. A separate
interpreter (not ``multiprocessing``): it needs no ``if __name__ == "__main__"`` guard in the caller's script and no
process group of the caller's (the trace makes a fake one).
"""

from __future__ import annotations

import pickle
import sys


def main() -> None:
    """Read the tasks, trace each (:func:`tplower.planner.search._task`), write each result."""
    import torch

    torch.set_num_threads(1)
    from .search import _task

    out = sys.stdout.buffer
    while True:
        try:
            index, task = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        pickle.dump((index, _task(*task)), out)
        out.flush()


if __name__ == "__main__":
    main()
