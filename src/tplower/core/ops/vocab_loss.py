"""Cross-entropy on vocabulary-sharded logits: the loss without the whole logits on any rank.

A language model's largest activation is its logits ``[tokens, vocab]``.
Under tensor parallelism the output head is column-parallel, so each rank
holds the logits of its piece of the vocabulary (``torch.chunk`` pieces:
rank ``r`` of ``n`` holds ids ``offset_r .. offset_r + V_r - 1``, uneven when
``V`` does not divide). :func:`vocab_parallel_cross_entropy` computes
``F.cross_entropy`` of the whole logits from those pieces with three
reductions of ``[tokens]``-sized tensors over the axis (Megatron's
vocab-parallel cross-entropy, torchtitan's ``loss_parallel``):

1. the row maximum (``P(max) -> R``), for a stable exponent;
2. the sum of exponentials and, with label smoothing, the sum of the logits
   (``P(sum) -> R``, one collective for both);
3. the target's logit, which exactly one rank holds (the same ``P(sum) -> R``).

Each is a placement transition run by :func:`tplower.redistribute_local`.
The backward needs no collective: each rank's gradient of its logits is its
piece of ``softmax - (1 - eps) * one_hot - eps / V``, scaled by the
gradient of each row's loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..language.transitions import chunk_size_and_offset
from ..lower.redistribute import redistribute_local
from ..support.errors import TPLowerError

__all__ = ["vocab_parallel_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


def _reduce(x: torch.Tensor, mesh: DeviceMesh, axis: str, op: str) -> torch.Tensor:
    """``x`` (a partial value on ``axis``, reduced by ``op``) made whole on every rank of it."""
    return redistribute_local(x, mesh, {axis: f"P({op})"}, {axis: "R"})


class _VocabParallelCE(torch.autograd.Function):
    """Per-row loss of vocabulary-sharded logits; backward: the local softmax minus the local smoothed one-hot."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, mesh: DeviceMesh,  # type: ignore[override]
                axis: str, vocab: int, offset: int, ignore_index: int, eps: float) -> torch.Tensor:
        x = logits.float()
        local_v = x.shape[-1]
        row_max = x.max(dim=-1).values if local_v else x.new_full(x.shape[:-1], float("-inf"))
        row_max = _reduce(row_max, mesh, axis, "max")
        shifted = x - row_max.unsqueeze(-1)
        exp = shifted.exp()
        mine = (target >= offset) & (target < offset + local_v) & (target != ignore_index)
        index = (target - offset).masked_fill(~mine, 0).unsqueeze(-1)
        picked = shifted.gather(-1, index).squeeze(-1).masked_fill(~mine, 0.0) if local_v else \
            torch.zeros_like(row_max)
        sums = torch.stack([exp.sum(-1), picked, shifted.sum(-1)]) if eps else torch.stack([exp.sum(-1), picked])
        sums = _reduce(sums, mesh, axis, "sum")
        log_z = sums[0].log()
        loss = log_z - sums[1]
        if eps:
            loss = (1.0 - eps) * loss + eps * (log_z - sums[2] / vocab)
        keep = target != ignore_index
        loss = loss.masked_fill(~keep, 0.0)
        ctx.save_for_backward(exp, sums[0], index, mine, keep)
        ctx.eps, ctx.vocab, ctx.dtype = eps, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        exp, z, index, mine, keep = ctx.saved_tensors
        g = exp / z.unsqueeze(-1)  # this rank's piece of the softmax
        if exp.shape[-1]:
            g.scatter_add_(-1, index, (-(1.0 - ctx.eps) * mine.to(g.dtype)).unsqueeze(-1))
        if ctx.eps:
            g = g - ctx.eps / ctx.vocab
        g = g * (grad * keep.to(grad.dtype)).unsqueeze(-1)
        return g.to(ctx.dtype), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, mesh: DeviceMesh, *,
                                 axis: str = "tp", vocab_size: int | None = None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, reduction: str = "mean", context: str | None = None,
                                 num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """``F.cross_entropy`` of logits sharded on their last dim over ``mesh[axis]``, computed on the shards.

    Args:
        logits: ``[..., V_r]``, this rank's piece of the vocabulary
            (``torch.chunk`` semantics, as DTensor's ``Shard(-1)``: rank
            ``r`` holds ``V_r`` ids from ``offset_r``; pieces may be uneven,
            and empty on trailing ranks). Any floating dtype; the loss is
            computed in float32.
        target: ``[...]`` int64 global vocabulary ids, the same on every rank
            of the axis (``ignore_index`` rows add nothing).
        mesh: the device mesh; every rank of ``mesh[axis]`` calls this alike.
        axis: the mesh axis the vocabulary is sharded over.
        vocab_size: the global ``V``; default: the sum of the local sizes
            (one ``all_reduce`` of one number).
        ignore_index, label_smoothing, reduction: as ``F.cross_entropy``
            (``mean`` divides by the rows whose target is not ``ignore_index``;
            with none, the loss is NaN and the gradient zero, as there).
        context: a mesh axis the tokens are split over (context parallelism:
            ``logits`` and ``target`` are this rank's tokens, ``target`` the
            globally shifted labels :func:`tplower.shard_sequence` gives):
            ``sum`` and ``mean`` are then the whole batch's, on every rank
            (each rank's sum ``P(sum) -> R`` over the axis, its gradient
            passed back whole), ``mean`` divided by the whole batch's count.
        num_items_in_batch: with ``context``, that count (``shard_sequence``
            returns it); default: the ranks' counts summed (one ``all_reduce``).

    Returns:
        The loss, replicated over the axis (and ``context``): a scalar, or
        ``[...]`` with ``reduction="none"`` (this rank's tokens under ``context``).

    Raises:
        TPLowerError: ``logits`` of the wrong rank for ``target``, a local size
            that is not this rank's ``torch.chunk`` piece of ``vocab_size``, a
            bad ``reduction`` or ``label_smoothing``, an axis not in the mesh.
    """
    if reduction not in _REDUCTIONS:
        raise TPLowerError(f"vocab_parallel_cross_entropy: reduction={reduction!r}; allowed: "
                           f"{', '.join(_REDUCTIONS)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise TPLowerError(f"vocab_parallel_cross_entropy: label_smoothing={label_smoothing!r} must be in [0, 1]")
    names = tuple(mesh.mesh_dim_names or ())
    if axis not in names:
        raise TPLowerError(f"vocab_parallel_cross_entropy: axis={axis!r} is not an axis of the mesh {names}")
    if context is not None and (context not in names or context == axis):
        raise TPLowerError(f"vocab_parallel_cross_entropy: context={context!r} must be an axis of the mesh {names} "
                           f"other than axis={axis!r}")
    if logits.shape[:-1] != target.shape:
        raise TPLowerError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} must be target "
                           f"{tuple(target.shape)} plus the vocabulary dim")
    n, rank = mesh.size(names.index(axis)), mesh.get_local_rank(axis)
    local_v = logits.shape[-1]
    if vocab_size is None:
        total = _reduce(torch.tensor([float(local_v)], device=logits.device), mesh, axis, "sum")
        vocab_size = int(total.item())
    want, offset = chunk_size_and_offset(vocab_size, n, rank)
    if want != local_v:
        raise TPLowerError(f"vocab_parallel_cross_entropy: this rank (index {rank} of {n} on {axis!r}) holds "
                           f"{local_v} vocabulary logits, but torch.chunk's piece of {vocab_size} is {want}")
    loss: torch.Tensor = _VocabParallelCE.apply(logits, target, mesh, axis, vocab_size, offset, ignore_index,
                                                float(label_smoothing))
    if reduction == "none":
        return loss
    total = loss.sum()
    if context is not None:  # the whole batch's sum on every rank; each rank's tokens keep their gradient
        total = redistribute_local(total, mesh, {context: "P(sum)"}, {context: "R"}, grad={context: "R"})
    if reduction == "sum":
        return total
    count = (target != ignore_index).sum()
    if context is not None:
        count = _reduce(count.to(torch.float32), mesh, context, "sum") if num_items_in_batch is None else \
            torch.as_tensor(num_items_in_batch, device=total.device)
    # F.cross_entropy's value (0 / 0, NaN, when no target counts) with its gradient (zero then, not NaN: a
    # micro-batch of prompt tokens only must not poison the parameters)
    return total / count.clamp(min=1) + torch.where(count == 0, float("nan"), 0.0).to(loss.dtype)
