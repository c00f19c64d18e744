"""How much of the model step the collectives take, per copy, and the step tplower would reach with no CPU overhead.

Feeds benchmarks/README.md ("The eager step": time inside the all-reduces and the 0.89-0.97 bound),
indexed in docs/benchmarks.md ("Where each number comes from").

    python benchmarks/collective_wait.py [--rounds 20] [--runs 1] [--sentences 16] [--plain]

The model phase's MiniLM at tp=2 (:func:`tplower.bench.model._copies`: ``tplower`` and ``megatron``, the
hand-written Megatron-style copy) on 2 spawned gloo ranks, train steps interleaved, the order turning
every round, a barrier before each. Every ``torch.distributed.all_reduce`` call (the only collective
either copy issues at tp=2 without sequence parallelism) is timed from entry to return, which on gloo
includes waiting for the other rank. Rank 0 prints per copy the median step, the median time inside
the all_reduces, their count, and

    bound = (hand step - hand collectives + tplower collectives) / hand step

the ratio ``tplower / hand`` would be if tplower's CPU work between collectives were exactly the
hand-written copy's: the most that fewer collectives can give on this machine. ``--plain`` adds
``tplower_plain``, the tplower copy with plain local tensors for parameters (no DTensor dispatch), to
see what "DTensor outside" costs on real ranks. Nothing here is asserted by a test.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

NAMES = ("tplower", "megatron")


def _plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (parallelized) with each DTensor parameter replaced by a plain ``nn.Parameter`` of its local
    tensor: the boundaries and swaps then use it as it is (what a copy without "DTensor outside" would cost). Exact
    only where no parameter's gradient needs a reduction (this plan at tp=2, no sequence parallelism)."""
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if isinstance(p, DTensor):
                module._parameters[name] = torch.nn.Parameter(p._local_tensor.detach().clone(),
                                                              requires_grad=p.requires_grad)
    return model


def _rank(rank: int, world: int, rounds: int, sentences_n: int, plain: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from tplower.bench.model import _copies, _task
    from tplower.conformance import quiet_dtensor_logs
    from tplower.run.models import MINILM, load_model, sentences

    quiet_dtensor_logs()
    torch.manual_seed(0)
    task = _task()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    made = _copies(MINILM, mesh, mesh.get_group("tp"), lambda: load_model(MINILM)[0])
    names = NAMES
    if plain:
        made["tplower_plain"] = _plain_copy(copy.deepcopy(made["tplower"]))
        names = (*NAMES, "tplower_plain")
    _, tok = load_model(MINILM)
    batch = task.make_batch(MINILM, tok, sentences()[:sentences_n])
    opts = {k: torch.optim.SGD(made[k].parameters(), lr=1e-3) for k in names}
    inside = [0.0, 0.0]  # seconds inside all_reduce, calls
    original = dist.all_reduce

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - start
            inside[1] += 1.0

    samples: dict[str, list[tuple[float, float, int]]] = {k: [] for k in names}
    dist.all_reduce = timed  # type: ignore[assignment]  # tplower's collectives and the hand-written copy call it
    try:
        for r in range(3 + rounds):
            k = r % len(names)
            for key in names[k:] + names[:k]:
                dist.barrier()
                inside[:] = [0.0, 0.0]
                start = time.perf_counter()
                opts[key].zero_grad(set_to_none=True)
                task.training_loss("embedding", made[key], batch).backward()
                opts[key].step()
                step = time.perf_counter() - start
                if r >= 3:
                    samples[key].append((step, inside[0], int(inside[1])))
    finally:
        dist.all_reduce = original
    return {k: (statistics.median(s[0] for s in v) * 1e3, statistics.median(s[1] for s in v) * 1e3, v[0][2])
            for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds per run (default 20)")
    parser.add_argument("--runs", type=int, default=1, help="repeat the measurement (default 1)")
    parser.add_argument("--sentences", type=int, default=16, help="batch size, even (default 16, the model phase's)")
    parser.add_argument("--plain", action="store_true",
                        help="also time tplower_plain: the tplower copy with plain local tensors for parameters")
    args = parser.parse_args()
    from tplower.testing import run_processes

    print(f"MiniLM train step at tp=2, {args.sentences} sentences, 2 gloo ranks, {args.rounds} interleaved rounds "
          f"a run, medians in ms on rank 0; load {os.getloadavg()[0]:.1f}")
    bounds: list[float] = []
    for run in range(args.runs):
        got = run_processes(2, _rank, args.rounds, args.sentences, args.plain, timeout=1800)[0]
        for key, (step, coll, count) in got.items():
            print(f"  run {run + 1} {key:9s} step {step:7.1f}  in all_reduce {coll:6.1f} ({count} calls, "
                  f"{coll / max(count, 1):.2f} each)  step / hand {step / got['megatron'][0]:.3f}")
        hand_step, hand_coll, _ = got["megatron"]
        bounds.append((hand_step - hand_coll + got["tplower"][1]) / hand_step)
        print(f"  run {run + 1} bound (tplower / hand with the hand-written copy's CPU work): {bounds[-1]:.3f}")
    if args.runs > 1:
        print(f"  bound over {args.runs} runs: median {statistics.median(bounds):.3f} "
              f"({min(bounds):.3f}-{max(bounds):.3f})")
    print(f"load {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
