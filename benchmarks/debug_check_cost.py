"""Cost of the debug check (TPLOWER_DEBUG=1 / check=True) per redistribute_local call, gloo, 2 ranks.

Feeds docs/placements.md ("When ranks disagree"): the debug check's cost per call.

Run: python benchmarks/debug_check_cost.py   (prints medians in microseconds per call)
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.distributed.device_mesh import init_device_mesh

from tplower import redistribute_local
from tplower.testing import run_processes


def _body(rank: int, world: int, reps: int) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = torch.randn(8, 16)
    samples: dict[str, list[float]] = {"plain": [], "check": []}
    for i in range(reps + 20):
        for mode in ("plain", "check"):  # interleaved
            t = time.perf_counter()
            redistribute_local(x, mesh, "S(0)", "R", check=(mode == "check"))
            if i >= 20:
                samples[mode].append((time.perf_counter() - t) * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    res = run_processes(2, _body, 300)[0]
    print(f"S(0)->R of an (8, 16) float32 shard, gloo, 2 ranks, median us/call: plain {res['plain']:.0f}, "
          f"with the debug check {res['check']:.0f} (+{res['check'] - res['plain']:.0f})")


if __name__ == "__main__":
    main()
