"""An ``all_reduce`` carried by one ``all_to_all``: every rank's copy to every rank, reduced locally.

Where a backend's own ``all_reduce`` costs more than trading whole copies (gloo on CPU below about 1 MiB:
:attr:`tplower.core.lower.backends.BackendCaps.exchange_bytes`), :func:`tplower.core.lower.collectives.all_reduce`
runs :func:`exchange_reduce` instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.fx.experimental.symbolic_shapes import statically_known_true

__all__ = ["exchange_fits", "exchange_reduce"]

_FC = torch.ops._c10d_functional
_tracing = torch.compiler.is_compiling


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def _inductor_buckets() -> bool:
    """Whether inductor is set to join independent all_reduces: the global ``bucket_all_reduces_fx`` (a compile's
    ``options`` are not seen while tracing), read once a trace."""
    from torch._inductor import config

    return getattr(config, "bucket_all_reduces_fx", "none") not in (None, "", "none")


def exchange_fits(x: torch.Tensor, n: int, limit: int) -> bool:
    """Whether an ``all_reduce`` of ``x`` over ``n`` ranks runs as :func:`exchange_reduce` under ``limit`` bytes.

    ``x`` must be a CPU tensor whose ``n`` copies take between 1 and ``limit`` bytes together, a size known
    without a guard (a dynamic dim's symbolic size runs the native ``all_reduce``, so a dynamic range may span
    the limit), and not traced while inductor buckets all_reduces (``bucket_all_reduces_fx``, which
    ``prepare_trainer`` sets for context parallelism: one bucketed all_reduce beats an exchange a parameter).
    """
    if not x.is_cpu or (_tracing() and _inductor_buckets()):
        return False
    size = n * x.numel() * x.element_size()
    return statically_known_true(0 < size) and statically_known_true(size <= limit)


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
