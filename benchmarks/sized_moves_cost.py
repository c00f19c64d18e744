"""Cost of never assuming that a sharded sequence divides: a sequence-parallel train step, sizes exchanged vs not.

Feeds docs/parallelize.md ("Uneven activations"): 3 to 6 % for exchanging uneven sizes.

A stack of pre-norm MLP blocks under sequence parallelism (each block's input ``S(1)`` on the sequence, gathered
before the column-parallel ``up``, reduce-scattered after the row-parallel ``down``) at tp=2 on 2 gloo ranks.
By default the gather's input is a move whose sequence length no parameter says, so each call the ranks exchange
its local size (one ``all_gather`` of one integer per block: :func:`tplower.runtime.uneven.agreed_global_shape`).
The same model with that exchange taken out (the even assumption tplower made before) runs interleaved with it;
the ratio of median train-step times (forward, backward, SGD step) is the price.

Run: python benchmarks/sized_moves_cost.py [--blocks 4] [--hidden 256] [--seq 128] [--steps 60]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import tplower
from tplower.testing import run_processes


class _Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _plan(blocks: int) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    for i in range(blocks):
        plan[f"{i}.norm"] = "sequence_parallel"
        plan[f"{i}.up"] = {"style": "colwise", "in_src": {"0": {"tp": "S(1)"}}}
        plan[f"{i}.down"] = {"style": "rowwise", "out_dst": {"out": {"tp": "S(1)"}}}
    return plan


def _unsized(model: nn.Module) -> int:
    """Take the size exchange out of every move (the old even assumption); returns how many moves had one."""
    count = 0
    for module in model.modules():
        b = module.__dict__.get("forward")
        if b is None or not hasattr(b, "ins"):
            continue
        count += sum(bool(mv.sized) for mv in (*b.ins, *b.outs))
        b.ins = tuple(dataclasses.replace(mv, sized=()) for mv in b.ins)
        b.outs = tuple(dataclasses.replace(mv, sized=()) for mv in b.outs)
    return count


def _body(rank: int, world: int, blocks: int, hidden: int, seq: int, steps: int) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ref = nn.Sequential(*(_Block(hidden) for _ in range(blocks)))
    sized = tplower.parallelize(copy.deepcopy(ref), mesh, _plan(blocks))
    even = tplower.parallelize(copy.deepcopy(ref), mesh, _plan(blocks))
    exchanges = _unsized(even)
    x = torch.randn(4, seq, hidden, generator=torch.Generator().manual_seed(1)).chunk(world, 1)[rank]
    models = {"sized": sized, "even": even}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    for i in range(steps + 5):
        for k, m in models.items():  # interleaved
            torch.distributed.barrier()
            t = time.perf_counter()
            opts[k].zero_grad()
            m(x).square().mean().backward()
            opts[k].step()
            if i >= 5:
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {**med, "ratio": med["sized"] / med["even"], "exchanges": float(exchanges)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args()
    res = run_processes(2, _body, a.blocks, a.hidden, a.seq, a.steps, timeout=1800)
    for rank, r in enumerate(res):
        print(f"rank {rank}: {a.blocks} blocks, hidden {a.hidden}, batch 4 x {a.seq}, tp=2 gloo, "
              f"{int(r['exchanges'])} size exchanges per forward; median train step: sizes exchanged "
              f"{r['sized']:.2f} ms, even assumed {r['even']:.2f} ms, ratio {r['ratio']:.3f}")


if __name__ == "__main__":
    main()
