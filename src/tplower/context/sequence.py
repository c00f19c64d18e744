"""The batch over a context-parallel axis: :func:`shard_sequence` splits it, :func:`gather_sequence` makes it whole.

Every rank of the axis passes the whole batch, as one process would see it;
:func:`shard_sequence` returns this rank's tokens (:mod:`tplower.context.layout`)
with what a parallelized model needs to give one process's answer:

* ``position_ids``: each token's global position (given, or ``0 .. S-1``), so
  rotary embeddings and masks follow the whole sequence;
* ``labels``/``shift_labels``: the labels shifted by one over the whole
  sequence *before* the split (the last token of a piece predicts the first
  token of the next piece; a masked LM's or a token classifier's labels,
  one per token, are cut as they are with ``shift_labels=False``), and
  ``num_items_in_batch``, the count of labels
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
  global positions, and which says what cut the batch (axis, ranks, balance):
  :func:`gather_sequence` reads the balance from it, and a model
  parallelized without context parallelism refuses a part that carries it
  (:mod:`tplower.nn.calls`). A transformers model never parallelized cannot
  refuse it: its forward passes unknown keywords on to its attention and loss
  functions, which ignore them, so it runs this rank's tokens as a whole
  sequence; give a part only to a model parallelized with ``context=axis``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.fx.experimental.sym_node import DynamicInt

from ..core.lower.collectives import _all_gather_base
from ..core.lower.redistribute import redistribute_local
from ..core.support.argcheck import check_mesh
from ..core.support.errors import TPLowerError
from ..core.support.words import closest
from .layout import SequenceLayout
from .runs import Run, batch_runs

__all__ = ["SPLIT_KEY", "ContextSplit", "gather_sequence", "shard_sequence", "traced_split"]

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
        shifted: whether the batch's labels were shifted as next-token
            targets (``True``) or cut as they are (``False``); ``None``
            without labels. The model's forward pre-hook refuses labels cut
            for the other kind of head.
        input_ids: ``[batch, S]`` the whole token ids (``None`` for
            ``inputs_embeds``), and ``given_positions`` whether the batch
            carried ``position_ids``: a model that numbers its tokens itself
            when none are given (RoBERTa's from the pad token) gets its own
            numbering of the whole sequence (:mod:`tplower.context.rules`).
        runs: the batch's runs (:func:`~tplower.context.runs.batch_runs`; ``None``: a mask with holes), made
            eagerly when the split is made, outside ``cache``: a compiled forward then reads no tensor values for
            them (no graph break at ``nonzero``), and one that builds the dense mask instead never looks at them
            (no guard on how many there are).
        symbolic: (a property, not a field) this split as a compiled forward reads it (:func:`traced_split`).
    """

    layout: SequenceLayout
    rank: int
    axis: str
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    cache: dict[Any, Any] = field(default_factory=dict)
    shifted: bool | None = None
    input_ids: torch.Tensor | None = None
    given_positions: bool = True
    runs: tuple[Run, ...] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.runs = batch_runs(self.position_ids, self.attention_mask)
        twin = copy.copy(self)  # the same tensors and cache, made without __init__
        twin.layout = self.layout.symbolic()
        end = twin.layout.length

        def ends(v: int) -> int:  # a bound at the sequence's end: the symbolic length
            return end if v == end else v

        twin.runs = None if self.runs is None else tuple(
            Run(r.rows, ends(r.start), ends(r.stop), ends(r.key_start), ends(r.key_stop), r.causal, r.window)
            for r in self.runs)
        # not a field: code that walks a dataclass's fields (FSDP2 looks for tensors in a module's inputs) must
        # not meet the twin, whose own twin is itself
        self.__dict__["_twin"] = twin.__dict__["_twin"] = twin

    @property
    def symbolic(self) -> ContextSplit:
        """This split as a compiled forward reads it (:func:`traced_split`), made with the split: the same tensors
        and ``cache``, its layout :meth:`~tplower.context.layout.SequenceLayout.symbolic` and its runs' bounds at
        the sequence's end that layout's ``length`` (one ``DynamicInt``): the trace takes the sequence length as a
        symbol, not a constant, and a batch of another length runs the same graph."""
        twin: ContextSplit = self.__dict__["_twin"]
        return twin

    @property
    def local_index(self) -> torch.Tensor:
        """``[local S]`` the global position of each of this rank's tokens, in local order."""
        return self.layout.global_index(self.rank)


def traced_split(split: ContextSplit) -> ContextSplit:
    """``split`` as the code running now reads it: under ``torch.compile`` its :attr:`ContextSplit.symbolic` twin
    (the sequence length a symbol), else ``split`` itself (plain ints)."""
    return split.symbolic if torch.compiler.is_compiling() else split


