"""Per-call constants that a ``torch.compile`` trace reads from one place, found by number.

A hook or boundary that reads its layout from its own attributes makes
dynamo guard every field of it once per module (36 boundaries of a small
BERT: about 2,500 guard lines checked on every call), and an object reached
from two modules gets an ``is`` guard evaluated in Python. Here a layout is
an immutable value (a frozen dataclass with a ``key`` field), interned so
that equal layouts are one object (:func:`intern`); the module keeps only
its number. Traced, :func:`traced` turns the number into the object at trace
time, untraced, and reads it from an attribute of
:data:`tplower.core.lower.redistribute._TRACED` bound once, so the graph guards on
one integer per module and on each distinct layout once. Eager code uses
the object itself, through a reference it keeps.

Objects are held weakly: a layout no module uses any more is dropped, until
a trace has read it (then it is kept for the life of the process, as the
programs a trace reads are).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import fields, replace
from typing import Any, Protocol, TypeVar

import torch

from ..core.lower.traced import _TRACED, _slot

__all__ = ["intern", "register", "slot_key", "traced"]


class _Keyed(Protocol):
    @property
    def key(self) -> int: ...


T = TypeVar("T", bound=_Keyed)

_INTERNED: weakref.WeakValueDictionary[tuple[Any, ...], Any] = weakref.WeakValueDictionary()
_BY_KEY: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def register(obj: object) -> int:
    """A new number for ``obj`` (compared by identity; it must be weakly referenceable).

    Raises:
        TypeError: ``obj`` cannot be weakly referenced (a ``list``, say: wrap it).
    """
    key = next(_KEYS)
    _BY_KEY[key] = obj
    return key


def intern(value: T) -> T:
    """The one live object equal to ``value``: an earlier one, or a copy of ``value`` numbered now.

    ``value`` is a frozen dataclass whose ``key`` field is declared with
    ``compare=False``; equality is over its other fields (``==``, so they
    must compare by value or by identity as intended, and be hashable).
    """
    by_value = tuple(getattr(value, f.name) for f in fields(value) if f.compare)  # type: ignore[arg-type]
    found: T | None = _INTERNED.get(by_value)
    if found is None:
        key = next(_KEYS)
        found = replace(value, key=key)  # type: ignore[type-var]
        _INTERNED[by_value] = found
        _BY_KEY[key] = found
    return found


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def _traced_slot(key: int | str) -> str:
    """The attribute of the trace's kept objects that holds object ``key`` (runs at trace time, untraced)."""
    return _slot(_BY_KEY[int(key)])


def traced(key: int | str) -> Any:
    """The object numbered ``key``, for code running under ``torch.compile`` (read from one guarded place).

    A hook keeps the number as a string (:func:`slot_key`): dynamo specializes a string attribute on its value,
    while an int attribute that a second value reaches through the same code (the same hook class on a second
    model) becomes dynamic, which this lookup cannot take (a graph break)."""
    return getattr(_TRACED, _traced_slot(key))


def slot_key(key: int) -> str:
    """``key`` as the string a hook keeps for :func:`traced`."""
    return str(key)
