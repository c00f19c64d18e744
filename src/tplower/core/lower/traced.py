"""Objects a ``torch.compile`` trace reads, each kept at one attribute of one namespace for good.

A trace that reads ``_TRACED.p3`` guards on that attribute, bound once and
never rebound, so the guard holds for every later call whatever happens to
the caches that made the object (:mod:`tplower.core.lower.redistribute`'s programs
and lowerers, :mod:`tplower.runtime.interned`'s per-call layouts).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import torch

__all__ = ["_TRACED", "_slot", "_traced_dims", "_traced_slot"]


class _TracedObjects:
    """Every program and lowerer a ``torch.compile`` trace has used, one attribute each (``p0``, ``p1``, ...).

    An attribute is bound once and never rebound, so a graph that reads one
    guards on something that holds for good. They are kept for the life of
    the process (a few per distinct transition a graph runs); a lowerer's
    programs are released with their process groups as ever.
    """


_TRACED = _TracedObjects()
_TRACED_SLOTS: dict[int, str] = {}  # id of a kept object -> its attribute


def _slot(obj: object) -> str:
    """``obj``'s attribute of :data:`_TRACED`, bound on first use."""
    slot = _TRACED_SLOTS.get(id(obj))
    if slot is None:
        slot = f"p{len(vars(_TRACED))}"
        setattr(_TRACED, slot, obj)
        _TRACED_SLOTS[id(obj)] = slot
    return slot


class _Lowerer(Protocol):
    """What the traced lookups call of a :class:`~tplower.core.lower.redistribute.MeshLowerer` (which imports this
    module, so it is typed by this protocol)."""

    def _dims(
        self, src: Any, dst: Any, grad: Any, ndim: int, global_shape: Sequence[int] | None, device_type: str
    ) -> tuple[Hashable, frozenset[int] | None]: ...

    def _program(
        self,
        src: Any,
        dst: Any,
        local_shape: Sequence[int],
        device_type: str,
        grad: Any,
        global_shape: Sequence[int] | None,
    ) -> object: ...


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def _traced_dims(
    lowerer: _Lowerer, src: Any, dst: Any, grad: Any, ndim: int, global_shape: Sequence[int] | None, device_type: str
) -> tuple[int, ...] | None:
    """``lowerer._dims`` run at trace time, untraced: its result is a constant of the graph."""
    dims = lowerer._dims(src, dst, grad, ndim, global_shape, device_type)[1]
    return None if dims is None else tuple(sorted(dims))


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def _traced_slot(
    lowerer: _Lowerer,
    src: Any,
    dst: Any,
    planned: tuple[int, ...],
    device_type: str,
    grad: Any,
    global_shape: Sequence[int] | None,
) -> str:
    """The program's attribute of :data:`_TRACED`, looked up (or built) at trace time, untraced.

    A trace reads the program as ``_TRACED.<slot>``: its own guard source,
    bound once and never rebound, so the guard holds for every later call
    whatever happens to the caches.
    """
    return _slot(lowerer._program(src, dst, planned, device_type, grad, global_shape))
