"""``tplower bench`` as a script, for launchers that take a file (``torchrun``).

Feeds docs/benchmarks.md (``tplower bench``) for runs under ``torchrun``; every phase and figure is
``tplower bench``'s own.

    # CPU, spawned gloo processes (world 2 and 4), every phase:
    python benchmarks/bench.py --out bench-out
    # the launcher's ranks (NCCL on GPUs), micro and memory phases:
    torchrun --nproc-per-node 8 benchmarks/bench.py --device cuda --phases micro,memory --out bench-out

Same options as ``tplower bench --help``.
"""

from __future__ import annotations

import sys

from tplower.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
