"""Collectives on plain local tensors over one ``ProcessGroup``, and the autograd glue.

Every function here takes a local tensor and returns a new one; inputs are
never modified. Uneven shards follow ``torch.chunk`` semantics, as DTensor:
a piece holds ``c = ceil(L / n)`` elements, trailing pieces may hold fewer
or none; collectives pad each piece to ``c``, move equal-sized buffers and
unpad. Inputs are made contiguous before any collective (gloo's
``all_to_all_single`` rejects strided input). Collectives over tensors with
no elements are skipped on every rank alike (gloo can abort on them).

Which collective carries a step is chosen once per backend and device by
:func:`~tplower.core.lower.backends.backend_caps` (re-exported here), never on the hot path: a backend without a native
collective gets an equivalent (``reduce_scatter`` as ``all_reduce`` plus the local piece, ``all_to_all`` as
``all_gather`` plus the local piece, ``avg`` as ``sum`` then a division); gloo's ``all_reduce`` also carries a
size below which a call runs as one ``all_to_all`` (:mod:`~tplower.core.lower.exchange`).

:class:`LoweredTransition` is the one autograd Function: forward runs a
list of bound steps, backward runs the bound steps of the backward
transition (itself planned by the same table), so every gradient path is a
public forward path too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .backends import BackendCaps, backend_caps, backend_for_device, backend_name_for, check_device  # re-exported
from .exchange import exchange_fits, exchange_reduce

__all__ = [
    "BackendCaps",
    "LoweredTransition",
    "OwnedTransition",
    "StepProgram",
    "all_gather",
    "all_reduce",
    "all_reduce_chunk",
    "all_to_all",
    "all_to_all_via_gather",
    "backend_caps",
    "backend_for_device",
    "backend_name_for",
    "check_device",
    "chunk",
    "keep_backward",
    "partition",
    "reduce_scatter",
    "run_steps",
    "zero_fill",
]

BoundStep = Callable[[torch.Tensor], torch.Tensor]

_REDUCE = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
           "min": dist.ReduceOp.MIN}

# torch 2.13 names these all_gather_single / reduce_scatter_single and warns on the
# old names; older releases only have the old names.
_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_base = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Under torch.compile each collective is a functional collective (``_c10d_functional``: a fresh output and a
# ``wait_tensor``), which AOT autograd and inductor see as one node they can schedule and overlap. The in-place
# ``dist.*`` calls would trace to the same node plus a buffer and a copy into it (dynamo's remap), around every
# collective. Eager keeps the in-place calls: about 10 us cheaper a call on CPU than the functional ops.
_FC = torch.ops._c10d_functional
_tracing = torch.compiler.is_compiling  # bound once: read on every call


def _fc_all_reduce(x: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor:
    out: torch.Tensor = _FC.wait_tensor(_FC.all_reduce(x.contiguous(), op, group.group_name))
    return out


def _fc_all_gather(x: torch.Tensor, n: int, group: ProcessGroup) -> torch.Tensor:
    out: torch.Tensor = _FC.wait_tensor(_FC.all_gather_into_tensor(x.contiguous(), n, group.group_name))
    return out


def _fc_reduce_scatter(x: torch.Tensor, op: str, n: int, group: ProcessGroup) -> torch.Tensor:
    out: torch.Tensor = _FC.wait_tensor(_FC.reduce_scatter_tensor(x.contiguous(), op, n, group.group_name))
    return out


def _pad_to(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    have = x.size(dim)
    if have == size:
        return x
    shape = list(x.shape)
    shape[dim] = size
    out = x.new_zeros(shape)
    out.narrow(dim, 0, have).copy_(x)
    return out


def _piece(size: int, n: int, rank: int) -> tuple[int, int]:
    c = -(-size // n)
    start = min(c * rank, size)
    return start, min(c, size - start)


def _blocks(t: torch.Tensor, n: int, order: Sequence[int] | None) -> torch.Tensor:
    # Reorder the n equal blocks of dim 0: block k of the result is block order[k] of t.
    if order is None or not t.numel():
        return t
    index = torch.tensor(order, device=t.device)
    out: torch.Tensor = t.unflatten(0, (n, -1)).index_select(0, index).flatten(0, 1)
    return out


def all_gather(x: torch.Tensor, *, group: ProcessGroup, n: int, dim: int, size: int,
               order: Sequence[int] | None = None) -> torch.Tensor:
    """``S(dim) -> R``: concatenate every rank's piece along ``dim``.

    ========  =====================  ==========================
    in        ``x``                  ``[..., piece_r, ...]``
    out       gathered               ``[..., size, ...]``
    ========  =====================  ==========================

    ``size`` is the logical length of ``dim`` across the group; pieces are
    padded to ``ceil(size / n)``, gathered with one ``all_gather`` and the
    padding is cut off. ``order[c]``, when given, is the group rank of the
    rank at mesh coordinate ``c`` (a group that orders ranks unlike the
    mesh); pieces are put in mesh-coordinate order. Backward:
    ``reduce_scatter`` (gradient ``P``) or :func:`chunk` (gradient ``R``).
    """
    # The common case (even pieces, contiguous, group in mesh order) issues no op but the gather; dim > 0 adds
    # one copy, the reshape that interleaves the gathered pieces (as DTensor's split + cat).
    c = -(-size // n)
    if x.size(dim) != c:
        x = _pad_to(x, dim, c)
    piece = x.shape
    if not x.numel():
        out = x.new_empty((n * c, *piece[1:]) if dim == 0 else (*piece[:dim], n * c, *piece[dim + 1:]))
    else:
        if _tracing():
            out = _fc_all_gather(x, n, group)
        else:
            x = x.contiguous()
            out = x.new_empty((n * piece[0], *piece[1:]))
            _all_gather_base(out, x, group=group)
        if order is not None:
            out = _blocks(out, n, order)
        if dim:  # block k of dim 0 is rank k's piece: move the blocks next to dim and merge
            out = out.view(n, *piece).movedim(0, dim).flatten(dim, dim + 1)
    if n * c != size:
        out = out.narrow(dim, 0, size)
        if dim:
            out = out.contiguous()
    return out


def all_reduce(x: torch.Tensor, *, group: ProcessGroup, op: str, n: int, native: bool = True,
               inplace: bool = False, exchange: int = 0) -> torch.Tensor:
    """``P(op) -> R``: reduce every rank's value; shape unchanged.

    With ``native=False`` an ``avg`` runs as ``sum`` then ``/ n``. ``inplace``: reduce a contiguous ``x`` itself
    and return it (its caller owns it: :meth:`tplower.core.lower.program.Program.run_owned`); by default ``x``
    is never modified. ``exchange`` (bytes, :attr:`BackendCaps.exchange_bytes`): where
    :func:`~tplower.core.lower.exchange.exchange_fits`, runs as
    :func:`~tplower.core.lower.exchange.exchange_reduce`. Backward: identity (gradient ``R``) or ``all_reduce``
    (gradient ``P``).
    """
    if exchange and exchange_fits(x, n, exchange):
        return exchange_reduce(x, op=op, n=n, group=group)
    if _tracing() and x.numel():
        if op == "avg" and not native:
            return _fc_all_reduce(x, "sum", group) / n
        return _fc_all_reduce(x, op, group)
    out = x if inplace and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
    if not out.numel():
        return out
    if op == "avg" and not native:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out.div_(n)
    dist.all_reduce(out, op=_REDUCE[op], group=group)
    return out


def reduce_scatter(x: torch.Tensor, *, group: ProcessGroup, n: int, rank: int, dim: int, op: str,
                   native_avg: bool = True, order: Sequence[int] | None = None) -> torch.Tensor:
    """``P(op) -> S(dim)``: reduce, keep this rank's ``torch.chunk`` piece of ``dim``.

    ========  =====================  ==========================
    in        ``x`` (partial)        ``[..., L, ...]``
    out       piece ``rank``         ``[..., piece_r(L), ...]``
    ========  =====================  ==========================

    One native ``reduce_scatter`` over ``dim`` padded to ``n * ceil(L/n)``.
    ``rank`` is the mesh coordinate; ``order`` as :func:`all_gather`.
    Backward: ``all_gather`` along ``dim``.
    """
    size = x.size(dim)
    c = -(-size // n)
    buf = x if size == n * c else _pad_to(x, dim, n * c)
    buf = (buf.movedim(dim, 0) if dim else buf).contiguous()
    if order is not None:
        buf = _blocks(buf, n, _inverse(order))
    if _tracing() and buf.numel():
        if op == "avg" and not native_avg:
            out = _fc_reduce_scatter(buf, "sum", n, group) / n
        else:
            out = _fc_reduce_scatter(buf, op, n, group)
        if size != n * c:
            out = out.narrow(0, 0, _piece(size, n, rank)[1])
        return out.movedim(0, dim).contiguous() if dim else out
    out = buf.new_empty((c, *buf.shape[1:]))
    if out.numel():
        if op == "avg" and not native_avg:
            _reduce_scatter_base(out, buf, op=dist.ReduceOp.SUM, group=group)
            out.div_(n)
        else:
            _reduce_scatter_base(out, buf, op=_REDUCE[op], group=group)
    if size != n * c:
        out = out.narrow(0, 0, _piece(size, n, rank)[1])
    return out.movedim(0, dim).contiguous() if dim else out


def all_reduce_chunk(x: torch.Tensor, *, group: ProcessGroup, n: int, rank: int, dim: int, op: str,
                     native_avg: bool = True) -> torch.Tensor:
    """``P(op) -> S(dim)`` for a backend without that ``reduce_scatter``: ``all_reduce`` then :func:`chunk`."""
    return chunk(all_reduce(x, group=group, op=op, n=n, native=native_avg), n=n, rank=rank, dim=dim)


def chunk(x: torch.Tensor, *, n: int, rank: int, dim: int) -> torch.Tensor:
    """``R -> S(dim)``: a copy of this rank's ``torch.chunk`` piece; no communication.

    Backward: ``all_gather`` along ``dim``.
    """
    start, length = _piece(x.size(dim), n, rank)
    if _tracing():  # the graph's consumers take any strides (a collective makes its input contiguous): a view
        return x.narrow(dim, start, length)
    return x.narrow(dim, start, length).clone(memory_format=torch.contiguous_format)


def _inverse(order: Sequence[int]) -> list[int]:
    inv = [0] * len(order)
    for coord, grank in enumerate(order):
        inv[grank] = coord
    return inv


def all_to_all(x: torch.Tensor, *, group: ProcessGroup, n: int, rank: int, src_dim: int, dst_dim: int,
               src_size: int, dst_size: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """``S(src_dim) -> S(dst_dim)``: one ``all_to_all_single`` trades pieces.

    ========  ==========================================================
    in        ``x[..., piece_r(src_size) at src_dim, dst_size at dst_dim]``
    out       ``[..., src_size at src_dim, piece_r(dst_size) at dst_dim]``
    ========  ==========================================================

    Both dims are padded to ``ceil(size / n)`` pieces so every rank sends
    ``n`` equal blocks. ``rank`` is the mesh coordinate; ``order`` as
    :func:`all_gather`. Backward: ``all_to_all`` from ``dst_dim`` back to
    ``src_dim``.
    """
    ci, cj = -(-src_size // n), -(-dst_size // n)
    x = _pad_to(_pad_to(x, src_dim, ci), dst_dim, n * cj)
    send = x.unflatten(dst_dim, (n, cj)).movedim(dst_dim, 0).contiguous()
    if order is not None:  # group rank k gets the piece of the coordinate it holds
        send = send.index_select(0, torch.tensor(_inverse(order), device=send.device))
    if _tracing() and send.numel():
        ones = [1] * n  # one block of dim 0 to and from each rank
        recv: torch.Tensor = _FC.wait_tensor(_FC.all_to_all_single(send, ones, ones, group.group_name))
    else:
        recv = torch.empty_like(send)
        if send.numel():
            dist.all_to_all_single(recv, send, group=group)
    if order is not None:  # block k came from group rank k: put it at that rank's coordinate
        recv = recv.index_select(0, torch.tensor(order, device=recv.device))
    # recv[k] is rank k's block: its piece of src_dim, this rank's piece of dst_dim.
    out = (recv.movedim(0, src_dim) if src_dim else recv).flatten(src_dim, src_dim + 1)
    if n * ci != src_size:
        out = out.narrow(src_dim, 0, src_size)
    if n * cj != dst_size:
        out = out.narrow(dst_dim, 0, _piece(dst_size, n, rank)[1])
    return out.contiguous()


def all_to_all_via_gather(x: torch.Tensor, *, group: ProcessGroup, n: int, rank: int, src_dim: int,
                          dst_dim: int, src_size: int, dst_size: int,
                          order: Sequence[int] | None = None) -> torch.Tensor:
    """``S(src_dim) -> S(dst_dim)`` for a backend without ``all_to_all``: gather, then the local piece."""
    del dst_size
    full = all_gather(x, group=group, n=n, dim=src_dim, size=src_size, order=order)
    return chunk(full, n=n, rank=rank, dim=dst_dim)


def partition(x: torch.Tensor, *, n: int, op: str) -> torch.Tensor:
    """``R -> P(op)``: ``sum`` divides by ``n``; ``avg``/``max``/``min`` keep the value (as DTensor)."""
    return x / n if op == "sum" else x.clone(memory_format=torch.contiguous_format)


def zero_fill(x: torch.Tensor, *, n: int, rank: int, dim: int, size: int, op: str) -> torch.Tensor:
    """``S(dim) -> P(op)``: this rank's piece in place, the rest the reduce op's neutral element.

    ``sum``: zeros; ``avg``: zeros and the piece scaled by ``n`` (so the
    average of the ranks is the value); ``max``/``min``: the lowest/highest
    value of the dtype. No communication.
    """
    shape = list(x.shape)
    shape[dim] = size
    if op in ("sum", "avg"):
        fill: float | int = 0
    else:
        info: Any = torch.finfo(x.dtype) if x.dtype.is_floating_point else torch.iinfo(x.dtype)
        fill = info.min if op == "max" else info.max
    out = x.new_full(shape, fill)
    start, length = _piece(size, n, rank)
    out.narrow(dim, start, length).copy_(x * n if op == "avg" else x)
    return out


def run_steps(x: torch.Tensor, steps: Sequence[BoundStep]) -> torch.Tensor:
    """Apply bound steps in order (no autograd)."""
    for step in steps:
        x = step(x)
    return x


class StepProgram(Protocol):
    """What :class:`LoweredTransition` runs: bound forward and backward steps."""

    @property
    def forward(self) -> Sequence[BoundStep]: ...

    @property
    def backward(self) -> Sequence[BoundStep]: ...


class LoweredTransition(torch.autograd.Function):
    """Forward: the bound forward steps; backward: the bound backward steps.

    Both step lists come from one plan (:mod:`tplower.core.language.transitions`), so the
    gradient path is the lowering of ``grad -> src`` and nothing is written
    twice. Double backward (``create_graph=True``) raises: the collectives
    are not themselves recorded for autograd.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, program: StepProgram) -> torch.Tensor:  # type: ignore[override]
        # One object argument, not two tuples: autograd inspects each argument of apply, and
        # tuples cost about 3 us more a call.
        ctx.program = program
        out = run_steps(x, program.forward)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # A cheaper guard than once_differentiable (about 4 us a call): grad mode is on in
        # backward only under create_graph=True, where these steps would record nothing.
        if torch.is_grad_enabled():
            raise RuntimeError("tplower transitions are differentiable once; double backward "
                               "(create_graph=True) through them is not supported")
        return run_steps(grad.contiguous(), ctx.program.backward), None


