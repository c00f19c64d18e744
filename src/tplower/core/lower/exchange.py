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
    """``P(op) -> R`` for ``op`` ``sum`` or ``avg`` by one ``all_to_all_single``: ``x`` (any shape, ``m``
    elements) in, the sum (or the sum ``/ n``) of every rank's ``x`` out, a new tensor of ``x``'s shape and dtype.

    Each rank sends ``n`` copies of ``x`` (``[n, m]``, row ``k`` to group rank ``k``) and receives every
    rank's copy (row ``k`` from group rank ``k``), then sums the rows: at ``n = 2`` as ``a + b``, the native
    sum's bits; beyond, ``torch.sum`` over dim 0 (its own order and, for half types, float32 accumulation: the
    rounding may differ from gloo's ring, which rounds at each add). Every rank computes the same bits from the
    same rows. Traced, a functional ``all_to_all_single`` and its wait. ``x`` is never modified.
    """
    send = x.reshape(1, -1).repeat(n, 1)  # [n, m]: row k to group rank k
    if _tracing():
        ones = [1] * n
        got: torch.Tensor = _FC.wait_tensor(_FC.all_to_all_single(send, ones, ones, group.group_name))
    else:
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send, group=group)
    got = got.view(n, *x.shape)  # the sums below make fresh tensors of x's shape and dtype, not views
    out = got[0] + got[1] if n == 2 else got.sum(0, dtype=x.dtype)
    return out.div_(n) if op == "avg" else out
