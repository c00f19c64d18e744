"""Which context-parallel mode should be the default: Ulysses against K/V all-gather, measured.

Feeds docs/context.md through benchmarks/results/context_modes.md (the plain batch before and after the
mask-free kernels); ``tplower bench --phases context`` measures the modes today.

    python benchmarks/context_modes.py                          # seq 2048 and 8192, 4 layers, cp=2
    python benchmarks/context_modes.py --seqs 1024 --reps 3     # quicker

Two gloo ranks each build a tiny Llama (hidden 64, 4 query heads, 2 key/value
heads, head dim 16, vocabulary 128, ``sdpa``, float32; ``--layers``, at least
4) and install context parallelism on two copies (``ulysses``, ``allgather``,
:func:`tplower.context.install_context`). A train step is the forward and
backward of one batch of ``--batch`` rows of ``seq`` tokens from
``shard_sequence`` (the gradient reduction over ``cp`` that ``parallelize``
will add is the same for both modes and not part of the step). Per length:

* time: after a warm-up, ``--reps`` rounds, each running the modes one after
  the other (the order rotating every round), behind a barrier; a step's time
  is the slower rank's; medians. One process (rank 0 runs the reference
  model on the whole batch while rank 1 waits) is timed in the same rounds;
* collectives and bytes a rank sends per step, counted at the dispatcher
  (:class:`tplower.core.lower.traffic.CollectiveTraffic`) on an untimed step;
* peak tensor memory per rank over a step (every storage the step creates,
  alive at once: :func:`tplower.bench.memory.peak_tensor_bytes`, the bench's
  ``loss`` phase measure), against one process on the whole batch.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from tplower.testing import run_processes

MODES = ("ulysses", "allgather")


def _model(layers: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=1 << 17,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).float()


def _step(model: Any, part: dict[str, Any]) -> None:
    """Forward and backward; the batch's masks are built afresh, as for every new batch of a training loop."""
    from tplower.context import SPLIT_KEY

    if SPLIT_KEY in part:
        part = {**part, SPLIT_KEY: dataclasses.replace(part[SPLIT_KEY], cache={})}
    model.zero_grad(set_to_none=True)
    out = model(**part)
    out.loss.backward()


def _rank(rank: int, world: int, seqs: list[int], layers: int, batch: int, reps: int) -> dict[int, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from tplower.bench.memory import peak_tensor_bytes
    from tplower.context import install_context, shard_sequence
    from tplower.core.lower.traffic import CollectiveTraffic

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ref = _model(layers)
    models = {}
    for mode in MODES:
        models[mode] = copy.deepcopy(ref)
        install_context(models[mode], mesh, "cp", mode)
    out: dict[int, Any] = {}
    for seq in seqs:
        ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seq))
        whole = {"input_ids": ids, "labels": ids}
        part = shard_sequence(whole, mesh, "cp")
        runs = {mode: (lambda m=models[mode], p=part: _step(m, p)) for mode in MODES}
        runs["one process"] = lambda w=whole: _step(ref, {**w, "use_cache": False}) if rank == 0 else None
        names = list(runs)
        for name in names:  # warm-up
            runs[name]()
            dist.barrier()
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(reps):
            for name in names[r % len(names):] + names[:r % len(names)]:
                dist.barrier()
                start = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - start)
        traffic = {}
        for mode in MODES:
            with CollectiveTraffic() as t:
                runs[mode]()
            traffic[mode] = (dict(t.counts), t.sent)
        memory = {}
        for name in names:
            dist.barrier()
            memory[name] = peak_tensor_bytes(runs[name])[0]
        out[seq] = {"times": times, "traffic": traffic, "memory": memory}
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def report(results: list[dict[int, Any]], layers: int, batch: int) -> str:
    """The table: per length and mode, the median step (slower rank), collectives, MiB sent, peak MiB per rank."""
    lines = [f"tiny Llama, {layers} layers, 4 heads / 2 kv heads, head dim 16, sdpa, float32, batch {batch}, cp=2",
             "", "| seq | mode | step s (median, slower rank) | vs one process | collectives per step per rank | "
             "MiB sent per step per rank | peak tensor MiB per rank | vs one process |",
             "|---|---|---|---|---|---|---|---|"]
    for seq in results[0]:
        per = [r[seq] for r in results]
        one_t = statistics.median(per[0]["times"]["one process"])
        one_m = per[0]["memory"]["one process"]
        lines.append(f"| {seq} | one process | {one_t:.3f} | 1.00 | - | - | {_mib(one_m)} | 1.00 |")
        for mode in MODES:
            step = statistics.median(max(ts) for ts in zip(*(p["times"][mode] for p in per), strict=True))
            counts = per[0]["traffic"][mode][0]
            peak = max(p["memory"][mode] for p in per)
            what = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            lines.append(f"| {seq} | {mode} | {step:.3f} | {step / one_t:.2f} | {what} | "
                         f"{_mib(max(p['traffic'][mode][1] for p in per))} | {_mib(peak)} | {peak / one_m:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    results = run_processes(2, _rank, args.seqs, args.layers, args.batch, args.reps, timeout=7200)
    print(report(results, args.layers, args.batch))


if __name__ == "__main__":
    main()