class OwnedTransition(LoweredTransition):
    """:class:`LoweredTransition` running ``program.forward_owned``, steps that may write into ``x`` (an input no
    one else reads). ``x`` is marked dirty: a saved reference to it raises at backward, never reads a changed
    value. Backward as :class:`LoweredTransition`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, program: StepProgram) -> torch.Tensor:  # type: ignore[override]
        ctx.program = program
        out = run_steps(x, program.forward_owned)  # type: ignore[attr-defined]
        if out is x:
            ctx.mark_dirty(x)
        return out


class _KeepBackward(torch.autograd.Function):
    """Forward: ``out`` as it is; backward: ``out``'s gradient, and no gradient (``None``) for ``inputs``."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.n = len(inputs)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return (grad, *((None,) * ctx.n))


def keep_backward(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``out``, joined in autograd to ``inputs``: their backward runs whenever ``out``'s does.

    A rank's compute may leave an input out of its result for data alone: an
    experts implementation that skips experts with no token returns
    ``zeros_like`` on a rank that received none, while another rank's result
    depends on its rows. Autograd then never runs that input's backward on the
    first rank, and the backward collective that the input's forward
    collective owes (an ``all_to_all``'s, an ``all_gather``'s) waits forever on
    the others. Joined, the input's gradient is autograd's zero there (no
    tensor is made unless nothing else reaches it), so every rank issues every
    backward collective its forward issued. ``out`` also requires a gradient
    whenever an input does.

    Args:
        out: the compute's result, any shape.
        inputs: tensors ``out`` may or may not depend on (typically the
            outputs of a collective); those that do not require a gradient
            are left out.

    Returns:
        A view of ``out`` (``out`` itself when grad mode is off, no input
        requires a gradient, or ``out`` is not floating point).
    """
    tied = tuple(t for t in inputs if t.requires_grad)
    if not tied or not torch.is_grad_enabled() or not (out.is_floating_point() or out.is_complex()):
        return out
    result: torch.Tensor = _KeepBackward.apply(out, *tied)
    return result
