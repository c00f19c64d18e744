"""Objects a ``torch.compile`` trace reads, each kept at one attribute of one namespace for good.

A trace that reads ``_TRACED.p3`` guards on that attribute, bound once and
never rebound, so the guard holds for every later call whatever happens to
the caches that made the object (:mod:`tplower.core.redistribute`'s programs
and lowerers, :mod:`tplower.runtime.interned`'s per-call layouts).
"""

from __future__ import annotations

__all__ = ["_TRACED", "_slot"]


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
