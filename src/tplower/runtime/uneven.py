"""Global shapes of possibly uneven shards, learned by exchanging local sizes.

A plan entry's ``uneven`` field (:mod:`tplower.plans.entries`) names boundary
inputs and outputs whose sharded dims need not divide over their axes. For
those, :func:`exchanged_global_shape` asks the ranks along each axis that
shards a dim of the source placement for their local sizes of that dim (one
``all_gather`` of one integer per sharding axis), checks that they are the
``torch.chunk`` pieces DTensor's ``Shard`` means (in mesh-coordinate order)
and returns the global shape, which the lowered program then takes as
``global_shape=``. Dims the source does not shard (a ``P`` or ``R`` source
that a transition scatters) are already global: nothing is exchanged for them.

The exchange reads sizes back to the host, so it runs eagerly (a graph break
under ``torch.compile``).

Undeclared, a move whose source shards a dim along an axis it moves (an
input ``S(1) -> R``: a sequence the plan cannot know at install) still never
assumes that the dim divides: :func:`agreed_global_shape` exchanges the sizes
along those axes eagerly (the right answer for ``torch.chunk`` pieces, the
same :class:`TPLowerError` on every rank for others), and under
``torch.compile`` checks in the graph that they are equal (one small traced
``all_gather``, no graph break), so that an uneven dim raises the same error
on every rank before any collective of its data, never a wrong shape or a
backend abort. Sizes travel on the CPU when the axis's group carries CPU
tensors (``cpu:gloo,cuda:nccl``), so a CUDA model does not wait on its device.

Where install knows the global size of an output's gathered dim, nothing is
exchanged (:func:`known_global_shape`, no collective, no graph break): the
parameters that shard it give it (a vocabulary that does not divide: the
lm_head's logits), or the input the output was cut from does (an
expert-parallel block's tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from ..core.language.transitions import chunk_size_and_offset
from ..core.lower.backends import check_device
from ..core.lower.collectives import _all_gather_base, _fc_all_gather
from ..core.lower.redistribute import MeshLowerer
from ..core.support.errors import TPLowerError
from ..core.support.fake import host_values
from ..core.support.words import count

__all__ = ["agreed_global_shape", "exchanged_global_shape", "known_global_shape"]


def _size_device(lowerer: MeshLowerer, axis: int, device: torch.device) -> torch.device:
    """Where sizes travel on ``axis``: the CPU if its group carries CPU tensors (no device wait), else ``device``."""
    if device.type == "cpu":
        return device
    try:
        check_device(str(dist.get_backend(lowerer.groups[axis])), "cpu")
    except TPLowerError:
        return device
    return torch.device("cpu")


def _pieces(size: int, lowerer: MeshLowerer, axis: int, device: torch.device) -> list[int]:
    """Every rank's ``size`` along mesh axis ``axis``, in mesh-coordinate order."""
    n = lowerer.shape[axis]
    device = _size_device(lowerer, axis, device)
    with host_values():  # real sizes under a FakeTensorMode too (tplower.planner)
        mine = torch.tensor([size], dtype=torch.int64, device=device)
        every = torch.empty(n, dtype=torch.int64, device=device)
        _all_gather_base(every, mine, group=lowerer.groups[axis])
        sizes = [int(s) for s in every.tolist()]
    order = lowerer.orders[axis]
    return sizes if order is None else [sizes[order[c]] for c in range(n)]


def _exchanged_global_shape(local: torch.Tensor, src: Sequence[Placement], lowerer: MeshLowerer,
                           where: str, axes: Sequence[int] | None = None) -> tuple[int, ...]:
    """The global shape of ``local`` under ``src`` when its shards may be uneven; collective on the sharding axes.

    Every rank along an axis that shards a dim of ``src`` must call it
    (ranks of one axis group all see the same sizes, so they all return or
    all raise alike). A dim sharded on several axes is rebuilt from the last
    such axis outwards (DTensor cuts it in mesh-axis order).

    Args:
        local: this rank's local tensor (only its shape is read).
        src: one placement per mesh axis (shard dims may be negative).
        lowerer: the mesh's lowerer (its groups and rank orders).
        where: what is moved (``module 'up', input '0'``), for the message.
        axes: exchange along these mesh axes only (default: every axis that
            shards a dim); a dim sharded along another is taken as even.

    Raises:
        TPLowerError: the local sizes along an axis are not the
            ``torch.chunk`` pieces of their sum in mesh-coordinate order
            (e.g. 1 + 2 instead of 2 + 1); the message names the dim, the
            axis and the sizes.
    """
    shape = list(local.shape)
    for axis in reversed(range(len(src))):
        p, n = src[axis], lowerer.shape[axis]
        if not isinstance(p, Shard) or n == 1:
            continue
        d = p.dim % local.ndim
        if axes is not None and axis not in axes:
            shape[d] *= n
            continue
        pieces = _pieces(shape[d], lowerer, axis, local.device)
        total = sum(pieces)
        want = [chunk_size_and_offset(total, n, c)[0] for c in range(n)]
        if pieces != want:
            raise TPLowerError(f"{where}: the local sizes of dim {d} along mesh axis {lowerer.names[axis]!r} are "
                               f"{pieces} (by mesh coordinate), not the torch.chunk pieces {want} of {total}")
        shape[d] = total
    return tuple(shape)