def _hint(axis: str, names: tuple[str, ...]) -> str:
    """The way out for a context axis the mesh lacks: the mesh's axis it most likely means (by spelling, else
    ``'cp'``), or making the mesh with it."""
    near = closest(axis, names, fallback="cp")
    if near:
        return f"{near}; pass the mesh's context-parallel axis by its name"
    return (f"; make the mesh with a {axis!r} axis (init_device_mesh(..., mesh_dim_names=(..., {axis!r}, ...)))")


def _axis(mesh: DeviceMesh, axis: str, where: str) -> tuple[int, int]:
    check_mesh(mesh, "mesh", where)
    names = tuple(mesh.mesh_dim_names or ())
    if axis not in names:
        raise TPLowerError(f"{where}: axis={axis!r} is not an axis of the mesh {names}{_hint(axis, names)}")
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
                   ignore_index: int = -100, shift_labels: bool = True) -> dict[str, Any]:
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
        shift_labels: ``True`` for a causal LM (each token predicts the next
            token's label: shifted over the whole sequence before the cut);
            ``False`` for a head that scores each token against its own label
            (masked LM, token classification: cut as they are). A model
            parallelized with ``context=`` refuses labels cut for the other
            kind of head.

    Returns:
        A new dict: the sequence entries cut to this rank's tokens
        (``torch.chunk`` pieces; a length that does not divide gives uneven
        pieces, down to none), ``position_ids`` of the tokens' global
        positions, with ``labels`` the globally shifted labels of this rank's
        tokens (also as ``shift_labels``; with ``shift_labels=False`` its
        labels as they are) and ``num_items_in_batch`` (the given one, else
        this batch's count of those labels that are not ``ignore_index``),
        and
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
            sections = (" (multimodal rope positions, one row per section: context parallelism cuts [batch, "
                        "sequence] positions; give text positions as such, the model repeats them per section)"
                        if key == "position_ids" and t.dim() == 3 else "")
            raise TPLowerError(f"shard_sequence: batch[{key!r}] has shape {tuple(t.shape)}; expected [{b}, {s}, ...] "
                               f"like input_ids{sections}")
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
        shifted = torch.cat([labels[:, 1:], labels.new_full((b, 1), ignore_index)], dim=1) if shift_labels else labels
        out["labels"] = shifted.index_select(1, index)
        if shift_labels:
            out["shift_labels"] = out["labels"]
        if batch.get("num_items_in_batch") is None:  # a given count (over every micro-batch) is the caller's
            # an int a compiled step takes as a symbol from its first trace (no recompile when the count changes)
            out["num_items_in_batch"] = DynamicInt(int((shifted != ignore_index).sum()))
    mask = batch.get("attention_mask")
    split = ContextSplit(layout, rank, axis, _own(mask) if isinstance(mask, torch.Tensor) else None, positions,
                         shifted=bool(shift_labels) if isinstance(labels, torch.Tensor) else None,
                         input_ids=_own(batch.get("input_ids")), given_positions=batch.get("position_ids") is not None)
    # the layout's orders, made here, eagerly (as the split's runs are): a compiled forward then takes no lock
    # (cached_property's)
    for name in ("lengths", "order", "padded_order", "padded_source"):
        getattr(layout, name)
    out[SPLIT_KEY] = split
    _dynamic_length(out, split)
    return out


def _own(t: Any) -> Any:
    """A view of the caller's tensor ``t`` (a new tensor object, no copy) for the split to hold and mark, or ``t``."""
    return t.view_as(t) if isinstance(t, torch.Tensor) else t


def _dynamic_length(part: dict[str, Any], split: ContextSplit) -> None:
    """Mark the sequence dim of the tensors ``part`` made and ``split`` holds as dynamic for ``torch.compile``
    (``maybe_mark_dynamic``: a hint, never an error): a compiled step traces the sequence length as a symbol from
    its first batch (:attr:`ContextSplit.symbolic` carries the lengths as symbols too), so a batch of another
    length runs the same graph. The caller's own tensors are left unmarked (the split holds views of them)."""
    seq = [t for k, t in part.items() if k in (*_SPLIT, "labels", "shift_labels") and isinstance(t, torch.Tensor)]
    seq += [t for t in (split.attention_mask, split.position_ids, split.input_ids) if t is not None]
    for t in seq:
        if t.dim() >= 2:
            torch._dynamo.maybe_mark_dynamic(t, 1)
    layout = split.layout
    for t in (layout.order, layout.padded_order, layout.padded_source):
        torch._dynamo.maybe_mark_dynamic(t, 0)


def _split_of(split: ContextSplit | Mapping[str, Any], axis: str, n: int) -> ContextSplit:
    """The :class:`ContextSplit` of ``split`` (a :func:`shard_sequence` part or its split), refused unless it was
    cut over ``axis`` of ``n`` ranks."""
    found = split.get(SPLIT_KEY) if isinstance(split, Mapping) else split
    if not isinstance(found, ContextSplit):
        raise TPLowerError(f"gather_sequence: split must be the part shard_sequence returned (or its "
                           f"{SPLIT_KEY!r}), got {type(split).__name__}" +
                           (f" without {SPLIT_KEY!r}" if isinstance(split, Mapping) else ""))
    if found.axis != axis or found.layout.size != n:
        raise TPLowerError(f"gather_sequence: the split was cut over axis {found.axis!r} ({found.layout.size} "
                           f"ranks); this gather runs over {axis!r} ({n}); gather over axis={found.axis!r}")
    return found


def _balance(split: ContextSplit | Mapping[str, Any] | None, balance: bool | None, axis: str, n: int) -> bool:
    """The balance to gather with: the split's (a ``balance`` given beside it must agree), else ``True``
    (:func:`shard_sequence`'s default); a ``balance`` without a split is refused."""
    if split is None:
        if balance is not None:
            raise TPLowerError(f"gather_sequence: balance={balance!r} without split=: at an even length both cuts "
                               "give every rank as many tokens, so it cannot be checked against how the tensor was "
                               "cut; pass split= (shard_sequence's output, or its context_split) instead")
        return True
    cut = _split_of(split, axis, n).layout.balance
    if balance is not None and bool(balance) != cut:
        raise TPLowerError(f"gather_sequence: balance={balance!r}, but shard_sequence cut this batch with "
                           f"balance={cut}; drop balance= (the split gives it)")
    return cut


def _check_dim(t: torch.Tensor, d: int, sizes: tuple[int, ...], split: ContextSplit) -> None:
    """Refuse a ``dim`` whose size, on some rank, is not that rank's local length of the split (every rank has every
    rank's size: all raise alike)."""
    want = split.layout.lengths
    if sizes == want:
        return
    mine = want[split.rank]
    near = [i for i, size in enumerate(t.shape) if size == mine and i != d]
    hint = f"; did you mean dim={near[0]}?" if near and t.dim() > 1 else ""
    raise TPLowerError(f"gather_sequence: dim={d} of t (shape {list(t.shape)}) has {t.shape[d]} entries on this rank, "
                       f"but the split gives this rank {mine} tokens (dim {d}'s sizes by rank: {list(sizes)}; the "
                       f"split's local lengths: {list(want)}); pass the sequence dim of t{hint}")


def gather_sequence(t: torch.Tensor, mesh: DeviceMesh, axis: str = "cp", dim: int = 1, *,
                    balance: bool | None = None,
                    split: ContextSplit | Mapping[str, Any] | None = None) -> torch.Tensor:
    """The whole of a tensor cut on ``dim`` by :func:`shard_sequence`, in the original token order; collective.

    Args:
        t: this rank's part, e.g. logits ``[B, local S, V]``.
        mesh, axis: as given to :func:`shard_sequence`.
        dim: the sequence dim of ``t``.
        balance: only beside ``split``, which it must agree with. At an
            even length both cuts give every rank as many tokens, so a
            ``balance`` alone could not be checked against how ``t`` was
            cut: pass ``split`` and the cut is read from it.
        split: the part :func:`shard_sequence` returned (or its
            ``context_split``): the balance is read from it. Without it the
            tensor is taken as cut with :func:`shard_sequence`'s default
            (``balance=True``).

    Returns:
        ``[..., S, ...]`` on every rank of the axis. Differentiable: the
        gradient of the whole goes back as this rank's tokens' rows.

    Raises:
        TPLowerError: an axis the mesh lacks (naming the axis it most likely
            means), a ``split`` cut over another axis, a ``balance`` that is
            not the ``split``'s or without one (all before any collective), or local lengths
            that are not the pieces of one layout; with a ``split``, a ``dim``
            whose size on some rank is not that rank's local length (naming
            the dim and the sizes; these two alike on every rank, after the
            ranks' sizes of ``dim`` are exchanged and before any data moves).
        TypeError: ``t`` is not a tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"gather_sequence: t must be a torch.Tensor, got {type(t).__name__}")
    n, _ = _axis(mesh, axis, "gather_sequence")
    balance = _balance(split, balance, axis, n)
    d = dim % t.dim()
    group = mesh.get_group(axis)
    mine = torch.tensor([t.shape[d]], dtype=torch.int64)
    every = torch.empty(n, dtype=torch.int64)
    _all_gather_base(every, mine, group=group)
    lengths = tuple(int(v) for v in every.tolist())
    if split is not None:  # alike on every rank: the ranks' sizes of dim, against the split's local lengths
        _check_dim(t, d, lengths, _split_of(split, axis, n))
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
