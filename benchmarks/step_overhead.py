"""The CPU cost of a parallelized model step beside the hand-written one, with no communication: one process.

Feeds docs/benchmarks.md (``benchmarks/ab.py --fake``, which runs it: the step's CPU work alone before landing)
and the eager-step history in benchmarks/README.md ("The eager step": the step's CPU work per part).

The model phase's copies of all-MiniLM-L6-v2 at tp=2 (:func:`tplower.bench.model._copies`: ``tplower``,
``megatron``, the hand-written Megatron-style one, and ``dtensor``, ``parallelize_module``'s), built in one
process that is rank 0 of a ``fake`` group of ``--world`` ranks: every collective returns at once and moves
nothing, so a step runs every kernel and every line of Python of the real step on rank 0's shapes, and the
differences between the copies are CPU work alone (dispatch, Python, copies, allocations), without the
scheduling noise of real ranks on a shared machine. The copies run interleaved, the order turning every
round; each step is timed in four parts (``zero_grad``, forward with the loss, backward, optimizer) and
whole. Prints per part the median milliseconds and each copy's whole step over the hand-written one::

    python benchmarks/step_overhead.py [--rounds 30] [--runs 3] [--copies tplower,megatron,dtensor] [--clock cpu]

Nothing here is asserted by a test; read the ratios, measured within one run, beside the load average.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

PARTS = ("zero_grad", "forward", "backward", "optimizer", "step")


def _copies(names: list[str], world: int, sentences_n: int = 16, clock: Callable[[], float] = time.perf_counter
            ) -> tuple[dict[str, Any], Callable[[str], list[float]]]:
    from torch.distributed.device_mesh import init_device_mesh

    from tplower.bench.model import _copies as bench_copies
    from tplower.bench.model import _task
    from tplower.conformance import quiet_dtensor_logs
    from tplower.run.models import MINILM, load_model, sentences

    quiet_dtensor_logs()
    torch.manual_seed(0)
    task = _task()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    made = bench_copies(MINILM, mesh, mesh.get_group("tp"), lambda: load_model(MINILM)[0])
    models = {k: made[k] for k in names}
    _, tok = load_model(MINILM)
    batch = task.make_batch(MINILM, tok, sentences()[:sentences_n])
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}

    def step(key: str) -> list[float]:
        t = [clock()]
        opts[key].zero_grad(set_to_none=True)
        t.append(clock())
        loss = task.training_loss("embedding", models[key], batch)
        t.append(clock())
        loss.backward()
        t.append(clock())
        opts[key].step()
        t.append(clock())
        return [b - a for a, b in itertools.pairwise(t)] + [t[-1] - t[0]]

    return models, step


def _run(names: list[str], step: Callable[[str], list[float]], rounds: int, warmup: int) -> dict[str, list[float]]:
    """Per copy, the median milliseconds of each part over ``rounds`` interleaved rounds."""
    samples: dict[str, list[list[float]]] = {k: [] for k in names}
    for r in range(warmup + rounds):
        k = r % len(names)
        for key in names[k:] + names[:k]:
            got = step(key)
            if r >= warmup:
                samples[key].append(got)
    return {k: [statistics.median(s[i] for s in v) * 1e3 for i in range(len(PARTS))] for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks the fake group pretends to have (default 2)")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per run (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    parser.add_argument("--runs", type=int, default=1, help="repeat the measurement (default 1)")
    parser.add_argument("--copies", default="tplower,megatron,dtensor",
                        help="copies to time; ratios are to megatron's step (default tplower,megatron,dtensor)")
    parser.add_argument("--sentences", type=int, default=16,
                        help="batch size, even (default 16, the model phase's); 2 leaves mostly the per-call overhead")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: time.perf_counter (default); cpu: time.thread_time, this thread's CPU time, "
                             "which other processes on a shared machine disturb far less")
    parser.add_argument("--json", action="store_true", help="also print each run's medians as one JSON line")
    args = parser.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    names = args.copies.split(",")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    _, step = _copies(names, args.world, args.sentences, clock)
    print(f"MiniLM train step, {args.sentences} sentences, fake group of {args.world} (no communication), one process, "
          f"{args.rounds} interleaved rounds a run, medians in ms of {args.clock} time; load {os.getloadavg()[0]:.1f}")
    ratios: dict[str, list[float]] = {k: [] for k in names if k != "megatron"}
    for run in range(args.runs):
        got = _run(names, step, args.rounds, args.warmup)
        for key, parts in got.items():
            cells = "  ".join(f"{p} {v:7.2f}" for p, v in zip(PARTS, parts, strict=True))
            ratio = f"  / megatron {parts[-1] / got['megatron'][-1]:.3f}" if "megatron" in got else ""
            print(f"  run {run + 1} {key:10s} {cells}{ratio}")
            if key in ratios and "megatron" in got:
                ratios[key].append(parts[-1] / got["megatron"][-1])
        if args.json:
            print("STEP-JSON " + json.dumps({k: dict(zip(PARTS, v, strict=True)) for k, v in got.items()}))
    if args.runs > 1:
        for key, v in ratios.items():
            print(f"  {key} / megatron step over {args.runs} runs: median {statistics.median(v):.3f} "
                  f"({min(v):.3f}-{max(v):.3f})")
    print(f"load {os.getloadavg()[0]:.1f} at end")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