#: Not traced by ``torch.compile`` (it reads sizes back to the host): a graph break.
exchanged_global_shape: Callable[[torch.Tensor, Sequence[Placement], MeshLowerer, str], tuple[int, ...]] = (
    torch.compiler.disable(_exchanged_global_shape))


def _traced_even_check(local: torch.Tensor, src: Sequence[Placement], axes: Sequence[int], lowerer: MeshLowerer,
                       where: str) -> None:
    """In a ``torch.compile`` graph: every rank's size of each dim sharded along ``axes`` must be equal."""
    for axis in axes:
        p = src[axis]
        assert isinstance(p, Shard)
        if lowerer.shape[axis] == 1:
            continue
        d = p.dim % local.ndim
        mine = torch.full((1,), local.shape[d], dtype=torch.int64, device=local.device)
        every = _fc_all_gather(mine, lowerer.shape[axis], lowerer.groups[axis])
        torch._assert_async((every == mine).all(),
                            f"{where}: the local sizes of dim {d} along mesh axis {lowerer.names[axis]!r} differ "
                            "between ranks under torch.compile; name it in the entry's 'uneven' field (its sizes "
                            "are then exchanged each call, a graph break) or make the dim divide")


def agreed_global_shape(local: torch.Tensor, src: Sequence[Placement], axes: Sequence[int], lowerer: MeshLowerer,
                        where: str) -> tuple[int, ...] | None:
    """The global shape of an undeclared move's sharded source, never assumed even without a word; collective.

    Args:
        local: this rank's local tensor (only its shape is read).
        src: one placement per mesh axis.
        axes: the mesh axes along which ``src`` shards a dim that the move
            changes (its collectives need that dim's global size).
        lowerer: the mesh's lowerer.
        where: what is moved, for messages.

    Returns:
        Eagerly, the global shape from the sizes exchanged along ``axes``
        (one ``all_gather`` of one integer per axis: ``torch.chunk`` pieces
        of any length work); under ``torch.compile``, ``None`` (the dims are
        even, as the traced check asserts).

    Raises:
        TPLowerError: (eager) the sizes along an axis are not ``torch.chunk``
            pieces, alike on every rank of it.
        RuntimeError: (compiled) the sizes along an axis differ, alike on
            every rank of it, before any collective of the data.
    """
    if torch.compiler.is_compiling():
        _traced_even_check(local, src, axes, lowerer, where)
        return None
    return _exchanged_global_shape(local, src, lowerer, where, axes)


def known_global_shape(local: torch.Tensor, src: Sequence[Placement], lowerer: MeshLowerer, where: str, *,
                       params: tuple[int, int] | None = None, cut_from: object = None) -> tuple[int, ...]:
    """The global shape of ``local``, whose one sharded dim has a global size known without an exchange; local.

    Args:
        local: this rank's local tensor (only its shape is read).
        src: one placement per mesh axis; exactly one is a ``Shard`` (of dim ``d``).
        lowerer: the mesh's lowerer (this rank's coordinates).
        where: what is moved (``module 'lm_head', output 'out'``), for the message.
        params: ``(global size, this rank's piece)`` of dim ``d``, which the
            module's sharded parameters give it (known at install); or
        cut_from: the tensor ``local`` was cut from (its size along ``d`` is
            the global size, this rank's ``torch.chunk`` piece of it ``local``'s).

    Raises:
        TPLowerError: ``cut_from`` is not a tensor of ``local``'s dims, or this
            rank's size of dim ``d`` is not its piece (the message names the
            dim, the axis and both sizes). Other ranks are not asked (that is
            the point); ``TPLOWER_DEBUG=1`` checks that every rank's sizes
            agree before each collective.
    """
    axis = next(j for j, p in enumerate(src) if isinstance(p, Shard))
    shard = src[axis]
    assert isinstance(shard, Shard)
    d, c = shard.dim % local.ndim, lowerer.coord[axis]
    if params is not None:
        size, piece = params
        whose = "the module's sharded parameters give it"
    elif isinstance(cut_from, torch.Tensor) and cut_from.ndim == local.ndim:
        size = cut_from.shape[d]
        piece = chunk_size_and_offset(size, lowerer.shape[axis], c)[0]
        whose = "it was cut from"
    else:
        raise TPLowerError(f"{where}: its global size is that of the input it was cut from, which was not given as "
                           f"a tensor of {count(local.ndim, 'dim')}")
    if local.shape[d] != piece:
        raise TPLowerError(f"{where}: dim {d} is {local.shape[d]} on this rank (coordinate {c} of mesh axis "
                           f"{lowerer.names[axis]!r}), not its torch.chunk piece {piece} of the {size} {whose}")
    return (*local.shape[:d], size, *local.shape[d + 1:])
