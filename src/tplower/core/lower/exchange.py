"""An ``all_reduce`` carried by one ``all_to_all``: every rank's copy to every rank, reduced locally.

Where a backend's own ``all_reduce`` costs more than trading whole copies (gloo on CPU below about 1 MiB:
:attr:`tplower.core.lower.backends.BackendCaps.exchange_bytes`), :func:`tplower.core.lower.collectives.all_reduce`
runs :func:`exchange_reduce` instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["exchange_reduce"]

_FC = torch.ops._c10d_functional
_tracing = torch.compiler.is_compiling


def exchange_reduce(x: torch.Tensor, *, op: str, n: int, group: ProcessGroup) -> torch.Tensor:
    """``P(op) -> R`` by one ``all_to_all_single``: ``x`` (any shape, ``m`` elements) in, its reduction out.

    Each rank sends ``n`` copies of ``x`` (``[n, m]``, row ``k`` to group rank ``k``) and receives every
    rank's copy (row ``k`` from group rank ``k``), then reduces the ``[n, m]`` rows over dim 0 in group-rank
    order (``sum`` at ``n = 2`` as ``a + b``, the native sum's bits; ``avg`` as the sum ``/ n``; ``max``,
    ``min``). Every rank computes the same bits from the same blocks. Traced, a functional ``all_to_all_single``
    and its wait. ``x`` is never modified; the result is a new contiguous tensor of ``x``'s shape.
    """
    send = x.reshape(1, -1).repeat(n, 1)  # [n, m]: row k to group rank k
    if _tracing():
        ones = [1] * n
        got: torch.Tensor = _FC.wait_tensor(_FC.all_to_all_single(send, ones, ones, group.group_name))
    else:
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send, group=group)
    got = got.view(n, *x.shape)  # the reductions below make fresh tensors of x's shape, not views
    if op == "max":
        return got.amax(0)
    if op == "min":
        return got.amin(0)
    out = got[0] + got[1] if n == 2 else got.sum(0)
    return out.div_(n) if op == "avg" else out  # a fresh sum: divided in place, in its own dtype
