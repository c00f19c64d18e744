"""A transition bound to one rank's process groups: forward and backward steps, run as one autograd Function.

:class:`Program` is what a :class:`~tplower.core.lower.redistribute.MeshLowerer`
builds for each ``(src, dst, grad, shape, device)`` and caches: its bound
forward steps run the transition, its bound backward steps run the
transition of the gradient back (:class:`~tplower.core.lower.collectives.LoweredTransition`),
or a fallback runs DTensor. :mod:`tplower.core.support.teardown` releases it when its
process groups are destroyed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..language.transitions import TransitionPlan
from ..support import teardown
from ..support.errors import TPLowerError
from . import collectives as C
from .overlap import PendingReduce, all_reduce_start

__all__ = ["Program"]


def _released_step(x: torch.Tensor) -> torch.Tensor:
    raise TPLowerError("this tplower program's process groups were destroyed (dist.destroy_process_group() or "
                       "tplower.shutdown()); after a new init_process_group, make a new DeviceMesh and parallelize "
                       "again")


@dataclass(eq=False)
class Program:
    """A transition ready to run on one rank: bound forward and backward steps, or a fallback.

    Set once when built; only :meth:`release` changes it. Compared and
    hashed by identity (it is tracked in a weak set, :mod:`tplower.core.support.teardown`).

    Attributes:
        plan: the pure plan (``None`` when falling back, and for the
            expert dispatch's variable-split exchange, which is no placement
            transition: :func:`tplower.core.ops.dispatch.all_to_all_splits`).
        forward, backward: bound steps.
        fallback_reason: why DTensor runs this transition, or ``None``.
        global_shape: the global shape given or inferred.
        backward_start: for a transition whose forward is the identity and
            whose backward is one ``all_reduce`` (``R -> R`` with gradient
            ``P``), that all_reduce started and not waited for
            (:func:`tplower.core.lower.overlap.all_reduce_start`, same group and
            op), so a caller can compute while it runs
            (:class:`tplower.core.lower.overlap.OverlappedLinear`); else ``None``.
    """

    plan: TransitionPlan | None
    forward: tuple[C.BoundStep, ...]
    backward: tuple[C.BoundStep, ...]
    fallback_reason: str | None = None
    global_shape: tuple[int, ...] | None = None
    backward_start: Callable[[torch.Tensor], PendingReduce] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.forward or self.backward:  # bound steps may hold process groups
            teardown.track(self)
        step = self.backward[0] if len(self.backward) == 1 and not self.forward else None
        if self.fallback_reason is None and isinstance(step, functools.partial) and step.func is C.all_reduce:
            # the bound step's own arguments (group, op, n, native): started instead of run, nothing bound twice
            self.backward_start = functools.partial(all_reduce_start, **step.keywords)

    def release(self) -> None:
        """Drop the bound steps (and the process groups they hold); running the program afterwards raises.

        Called by :func:`tplower.core.support.teardown.release_destroyed_groups` once
        the groups are destroyed, wherever the program is still held (a cache,
        a module's boundary, a graph awaiting backward).
        """
        self.forward = (_released_step,)
        self.backward = (_released_step,)
        self.backward_start = None

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        """Run forward; differentiable through :class:`~tplower.core.lower.collectives.LoweredTransition`."""
        if self.fallback_reason is not None:  # DTensor's own autograd carries the backward
            return self.forward[0](local)
        if local.requires_grad and torch.is_grad_enabled():
            out: torch.Tensor = C.LoweredTransition.apply(local, self)
            return out
        return C.run_steps(local, self.forward)
