"""The context phase's model and batches, and its last two tables: the longest sequence a budget trains, the loss.

* :func:`context_model` and :func:`context_batch`: the tiny Llama and the
  batches every table of :mod:`tplower.bench.context` measures;
* :func:`budget_rows`: the longest plain sequence (a multiple of
  :data:`GRAIN` tokens) whose train step peaks within ``budget`` bytes per
  rank, under Ulysses at this spawn's cp size (and one process on rank 0 when
  asked). A step's peak grows linearly with the length once no ``[S, S]``
  table is left, so two short steps predict the length; steps around the
  prediction then find it, and the row keeps the next grain's peak, which is
  over the budget.
* :func:`loss_rows`: a vocabulary of 32000 at cp=2 (this spawn's size), the
  whole logits against ``context_loss_chunk``: the train step's time and peak
  per rank, the peak of the loss alone (the output head and the loss, forward
  and backward, from this rank's final hidden states) and how far the chunked
  loss and its gradients are from the whole one.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .config import CONTEXT_BATCHES
from .memory import peak_tensor_bytes
from .timing import barrier_rounds

__all__ = ["BATCHES", "GRAIN", "budget_rows", "context_batch", "context_model", "loss_rows"]

#: the lengths the budget search tries are multiples of this many tokens
GRAIN = 512
#: the kinds of batch the phase measures
BATCHES = CONTEXT_BATCHES
_HIDDEN, _HEADS, _KV, _HEAD_DIM, _VOCAB = 64, 4, 2, 16, 128


def context_model(layers: int, vocab: int = _VOCAB) -> torch.nn.Module:
    """The phase's tiny Llama (module docstring) with ``layers`` layers and a ``vocab`` vocabulary, seed 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=_HIDDEN, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=_HEADS, num_key_value_heads=_KV, head_dim=_HEAD_DIM,
                             vocab_size=vocab, max_position_embeddings=1 << 18)
        config._attn_implementation = "sdpa"
        model: torch.nn.Module = LlamaForCausalLM(config).float()
    return model


