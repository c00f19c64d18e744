"""The batch over a context-parallel axis: :func:`shard_sequence` splits it, :func:`gather_sequence` makes it whole.

Every rank of the axis passes the whole batch, as one process would see it;
:func:`shard_sequence` returns this rank's tokens (:mod:`tplower.context.layout`)
with what a parallelized model needs to give one process's answer:

* ``position_ids``: each token's global position (given, or ``0 .. S-1``), so
  rotary embeddings and masks follow the whole sequence;
* ``labels``/``shift_labels``: the labels shifted by one over the whole
  sequence *before* the split (the last token of a piece predicts the first
  token of the next piece), and ``num_items_in_batch``, the count of labels
  that are not ``ignore_index`` in the whole batch: transformers' causal-LM
  loss then sums this rank's token losses and divides by the whole count, so
  the model's loss, summed over the axis, is one process's mean. A
  ``num_items_in_batch`` the batch already carries is kept as given: with
  gradient accumulation (or data parallelism) the caller's count covers every
  micro-batch (transformers' ``Trainer`` passes exactly that), and each
  micro-batch's loss is then its share of that one mean, as in one process;
* ``context_split``: a :class:`ContextSplit` (the layout and the whole
  ``attention_mask`` and ``position_ids``, small ``[batch, S]`` integers),
  which the model's attention reads to build each rank's mask rows from the
  global positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..core.lower.collectives import _all_gather_base
from ..core.lower.redistribute import redistribute_local
from ..core.support.argcheck import check_mesh
from ..core.support.errors import TPLowerError
from .layout import SequenceLayout

__all__ = ["SPLIT_KEY", "ContextSplit", "gather_sequence", "shard_sequence"]

#: the key of :func:`shard_sequence`'s result that carries the :class:`ContextSplit` into the model
SPLIT_KEY = "context_split"
#: batch entries cut on the sequence dim (1); anything else passes through as it is
_SPLIT = ("input_ids", "attention_mask", "position_ids", "token_type_ids", "inputs_embeds")


@dataclass(eq=False)
class ContextSplit:
    """What a context-parallel model needs of the whole batch: the layout, this rank, global masks' inputs.

    Attributes:
        layout: the cut of the sequence over the axis.
        rank: this rank's coordinate on the axis.
        axis: the mesh axis name.
        attention_mask: ``[batch, S]`` the whole padding mask, or ``None``.
        position_ids: ``[batch, S]`` every token's position (restarting where
            packed documents start).
        cache: masks built from these, per kind of attention (filled by the
            attention as it runs; one batch's lifetime).
    """

    layout: SequenceLayout
    rank: int
    axis: str
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    cache: dict[Any, Any] = field(default_factory=dict)

    @property
    def local_index(self) -> torch.Tensor:
        """``[local S]`` the global position of each of this rank's tokens, in local order."""
        return self.layout.global_index(self.rank)


def _axis(mesh: DeviceMesh, axis: str, where: str) -> tuple[int, int]:
    check_mesh(mesh, "mesh", where)
    names = tuple(mesh.mesh_dim_names or ())
    if axis not in names:
        raise TPLowerError(f"{where}: axis={axis!r} is not an axis of the mesh {names}; make the mesh with a "
                           f"{axis!r} axis (init_device_mesh(..., mesh_dim_names=(..., {axis!r}, ...)))")
    return mesh.size(names.index(axis)), mesh.get_local_rank(axis)


def _agree(mesh: DeviceMesh, axis: str, batch: int, length: int, ids: torch.Tensor) -> None:
    """Every rank of the axis holds the same batch: same ``[batch, S]`` and the same ids (a checksum)."""
    group = mesh.get_group(axis)
    n = dist.get_world_size(group)
    flat = ids.reshape(-1).to(torch.int64).cpu()
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64) % 65521
    mine = torch.tensor([batch, length, int(flat.sum()), int((flat * weights).sum())], dtype=torch.int64)
    every = torch.empty(n * 4, dtype=torch.int64)
    _all_gather_base(every, mine, group=group)
    rows = every.view(n, 4).tolist()
    if any(r != rows[0] for r in rows):
        shapes = [tuple(r[:2]) for r in rows]
        raise TPLowerError(f"shard_sequence: the ranks of axis {axis!r} hold different batches (batch, sequence by "
                           f"rank: {shapes}{'' if len(set(shapes)) > 1 else '; the token ids differ'}); every rank "
                           "of the axis must pass the same whole batch")


