"""A planned step bound to a process group: the collective that carries it, arguments bound, remaps chosen once.

:func:`bind_step` is where a backend's capabilities (:func:`tplower.core.lower.collectives.backend_caps`)
decide how a step runs: natively, or remapped (``reduce_scatter`` as ``all_reduce`` + chunk, ``all_to_all``
as ``all_gather`` + chunk, ``avg`` as sum + divide, a small ``all_reduce`` on gloo as one ``all_to_all``).
:class:`~tplower.core.lower.redistribute.MeshLowerer` and
:class:`~tplower.core.lower.lowering.TPExecutionOp` bind every step through it.
"""

from __future__ import annotations

import functools

from torch.distributed import ProcessGroup

from ..language.transitions import Step
from . import collectives as C

__all__ = ["bind_step"]

# The reductions gloo's small all_reduce hands to the exchange; max and min keep the native one (its NaN and
# signed-zero rules differ from torch.amax's).
_SUMS = frozenset(("sum", "avg"))


def bind_step(step: Step, group: ProcessGroup | None, caps: C.BackendCaps, *,
              force_all_reduce_shard: bool = False, order: tuple[int, ...] | None = None) -> C.BoundStep:
    """The collective function that carries ``step`` on ``group``, arguments bound.

    The remap for a backend without a native collective is chosen here,
    once, from ``caps``: ``reduce_scatter`` becomes ``all_reduce`` + chunk,
    ``all_to_all`` becomes ``all_gather`` + chunk, ``avg`` becomes sum + divide; an ``all_reduce`` carries
    ``caps.exchange_bytes`` (the size below which it runs as one ``all_to_all``, decided per call).
    ``order[c]`` is the group rank of mesh coordinate ``c`` when the group
    orders its ranks unlike the mesh (``None`` when they agree). ``group``
    may be ``None`` only for steps that do not communicate.
    """
    n, r, ls, d = step.group_size, step.rank, step.logical_shape, step.tensor_dim
    op = step.reduce_op or "sum"
    kind = step.kind
    if kind == "chunk":
        assert d is not None
        return functools.partial(C.chunk, n=n, rank=r, dim=d)
    if kind == "partition":
        return functools.partial(C.partition, n=n, op=op)
    if kind == "zero_fill":
        assert d is not None
        return functools.partial(C.zero_fill, n=n, rank=r, dim=d, size=ls[d], op=op)
    assert group is not None, f"step {step} needs a process group"
    native_avg = "avg" in caps.all_reduce_ops
    if kind == "all_gather":
        assert d is not None
        return functools.partial(C.all_gather, group=group, n=n, dim=d, size=ls[d], order=order)
    if kind == "all_reduce":
        return functools.partial(C.all_reduce, group=group, op=op, n=n, native=op in caps.all_reduce_ops,
                                 exchange=caps.exchange_bytes if caps.all_to_all and n > 1 and op in _SUMS else 0)
    if kind == "reduce_scatter":
        assert d is not None
        if not force_all_reduce_shard and op in caps.reduce_scatter_ops:
            return functools.partial(C.reduce_scatter, group=group, n=n, rank=r, dim=d, op=op, order=order)
        if not force_all_reduce_shard and op == "avg" and "sum" in caps.reduce_scatter_ops:
            return functools.partial(C.reduce_scatter, group=group, n=n, rank=r, dim=d, op=op, native_avg=False,
                                     order=order)
        return functools.partial(C.all_reduce_chunk, group=group, n=n, rank=r, dim=d, op=op, native_avg=native_avg)
    if kind == "all_to_all":
        j = step.dst_dim
        assert d is not None and j is not None
        fn = C.all_to_all if caps.all_to_all else C.all_to_all_via_gather
        return functools.partial(fn, group=group, n=n, rank=r, src_dim=d, dst_dim=j, src_size=ls[d], dst_size=ls[j],
                                 order=order)
    raise AssertionError(f"unknown step kind {kind!r}")