def context_batch(kind: str, seq: int, vocab: int = _VOCAB) -> dict[str, torch.Tensor]:
    """One row of ``seq`` token ids with their labels: ``plain``; ``padded`` (the last ``seq // 8`` tokens padding:
    ``attention_mask`` 0, labels -100); ``packed`` (4 documents of ``seq / 4`` tokens: position ids restarting)."""
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
    out = {"input_ids": ids, "labels": ids.clone()}
    if kind == "padded":
        mask = torch.ones(1, seq, dtype=torch.long)
        mask[:, seq - seq // 8:] = 0
        out["attention_mask"] = mask
        out["labels"][mask == 0] = -100
    elif kind == "packed":
        positions = torch.arange(seq).view(1, seq).clone()
        for d in range(1, 4):
            positions[0, d * seq // 4:] = torch.arange(seq - d * seq // 4)
        out["position_ids"] = positions
    return out


def _search(peak_of: Callable[[int], int], budget: int, first: int) -> dict[str, Any]:
    """The longest multiple of :data:`GRAIN` whose ``peak_of`` is within ``budget``: predicted from the peaks at
    ``first`` and ``2 * first`` tokens, then stepped one grain at a time until the next grain is over it."""
    seen: dict[int, int] = {}

    def peak(seq: int) -> int:
        if seq not in seen:
            seen[seq] = peak_of(seq)
        return seen[seq]

    a, b = peak(first), peak(2 * first)
    slope = max(1.0, (b - a) / first)
    seq = max(GRAIN, int((budget - a) / slope + first) // GRAIN * GRAIN)
    for _ in range(12):
        if peak(seq) > budget and seq > GRAIN:
            seq -= GRAIN
        elif peak(seq) <= budget and peak(seq + GRAIN) <= budget:
            seq += GRAIN
        else:
            break
    return {"longest_seq": seq, "peak_bytes": peak(seq), "next_seq": seq + GRAIN,
            "next_peak_bytes": peak(seq + GRAIN), "measured": sorted(seen.items())}


def budget_rows(rank: int, world: int, budget: int, layers: int, one_process: bool) -> list[dict[str, Any]]:
    """The longest plain sequence within ``budget`` bytes per rank at cp=``world`` (Ulysses), and at cp=1 (one
    process, on rank 0) with ``one_process``; rank 0 returns the rows."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..context import shard_sequence
    from ..nn.parallelize import parallelize

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ref = context_model(layers)
    cp_model = parallelize(copy.deepcopy(ref), mesh, None, context="cp")

    def peak_of(cp: int) -> Callable[[int], int]:
        def measure(seq: int) -> int:
            whole = context_batch("plain", seq)
            mine = 0
            if cp > 1:
                part = shard_sequence(whole, mesh, "cp")
                mine = peak_tensor_bytes(lambda: cp_model(**part).loss.backward())[0]
            elif rank == 0:
                mine = peak_tensor_bytes(lambda: ref(**whole, use_cache=False).loss.backward())[0]
            every: list[int] = [0] * world
            dist.all_gather_object(every, mine)  # every rank takes the same next step
            return max(every)
        return measure

    rows = []
    for cp in ((1,) if one_process else ()) + (world,):
        found = _search(peak_of(cp), budget, 1024 * cp)
        rows.append({"table": "budget", "cp": cp, "layers": layers, "budget_bytes": budget, **found})
    return rows


def _grads(model: torch.nn.Module) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return torch.cat([(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).reshape(-1)
                      for p in model.parameters() if p.grad is not None])


def loss_rows(rank: int, world: int, seq: int, vocab: int, chunk: int, layers: int,
              rounds: int) -> list[dict[str, Any]]:
    """The whole logits against the loss in chunks of ``chunk`` positions at cp=``world`` (module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..context import SPLIT_KEY, shard_sequence
    from ..context.loss import TiledLoss
    from ..nn.parallelize import parallelize

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ref = context_model(layers, vocab)
    models = {"whole logits": parallelize(copy.deepcopy(ref), mesh, None, context="cp"),
              f"chunks of {chunk}": parallelize(copy.deepcopy(ref), mesh, None, context="cp",
                                                context_loss_chunk=chunk)}
    part = shard_sequence(context_batch("plain", seq, vocab), mesh, "cp")

    def step(key: str) -> torch.Tensor:
        models[key].zero_grad(set_to_none=True)
        loss: torch.Tensor = models[key](**{**part, SPLIT_KEY: dataclasses.replace(part[SPLIT_KEY], cache={})}).loss
        loss.backward()
        return loss.detach()

    samples = barrier_rounds(list(models), step, rounds)
    values: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    peaks: dict[str, int] = {}
    for key in models:
        dist.barrier()
        peaks[key], value = peak_tensor_bytes(lambda k=key: step(k))  # type: ignore[misc]
        values[key], grads[key] = torch.as_tensor(value), _grads(models[key])
    config: Any = ref.config
    head: Any = ref.get_output_embeddings()  # type: ignore[operator]
    hidden = torch.randn(1, part["input_ids"].shape[1], config.hidden_size, generator=torch.Generator(
        ).manual_seed(rank), requires_grad=True)
    tiled = TiledLoss(ref, config, chunk)
    count, labels = part["num_items_in_batch"], part["labels"]

    def whole_loss() -> None:
        loss: torch.Tensor = ref.loss_function(  # type: ignore[operator]
            logits=head(hidden), labels=labels, vocab_size=vocab, num_items_in_batch=count, shift_labels=labels)
        loss.backward()

    loss_alone = {"whole logits": peak_tensor_bytes(whole_loss)[0],
                  f"chunks of {chunk}": peak_tensor_bytes(
                      lambda: tiled.chunked(hidden, labels, labels, count).backward())[0]}
    every: list[dict[str, int]] = [{}] * world
    dist.all_gather_object(every, peaks)
    if rank != 0:
        return []
    first = next(iter(models))
    return [{"table": "loss", "variant": k, "seq": seq, "cp": world, "vocab": vocab, "chunk": chunk,
             "train_step_ms": statistics.median(v), "step_samples_ms": v,
             "peak_bytes": max(e[k] for e in every), "loss_peak_bytes": loss_alone[k],
             "loss_diff": float((values[k] - values[first]).abs()),
             "grad_diff": float((grads[k] - grads[first]).abs().max())} for k, v in samples.items()]
