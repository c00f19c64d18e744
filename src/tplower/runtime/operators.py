"""The bare operators for hand-written local compute: statically named collectives on one mesh axis.

:class:`TPOperators` (``all_gather``, ``all_reduce``, ``reduce_scatter``,
``all_to_all``) builds each operator once through its
:class:`~tplower.core.lower.lowering.TPCollectiveLowerer`, so a named operator gets
the remaps and the gradient convention of the placement path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..core.lower.cache import LRUCache
from ..core.lower.lowering import TPCollectiveLowerer, TPExecutionOp
from ..core.support.argcheck import check_int, check_local_tensor, describe

__all__ = ["TPOperators"]


class TPOperators:
    """Statically named collectives on the lowerer's axis, for hand-written local compute.

    Each operator builds its op with ``lowerer.execution_op`` (cached per
    arguments in a bounded cache, :mod:`tplower.core.lower.cache`), so a named operator gets exactly the
    backend remaps the placement path gets (e.g. ``reduce_scatter`` as ``all_reduce`` + chunk
    where the backend lacks it), and the lowerer's gradient convention
    (``replicated_grad``). Shard sizes must be even (``n * local``).

    Args:
        lowerer: a :class:`~tplower.core.lower.lowering.TPCollectiveLowerer`.

    Raises:
        TypeError: ``lowerer`` is not a ``TPCollectiveLowerer`` (make one with
            :func:`~tplower.create_tp_collective_lowerer`); an operator given a
            ``t`` that is neither a tensor nor a DTensor, or a dim that is not
            an int, raises ``TypeError`` naming it, before any collective.
    """

    def __init__(self, lowerer: TPCollectiveLowerer) -> None:
        if not isinstance(lowerer, TPCollectiveLowerer):
            raise TypeError(f"TPOperators: lowerer must be a TPCollectiveLowerer (create_tp_collective_lowerer(mesh, "
                            f"mesh_dim_names) makes one), got {describe(lowerer)}")
        self.lowerer = lowerer
        self._ops: LRUCache[tuple[Any, ...], TPExecutionOp] = LRUCache()

    def _op(self, kind: str, tensor_dim: int | None = None, reduce_op: str = "sum",
            dst_dim: int | None = None) -> TPExecutionOp:
        key = (kind, tensor_dim, reduce_op, dst_dim)
        try:
            op = self._ops.get(key)
        except TypeError:  # an unhashable argument: named below
            op = None
        if op is None:
            func = f"TPOperators.{kind}"
            dims = ("src_dim", "dst_dim") if kind == "all_to_all" else ("dim", None)
            check_int(tensor_dim, dims[0], func, optional=kind == "all_reduce")
            if dims[1] is not None:
                check_int(dst_dim, dims[1], func)
            if not isinstance(reduce_op, str):
                raise TypeError(f"{func}: op must be a str (sum, avg, max or min), got {describe(reduce_op)}")
            op = self.lowerer.execution_op(kind, tensor_dim, reduce_op, dst_dim=dst_dim)
            self._ops.put(key, op)
        return op

    @staticmethod
    def to_local(t: Any) -> Any:
        """A DTensor's local tensor; a plain tensor or ``None`` unchanged.

        Raises:
            TypeError: ``t`` is neither a tensor nor ``None``.
        """
        if t is None or (isinstance(t, torch.Tensor) and not isinstance(t, DTensor)):
            return t
        if isinstance(t, DTensor):
            return t.to_local()
        raise TypeError(f"to_local: t must be a tensor, a DTensor or None, got {describe(t)}")

    @staticmethod
    def _local(t: Any, func: str) -> torch.Tensor:
        if type(t) is torch.Tensor:
            return t
        if isinstance(t, DTensor):
            return t.to_local()
        return check_local_tensor(t, "t", f"TPOperators.{func}")

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """``S(dim) -> R``: ``[.., s, ..] -> [.., n*s, ..]``; backward per the lowerer's ``replicated_grad``."""
        local = self._local(t, "all_gather")
        return self._op("all_gather", dim).execute(local)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``P(op) -> R``: shape unchanged; backward per the lowerer's ``replicated_grad``."""
        local = self._local(t, "all_reduce")
        return self._op("all_reduce", None, op).execute(local)

    def reduce_scatter(self, t: torch.Tensor, dim: int, op: str = "sum") -> torch.Tensor:
        """``P(op) -> S(dim)``: ``[.., L, ..] -> [.., L/n, ..]``; backward ``all_gather(dim)``."""
        local = self._local(t, "reduce_scatter")
        return self._op("reduce_scatter", dim, op).execute(local)

    def all_to_all(self, t: torch.Tensor, src_dim: int, dst_dim: int) -> torch.Tensor:
        """``S(src_dim) -> S(dst_dim)``: trade pieces; backward ``all_to_all(dst_dim -> src_dim)``."""
        local = self._local(t, "all_to_all")
        return self._op("all_to_all", src_dim, "sum", dst_dim).execute(local)
