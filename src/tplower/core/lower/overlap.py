"""A linear layer after an ``R -> R`` (gradient ``P``) transition: its input gradient's all_reduce overlaps compute.

``R -> R`` on an axis with gradient ``P(sum)`` is the identity forward and one
``all_reduce`` backward (Megatron's ``copy_to_tp_region``). Followed by a
linear layer whose weight holds this rank's rows (column parallel), the
backward of the pair computes

==============  =====================  ===========================================
``grad_input``  ``g @ W``              ``[..., in]``: partial (this rank's rows of W)
``grad_weight`` ``g^T @ x``            ``[out_r, in]``: final, no collective
``grad_bias``   ``sum(g)``             ``[out_r]``: final, no collective
==============  =====================  ===========================================

and only ``grad_input`` needs the ``all_reduce``. Run as two autograd nodes
(the linear's, then the transition's) the all_reduce starts after both
matmuls; fused in :class:`OverlappedLinear` it starts as soon as
``grad_input`` exists, runs on the backend's own threads (gloo) or stream
(NCCL) while ``grad_weight`` and ``grad_bias`` are computed, and is waited
for last: Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``.
On one device the pair is ``F.linear``; the products are autograd's own
(``grad_weight`` as ``g^T @ x``, the layout autograd picks for a contiguous
weight), so the gradients are the unfused pair's, bit for bit.

The all_reduce is the transition's own backward step, started instead of
run (:func:`all_reduce_start`, bound once per program:
:attr:`tplower.core.lower.program.Program.backward_start`), so nothing here plans
or binds a collective of its own.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from ..support.errors import TPLowerError

__all__ = ["OverlappedLinear", "PendingReduce", "Startable", "all_reduce_start", "overlapped_linear"]

_REDUCE = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class PendingReduce:
    """An ``all_reduce`` started by :func:`all_reduce_start`; :meth:`wait` returns the reduced tensor."""

    __slots__ = ("_divide", "_out", "_work")

    def __init__(self, out: torch.Tensor, work: Any, divide: int) -> None:
        self._out, self._work, self._divide = out, work, divide

    def wait(self) -> torch.Tensor:
        """Block until the reduction is done (on a GPU: make the current stream wait); the reduced tensor."""
        if self._work is not None:
            self._work.wait()
        return self._out.div_(self._divide) if self._divide > 1 else self._out


def all_reduce_start(x: torch.Tensor, *, group: ProcessGroup, op: str, n: int, native: bool = True,
                     exchange: int = 0) -> PendingReduce:
    """``P(op) -> R`` started, not waited for: :func:`tplower.core.lower.collectives.all_reduce` with ``async_op``.

    Unlike ``all_reduce``, ``x`` is reduced in place: the caller hands over a
    contiguous tensor of its own (a freshly computed gradient). Arguments as
    ``all_reduce`` binds them; ``native=False`` runs ``avg`` as ``sum``, then
    ``/ n`` at :meth:`PendingReduce.wait`. ``exchange`` is ignored: the
    native ``all_reduce`` is the one that runs beside compute.
    """
    del exchange
    if not x.numel():
        return PendingReduce(x, None, 1)
    divide = n if op == "avg" and not native else 1
    red = dist.ReduceOp.SUM if divide > 1 else _REDUCE[op]
    return PendingReduce(x, dist.all_reduce(x, op=red, group=group, async_op=True), divide)


class Startable(Protocol):
    """What :class:`OverlappedLinear` needs of a program: its backward all_reduce, startable."""

    @property
    def backward_start(self) -> Any: ...


def _released(program: Startable) -> TPLowerError:
    del program
    return TPLowerError(
        "this tplower program's process groups were destroyed (dist.destroy_process_group() or "
        "tplower.shutdown()) before the backward that needs them ran"
    )


class OverlappedLinear(torch.autograd.Function):
    """Forward: ``F.linear(x, weight, bias)``; backward: ``grad_input``'s all_reduce started, then the weight's.

    ``program``'s forward must be the identity and its backward one
    ``all_reduce`` (``backward_start`` not ``None``, checked by the caller).
    Double backward (``create_graph=True``) raises, as for every lowered
    transition.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,  # type: ignore[override]
        program: Startable,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.program = program
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError(
                "tplower transitions are differentiable once; double backward "
                "(create_graph=True) through them is not supported"
            )
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g2 = g.reshape(-1, g.shape[-1])
        pending: PendingReduce | None = None
        if need_x:
            start = ctx.program.backward_start
            if start is None:
                raise _released(ctx.program)
            pending = start(g2.mm(weight))  # the partial input gradient, on its way while the weight's is computed
        gw = g2.t().mm(x.reshape(-1, x.shape[-1])) if need_w else None
        gb = g2.sum(0) if need_b else None
        gx = pending.wait().view(x.shape) if pending is not None else None
        return gx, gw, gb, None


def overlapped_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, program: Startable
) -> torch.Tensor:
    """``F.linear(program(x), weight, bias)`` with ``program``'s backward all_reduce overlapping the weight gradient.

    ========  =====================  ======================
    ``x``     replicated input       ``[..., in]``
    weight    this rank's rows       ``[out_r, in]``
    bias      this rank's piece      ``[out_r]`` or ``None``
    out       this rank's features   ``[..., out_r]``
    ========  =====================  ======================

    Raises:
        TPLowerError: (in backward) the program's process groups were destroyed in between.
    """
    out: torch.Tensor = OverlappedLinear.apply(x, weight, bias, program)
    return out
