"""The bench's ``context`` phase: a long sequence's train step under context parallelism, both modes, measured.

Two gloo ranks each build a tiny Llama (hidden 64, 4 query heads, 2
key/value heads of 16, vocabulary 128, ``sdpa``, float32, at least 4 layers)
and run one batch of ``seq`` tokens (8192 by default) four ways:

* ``one process``: the whole batch on rank 0 (rank 1 waits);
* ``cp ulysses`` and ``cp allgather``: ``parallelize(model, mesh, None,
  context="cp", context_mode=...)`` on ``tplower.shard_sequence``'s part;
* ``tp``: ``parallelize(model, mesh, "auto")`` at tp=2, the whole sequence
  on each rank (its attention over the whole sequence on every rank).

A train step is forward, backward and an SGD step. Per variant: the step's
median time over interleaved rounds (the slower rank's, behind barriers;
:func:`tplower.bench.timing.barrier_rounds`), each rank's peak tensor memory
over a step (:func:`tplower.bench.memory.peak_tensor_bytes`, the ``loss``
phase's measure), the collectives and bytes a rank sends, counted at the
dispatcher (:class:`tplower.core.lower.traffic.CollectiveTraffic`), and for the two
context-parallel modes the bytes ``tplower explain --context`` predicts.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..testing import run_processes
from .memory import peak_tensor_bytes
from .timing import barrier_rounds

__all__ = ["CONTEXT_LAYERS", "CONTEXT_SEQ", "context_phase", "context_rank"]

#: the default sequence and depth of the phase
CONTEXT_SEQ, CONTEXT_LAYERS = 8192, 4
_HIDDEN, _HEADS, _KV, _HEAD_DIM = 64, 4, 2, 16


def _model(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=_HIDDEN, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=_HEADS, num_key_value_heads=_KV, head_dim=_HEAD_DIM,
                             vocab_size=128, max_position_embeddings=1 << 17)
        config._attn_implementation = "sdpa"
        model: torch.nn.Module = LlamaForCausalLM(config).float()
    return model


def context_rank(rank: int, world: int, seq: int, layers: int, rounds: int) -> list[dict[str, Any]]:
    """Time and measure every variant on this rank; rank 0 returns the rows (see the module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..context import SPLIT_KEY, shard_sequence
    from ..context.explain import explain_context
    from ..core.lower.traffic import CollectiveTraffic
    from ..nn.parallelize import parallelize

    cp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ref = _model(layers)
    models = {"one process": ref,
              **{f"cp {m}": parallelize(copy.deepcopy(ref), cp_mesh, None, context="cp", context_mode=m)
                 for m in ("ulysses", "allgather")},
              "tp": parallelize(copy.deepcopy(ref), tp_mesh, "auto")}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    ids = torch.randint(0, 128, (1, seq), generator=torch.Generator().manual_seed(seq))
    whole = {"input_ids": ids, "labels": ids, "use_cache": False}
    part = shard_sequence({"input_ids": ids, "labels": ids}, cp_mesh, "cp")

    def step(key: str) -> None:
        if key == "one process" and rank != 0:
            return
        batch: dict[str, Any] = whole
        if key.startswith("cp"):  # a new batch's masks are built afresh, as in a training loop
            batch = {**part, SPLIT_KEY: dataclasses.replace(part[SPLIT_KEY], cache={})}
        opts[key].zero_grad(set_to_none=True)
        models[key](**batch).loss.backward()
        opts[key].step()

    samples = barrier_rounds(list(models), step, rounds)
    peaks, traffic = {}, {}
    for key in models:
        dist.barrier()
        peaks[key] = peak_tensor_bytes(lambda k=key: step(k))[0]  # type: ignore[misc]
        with CollectiveTraffic() as t:
            step(key)
        traffic[key] = (dict(t.counts), t.sent)
    params = sum(p.numel() for p in ref.parameters())
    predicted = explain_context(1, seq, _HIDDEN, _HEADS, _KV, world, layers=layers, head_dim=_HEAD_DIM,
                                params=params)
    peaks_all: list[dict[str, int]] = [{}] * world
    dist.all_gather_object(peaks_all, peaks)
    if rank != 0:
        return []
    return [{"variant": k, "seq": seq, "layers": layers, "world": world, "train_step_ms": statistics.median(v),
             "step_samples_ms": v, "peak_bytes": max(p[k] for p in peaks_all), "counts": traffic[k][0],
             "sent_bytes": traffic[k][1],
             "predicted_bytes": predicted[k[3:]]["step_bytes_per_rank"] if k.startswith("cp") else None}
            for k, v in samples.items()]


def context_phase(rounds: int, *, seq: int = CONTEXT_SEQ, layers: int = CONTEXT_LAYERS, timeout: float = 900.0,
                  progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """The context phase's rows (:func:`context_rank` on 2 spawned gloo ranks).

    Raises:
        ValueError: ``layers`` below 4 or ``seq`` below 2.
        tplower.testing.RankFailure: a rank failed (transformers missing included).
    """
    if layers < 4 or seq < 2:
        raise ValueError(f"context phase: layers={layers} (at least 4) and seq={seq} (at least 2)")
    progress(f"context: tiny Llama ({layers} layers) at {seq} tokens, cp=2 both modes, tp=2 and one process")
    rows: list[dict[str, Any]] = run_processes(2, context_rank, seq, layers, rounds, timeout=timeout)[0]
    return rows
