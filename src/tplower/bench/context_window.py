"""The context phase's sliding-window table: a windowed model's train step at fixed window over growing sequences.

A tiny Mistral of the phase's sizes (:func:`window_model`: hidden 64, 4 query
and 2 key/value heads of 16, vocabulary 128, ``sdpa``, float32) whose every
layer has a sliding window of ``window`` keys, in each context mode of
``modes`` (Ulysses; the all-gather mode, which then exchanges only the keys
the windows reach, :mod:`tplower.context.window`) at this spawn's cp size on
one plain row per length of ``seqs``, and the same model without a window
(causal over the whole sequence, the first mode) at the two shortest lengths.
Per row: the train step's median time (forward, backward, an SGD step; the
slower rank's, behind barriers) and the peak tensor memory of a step, per rank.
With a window, each layer computes blocks of ``window`` queries against the
keys they see (:func:`tplower.context.kernels.attend_runs`): time and memory
grow about linearly in the length at a fixed window, where causal attention
over the whole sequence grows as its square.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
from typing import Any

import torch

from .context_budget import context_batch
from .memory import peak_tensor_bytes
from .timing import barrier_rounds

__all__ = ["window_model", "window_rows"]


def window_model(layers: int, window: int | None) -> torch.nn.Module:
    """The windowed tiny Mistral (module docstring), seed 0; ``window=None``: causal over the whole sequence."""
    from transformers import MistralConfig, MistralForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                               max_position_embeddings=1 << 18, sliding_window=window)
        config._attn_implementation = "sdpa"
        model: torch.nn.Module = MistralForCausalLM(config).float()
    return model


def window_rows(rank: int, world: int, seqs: tuple[int, ...], window: int, layers: int,
                rounds: int, modes: tuple[str, ...] = ("ulysses",)) -> list[dict[str, Any]]:
    """The sliding-window table's rows (module docstring), each with its ``mode``; rank 0 returns them, the others
    ``[]``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ..context import SPLIT_KEY, shard_sequence
    from ..nn.parallelize import parallelize

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    base = {w: window_model(layers, w) for w in (window, None)}
    made: list[tuple[str, int | None]] = [(m, window) for m in modes] + [(modes[0], None)]  # causal: first mode
    models = {key: parallelize(copy.deepcopy(base[key[1]]), mesh, None, context="cp", context_mode=key[0])
              for key in made}
    opts = {key: torch.optim.SGD(m.parameters(), lr=1e-3) for key, m in models.items()}
    names = {f"{m}|{w or 'none'}": (m, w) for m, w in made}
    rows = []
    for seq in seqs:
        part = shard_sequence(context_batch("plain", seq), mesh, "cp")

        def step(name: str, part: dict[str, Any] = part) -> None:
            opts[names[name]].zero_grad(set_to_none=True)
            models[names[name]](**{**part, SPLIT_KEY: dataclasses.replace(part[SPLIT_KEY], cache={})}).loss.backward()
            opts[names[name]].step()

        # causal over the whole sequence at the two shortest lengths only: at 32k, minutes a step
        keys = [n for n, (_, w) in names.items() if w is not None or seq in sorted(seqs)[:2]]
        samples = barrier_rounds(keys, step, rounds)
        for key in keys:
            dist.barrier()
            peak = peak_tensor_bytes(lambda k=key: step(k))[0]  # type: ignore[misc]
            every: list[int] = [0] * world
            dist.all_gather_object(every, peak)
            rows.append({"table": "window", "seq": seq, "cp": world, "layers": layers, "mode": names[key][0],
                         "window": names[key][1], "train_step_ms": statistics.median(samples[key]),
                         "step_samples_ms": samples[key], "peak_bytes": max(every)})
    return rows if rank == 0 else []
