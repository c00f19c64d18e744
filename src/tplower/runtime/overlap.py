"""A column-parallel ``nn.Linear`` boundary run as one node: its input gradient's all_reduce overlaps the weight's.

A boundary whose one input moves ``R -> R`` with a ``P(sum)`` gradient (the
colwise style's input: identity forward, ``all_reduce`` backward) and whose
compute is ``nn.Linear``'s own forward is, in autograd, the transition's node
then the linear's. :func:`overlapped_call` runs both as
:class:`tplower.core.lower.overlap.OverlappedLinear` instead: the same forward,
and a backward that starts the all_reduce as soon as the input gradient
exists and computes the weight and bias gradients while it runs. Gradients
are equal bit for bit (the same products in the same order).

:func:`can_overlap` decides it once per boundary, at install; each call then
takes the fused node only where the unfused one would run a lowered
transition: an eager call with grad on, no autocast, no debug check, an
input that requires grad and a program whose backward is one all_reduce.

Siblings that read one tensor (``q``, ``k``, ``v``: :mod:`tplower.runtime.fanout`)
share its move when unfused: autograd sums their three input gradients and
one all_reduce moves the sum, after all three weight gradients. Fused, each
starts its own all_reduce and overlaps it with its own weight gradient:
three all_reduces of the same size instead of one (equal up to the order of
a floating-point sum). A node runs whole before autograd runs the next, so
the one all_reduce of the sum could only overlap the last sibling's weight
gradient. A sibling that takes the unfused path in a call (no grad,
autocast, a ``torch.compile`` trace) shares as before.

Measured on 2 CPU cores, 2 gloo ranks, all-MiniLM-L6-v2's forward and
backward (paired rounds, the machine shared): at moderate load the fused
nodes took 1.04-1.07x the unfused pair's time (each sibling its own
all_reduce; 1.03x with q/k/v still sharing one, 60-80 rounds), at heavy
load (four times as many runnable threads as cores) 0.76-0.80x (24 rounds).
With both cores busy computing there is no idle one for gloo's thread, so
``parallelize`` leaves it off unless asked (``overlap=True``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..core.lower.overlap import overlapped_linear
from ..core.lower.redistribute import MeshLowerer
from ..plans.forms import Placements
from .params import ParamLayout, local_parameter

__all__ = ["MoveLike", "can_overlap", "overlapped_call"]

#: ``nn.Linear``'s own forward: the compute the fused node stands for
_LINEAR_FORWARD = nn.Linear.forward


class MoveLike(Protocol):
    """What this module reads of a boundary's input move (:class:`tplower.runtime.boundary._Move`)."""

    @property
    def src(self) -> Placements: ...

    @property
    def dst(self) -> Placements: ...

    @property
    def grad(self) -> Placements: ...

    @property
    def uneven(self) -> bool: ...

    @property
    def sized(self) -> tuple[int, ...]: ...


def can_overlap(
    owner: nn.Module,
    func: Any,
    ins: Sequence[MoveLike],
    params: Sequence[tuple[str, ParamLayout]],
    lowered: bool,
    plain: bool,
) -> bool:
    """Whether a boundary may run as :class:`tplower.core.lower.overlap.OverlappedLinear` (each call still checks).

    ``owner`` exactly ``nn.Linear`` running its own forward (``func``), one
    input move, declared neither ``uneven`` nor sized per call, run lowered
    (``lowered``), and nothing around the compute (``plain``: no lookup, no
    deferred bias).
    """
    if type(owner) is not nn.Linear or func is not _LINEAR_FORWARD or not lowered or not plain or len(ins) != 1:
        return False
    mv = ins[0]
    return not mv.uneven and not mv.sized and mv.src == mv.dst and any(name == "weight" for name, _ in params)


def overlapped_call(
    owner: nn.Module,
    lowerer: MeshLowerer,
    mv: MoveLike,
    params: Sequence[tuple[str, ParamLayout]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``owner``'s output through the fused node, or ``None`` where this call takes the unfused path.

    ``mv``: the boundary's one input move; ``params``: its parameter layouts.
    Eager only: the caller never calls it inside a ``torch.compile`` trace.
    """
    if len(args) + len(kwargs) != 1 or lowerer.debug or not torch.is_grad_enabled():
        return None
    x = args[0] if args else kwargs.get("input")
    if type(x) is not torch.Tensor or not x.requires_grad or torch.is_autocast_enabled(x.device.type):
        return None
    prog = lowerer.program(mv.src, mv.dst, x.shape, x.device.type, grad=mv.grad)
    if prog.backward_start is None:
        return None
    held = owner._parameters
    local = {name: local_parameter(p, layout) for name, layout in params if (p := held[name]) is not None}
    return overlapped_linear(x, local["weight"], local.get("bias"), prog)