def shard_sequence(batch: Mapping[str, Any], mesh: DeviceMesh, axis: str = "cp", *, balance: bool = True,
                   ignore_index: int = -100) -> dict[str, Any]:
    """This rank's part of a whole batch, cut on the sequence dim over ``mesh[axis]``; collective over the axis.

    Args:
        batch: ``input_ids`` ``[B, S]`` (or ``inputs_embeds`` ``[B, S, H]``),
            and optionally ``labels``, ``attention_mask`` and ``position_ids``
            ``[B, S]`` (``token_type_ids`` too); the same on every rank of the
            axis. Other entries pass through unchanged, ``num_items_in_batch``
            among them: the count the loss divides by, over every
            micro-batch of a gradient-accumulation step (and every data-parallel
            rank), as transformers' ``Trainer`` passes it; absent (or
            ``None``), this batch's count of labels is used.
        mesh: the device mesh; ``axis`` one of its axis names.
        axis: the context-parallel axis.
        balance: head-tail pieces (rank ``r`` of ``n`` holds pieces ``r`` and
            ``2n-1-r`` of ``2n``), so causal attention costs the same on every
            rank; ``False``: one contiguous piece per rank.
        ignore_index: the label that counts for nothing (the shifted-in last label).

    Returns:
        A new dict: the sequence entries cut to this rank's tokens
        (``torch.chunk`` pieces; a length that does not divide gives uneven
        pieces, down to none), ``position_ids`` of the tokens' global
        positions, with ``labels`` the globally shifted labels of this rank's
        tokens (also as ``shift_labels``) and ``num_items_in_batch`` (the
        given one, else this batch's count of shifted labels that are not
        ``ignore_index``), and
        ``context_split`` (:class:`ContextSplit`).

    Raises:
        TPLowerError: no ``input_ids``/``inputs_embeds``, entries whose batch
            or sequence sizes differ, an axis the mesh lacks; on every rank of
            the axis alike, ranks that hold different batches.
        TypeError: ``batch`` is not a mapping.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"shard_sequence: batch must be a mapping of tensors (input_ids, labels, ...), got "
                        f"{type(batch).__name__}")
    n, rank = _axis(mesh, axis, "shard_sequence")
    main = batch.get("input_ids", batch.get("inputs_embeds"))
    if not isinstance(main, torch.Tensor) or main.dim() < 2:
        raise TPLowerError("shard_sequence: batch needs 'input_ids' [batch, sequence] (or 'inputs_embeds')")
    b, s = int(main.shape[0]), int(main.shape[1])
    for key in (*_SPLIT, "labels"):
        t = batch.get(key)
        if isinstance(t, torch.Tensor) and tuple(t.shape[:2]) != (b, s) and not (key == "position_ids" and
                                                                                   tuple(t.shape) == (1, s)):
            raise TPLowerError(f"shard_sequence: batch[{key!r}] has shape {tuple(t.shape)}; expected [{b}, {s}, ...] "
                               "like input_ids")
    _agree(mesh, axis, b, s, main if main.dtype in (torch.int64, torch.int32) else main[..., 0].round())
    layout = SequenceLayout(s, n, balance)
    index = layout.global_index(rank).to(main.device)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(s, device=main.device).expand(b, s)
    positions = positions.expand(b, s)
    out: dict[str, Any] = {k: v for k, v in batch.items() if k not in (*_SPLIT, "labels")}
    for key in _SPLIT:
        t = batch.get(key)
        if isinstance(t, torch.Tensor):
            out[key] = t.index_select(1, index)
    out["position_ids"] = positions.index_select(1, index)
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor):
        shifted = torch.cat([labels[:, 1:], labels.new_full((b, 1), ignore_index)], dim=1)
        out["labels"] = out["shift_labels"] = shifted.index_select(1, index)
        if batch.get("num_items_in_batch") is None:  # a given count (over every micro-batch) is the caller's
            out["num_items_in_batch"] = int((shifted != ignore_index).sum())
    mask = batch.get("attention_mask")
    out[SPLIT_KEY] = ContextSplit(layout, rank, axis, mask if isinstance(mask, torch.Tensor) else None, positions)
    return out


def gather_sequence(t: torch.Tensor, mesh: DeviceMesh, axis: str = "cp", dim: int = 1, *,
                    balance: bool = True) -> torch.Tensor:
    """The whole of a tensor cut on ``dim`` by :func:`shard_sequence`, in the original token order; collective.

    Args:
        t: this rank's part, e.g. logits ``[B, local S, V]``.
        mesh, axis, balance: as given to :func:`shard_sequence`.
        dim: the sequence dim of ``t``.

    Returns:
        ``[..., S, ...]`` on every rank of the axis. Differentiable: the
        gradient of the whole goes back as this rank's tokens' rows.

    Raises:
        TPLowerError: an axis the mesh lacks, or local lengths that are not
            the pieces of one layout (alike on every rank).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"gather_sequence: t must be a torch.Tensor, got {type(t).__name__}")
    n, _ = _axis(mesh, axis, "gather_sequence")
    d = dim % t.dim()
    group = mesh.get_group(axis)
    mine = torch.tensor([t.shape[d]], dtype=torch.int64)
    every = torch.empty(n, dtype=torch.int64)
    _all_gather_base(every, mine, group=group)
    lengths = tuple(int(v) for v in every.tolist())
    layout = SequenceLayout(sum(lengths), n, balance)
    if lengths != layout.lengths:
        raise TPLowerError(f"gather_sequence: local lengths {list(lengths)} along axis {axis!r} are not the pieces "
                           f"{list(layout.lengths)} of {layout.length} tokens (balance={balance}); gather with the "
                           "balance shard_sequence used")
    width = max(lengths)
    pad = [0, 0] * (t.dim() - d - 1) + [0, width - t.shape[d]]
    padded = torch.nn.functional.pad(t, pad) if width != t.shape[d] else t
    shape = list(padded.shape)
    shape[d] = width * n
    whole = redistribute_local(padded, mesh, {axis: f"S({d})"}, {axis: "R"}, global_shape=shape)
    return whole.index_select(d, layout.padded_order.to(t.device))
