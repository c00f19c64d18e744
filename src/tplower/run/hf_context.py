"""The architecture table's context-parallel column: ``parallelize(model, mesh, None, context="cp")``, both modes.

Each architecture's tiny model (:func:`tplower.run.hf_configs.tiny_model`) runs with its sequence split over a
``cp`` axis of the table's ranks, once with ``context_mode="ulysses"`` and once with ``"allgather"``: the whole
batch's loss on every rank, the logits made whole by :func:`tplower.gather_sequence` and every parameter's
gradient (summed over cp by ``parallelize``) against one process on the whole batch (no cache, as training
runs). The cell passes when both modes do; a model whose token mixers are not softmax attention is refused at
``parallelize``, naming the layer type.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .compare import TOL, Outcome
from .hf_configs import Arch, tiny_model

__all__ = ["context_side"]


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _one_mode(ref: torch.nn.Module, mesh: Any, ids: torch.Tensor, mode: str) -> tuple[float, float]:
    from ..context.sequence import gather_sequence, shard_sequence
    from ..nn.parallelize import parallelize

    model = parallelize(copy.deepcopy(ref), mesh, None, context="cp", context_mode=mode)
    ref.zero_grad()
    want = ref(input_ids=ids, labels=ids, use_cache=False)
    want.loss.backward()
    out = model(**shard_sequence({"input_ids": ids, "labels": ids}, mesh, "cp"))
    out.loss.backward()
    logits = gather_sequence(out.logits.detach(), mesh, "cp")
    diff = max(float((out.loss.detach() - want.loss.detach()).abs()),
               float((logits - want.logits.detach()).abs().max()))
    scale = max((float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None), default=1.0)
    grads = [float((_whole(q.grad) - p.grad).abs().max()) / max(scale, 1.0)
             for p, q in zip(ref.parameters(), model.parameters(), strict=True)
             if p.grad is not None and q.grad is not None]
    if any(p.grad is not None and q.grad is None for p, q in zip(ref.parameters(), model.parameters(), strict=True)):
        grads.append(float("inf"))
    return diff, max(grads, default=0.0)


def context_side(arch: Arch, mesh: Any, ids: torch.Tensor, vocab_size: int | None = None) -> Outcome:
    """``arch``'s tiny model at cp = the mesh's ``cp`` size, Ulysses then all-gather, against one process."""
    ref = tiny_model(arch, vocab_size)
    worst, grad = 0.0, 0.0
    for mode in ("ulysses", "allgather"):
        d, g = _one_mode(ref, mesh, ids, mode)
        if d > TOL or g > TOL:
            return Outcome("fail", d, f"context_mode={mode!r}: loss/logits {d:.1e}, gradients {g:.1e} > {TOL:.0e}",
                           g)
        worst, grad = max(worst, d), max(grad, g)
    return Outcome("pass", worst, "", grad)
