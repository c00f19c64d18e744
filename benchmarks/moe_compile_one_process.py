"""Does torch.compile shorten the bench's MoE layer in one process, with no communication at all?

Feeds docs/hf-models.md ("Which to pick"): eager and compiled MoE layer in one process, 29.6 ms each.

    OMP_NUM_THREADS=1 python benchmarks/moe_compile_one_process.py [--rounds 15] [--backend inductor]

The ``tplower bench`` moe phase's Qwen3-MoE layer (:func:`tplower.bench.moe.moe_config`), one process, one
thread: a train step (forward, the bench's loss, backward) eager and compiled, interleaved, medians. It tells
how much of the compiled/eager ratio of the distributed EP step can come from compiling the layer at all.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from tplower.bench.moe import _ids, _loss, _model


def _step(model: nn.Module, ids: torch.Tensor) -> None:
    _loss(model, ids).backward()
    for p in model.parameters():
        p.grad = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    eager, compiled, ids = _model(), torch.compile(_model(), backend=args.backend), _ids()
    t0 = time.perf_counter()
    _step(compiled, ids)
    print(f"first compiled step (compiling): {time.perf_counter() - t0:.1f} s")
    for _ in range(3):
        _step(eager, ids)
        _step(compiled, ids)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        for name, model in (("eager", eager), ("compiled", compiled)):
            t0 = time.perf_counter()
            _step(model, ids)
            times[name].append(time.perf_counter() - t0)
    e, c = (statistics.median(times[k]) * 1e3 for k in ("eager", "compiled"))
    print(f"train step: eager {e:.1f} ms, compiled {c:.1f} ms, compiled/eager {c / e:.2f}")


if __name__ == "__main__":
    main()
