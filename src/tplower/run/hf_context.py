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
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .compare import TOL, Outcome
from .hf_configs import Arch, tiny_model

__all__ = ["both_modes", "compare_context", "context_side"]


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _square(out: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
    """A loss on a model's whole output where it computes none: the mean square over the tokens not padded."""
    mask = batch.get("attention_mask")
    keep = torch.ones(out.shape[:2]) if mask is None else mask.to(out.dtype)
    return (out.square().sum(-1) * keep).sum() / keep.sum()


def compare_context(ref: torch.nn.Module, mesh: Any, batch: Mapping[str, Any], mode: str, *, balance: bool = True,
                    shift_labels: bool = True, out: str = "logits") -> tuple[float, float]:
    """``ref`` under ``parallelize(..., context="cp", context_mode=mode)`` against ``ref`` on the whole batch.

    Args:
        ref: the one-process model (its gradients are zeroed and computed).
        mesh: a mesh with a ``cp`` axis.
        batch: the whole batch, the same on every rank.
        mode, balance, shift_labels: as ``parallelize`` and ``shard_sequence`` take them.
        out: the output entry compared, made whole by ``gather_sequence``; without ``labels`` the loss is its mean
            square over the tokens not padded (computed whole on every rank).

    Returns:
        ``(output, gradients)``: the largest difference of the loss and the output, and of every parameter's
        gradient (summed over cp by ``parallelize``) divided by the largest gradient (at least 1).
    """
    from ..context.sequence import gather_sequence, shard_sequence
    from ..nn.parallelize import parallelize

    model = parallelize(copy.deepcopy(ref), mesh, None, context="cp", context_mode=mode)
    ref.zero_grad()
    no_cache = {"use_cache": False} if "use_cache" in inspect.signature(ref.forward).parameters else {}
    want = ref(**batch, **no_cache)
    part = shard_sequence(batch, mesh, "cp", balance=balance, shift_labels=shift_labels)
    got = model(**part)
    whole = gather_sequence(got[out], mesh, "cp", split=part)
    losses = [(o.loss, w) if o.get("loss") is not None else (_square(w, batch), w) for o, w in ((want, want[out]),
                                                                                               (got, whole))]
    for loss, _ in losses:
        loss.backward()
    (a, x), (b, y) = losses
    diff = max(float((a - b).detach().abs()), float((x - y).detach().abs().max()))
    scale = max((float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None), default=1.0)
    grads = [float((_whole(q.grad) - p.grad).abs().max()) / max(scale, 1.0)
             for p, q in zip(ref.parameters(), model.parameters(), strict=True)
             if p.grad is not None and q.grad is not None]
    if any(p.grad is not None and q.grad is None for p, q in zip(ref.parameters(), model.parameters(), strict=True)):
        grads.append(float("inf"))
    return diff, max(grads, default=0.0)


def both_modes(ref: torch.nn.Module, mesh: Any, batch: Mapping[str, Any], *, shift_labels: bool = True,
               out: str = "logits") -> Outcome:
    """:func:`compare_context` with Ulysses then all-gather: ``pass`` when both are within :data:`TOL`."""
    worst, grad = 0.0, 0.0
    for mode in ("ulysses", "allgather"):
        d, g = compare_context(ref, mesh, batch, mode, shift_labels=shift_labels, out=out)
        if d > TOL or g > TOL:
            return Outcome("fail", d, f"context_mode={mode!r}: loss/output {d:.1e}, gradients {g:.1e} > {TOL:.0e}",
                           g)
        worst, grad = max(worst, d), max(grad, g)
    return Outcome("pass", worst, "", grad)


def context_side(arch: Arch, mesh: Any, ids: torch.Tensor, vocab_size: int | None = None) -> Outcome:
    """``arch``'s tiny model at cp = the mesh's ``cp`` size, Ulysses then all-gather, against one process."""
    return both_modes(tiny_model(arch, vocab_size), mesh, {"input_ids": ids, "labels": ids})
