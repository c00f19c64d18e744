"""Global shapes of possibly uneven shards, learned by exchanging local sizes.

A plan entry's ``uneven`` field (:mod:`tplower.nn.plans`) names boundary
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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from ..core.collectives import _all_gather_base
from ..core.errors import TPLowerError
from ..core.redistribute import MeshLowerer
from ..core.transitions import chunk_size_and_offset

__all__ = ["exchanged_global_shape"]


def _pieces(size: int, lowerer: MeshLowerer, axis: int, device: torch.device) -> list[int]:
    """Every rank's ``size`` along mesh axis ``axis``, in mesh-coordinate order."""
    n = lowerer.shape[axis]
    mine = torch.tensor([size], dtype=torch.int64, device=device)
    every = torch.empty(n, dtype=torch.int64, device=device)
    _all_gather_base(every, mine, group=lowerer.groups[axis])
    sizes = [int(s) for s in every.tolist()]
    order = lowerer.orders[axis]
    return sizes if order is None else [sizes[order[c]] for c in range(n)]


def _exchanged_global_shape(local: torch.Tensor, src: Sequence[Placement], lowerer: MeshLowerer,
                           where: str) -> tuple[int, ...]:
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
