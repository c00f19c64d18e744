"""``redistribute_local``'s fast path: a call whose arguments it has seen goes straight to its program.

The plan cache of a :class:`~tplower.core.lower.redistribute.MeshLowerer` is keyed
on what changes a plan (placements in canonical form, the sizes of sharded
dims, the device type); reaching that key costs a few microseconds per call
(the placements' keys, the planned shape, two lookups). :class:`CallCache`
keys the same programs on the call's arguments as given, which cost almost
nothing to hash: ``src``, ``dst``, ``grad`` and ``global_shape`` themselves,
and the local tensor's ``shape`` and ``device``. A call is stored only after
the full path has checked it and built (or found) its program, so the fast
path serves exactly the calls the full path accepted, with the program the
full path returned; anything else (a new shape, another spelling, an
argument of the wrong type) misses and takes the full path, which checks it.

What may be stored, and why that is exact:

* placements given as a ``str`` or a ``tuple`` of strings and PyTorch
  placements (or ``None`` for ``grad``): immutable, so a stored key cannot
  change behind the cache. A list or a mapping is never stored (a list
  cannot be hashed; a mapping or another sequence could change); those
  calls always take the full path.
* ``global_shape`` ``None``, a ``torch.Size``, or a tuple of plain ``int``:
  and the lookup insists on the same, since ``(8.0, 3) == (8, 3)`` and
  ``True == 1`` in Python; a float or a bool takes the full path and its
  ``TypeError``.

:class:`IdentityMap` finds a mesh's lowerer by the mesh object's identity,
without hashing the mesh (``DeviceMesh.__hash__`` is Python code) and
without keeping the mesh alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import torch
from torch.distributed.tensor.placement_types import Placement

from .cache import LRUCache

__all__ = ["CallCache", "IdentityMap"]

V = TypeVar("V")


def _storable_spec(spec: object) -> bool:
    """Whether ``spec`` cannot change after the call: a string, or a tuple of strings and placements."""
    return type(spec) is str or (type(spec) is tuple and all(type(p) is str or isinstance(p, Placement) for p in spec))


def _exact_shape(shape: object) -> bool:
    """Whether ``shape`` is a ``torch.Size`` or a tuple of plain ints (the only global shapes a key may hold)."""
    return type(shape) is torch.Size or (type(shape) is tuple and all(type(s) is int for s in shape))


class CallCache(LRUCache[Hashable, V], Generic[V]):
    """The program of each call seen before, keyed on the call's arguments as given (see the module docstring).

    Bounded as every tplower cache (:func:`tplower.set_cache_size`); beyond
    the bound the oldest stored call is dropped (a lookup does not refresh
    it: the full path stores it again on its next call). A hit counts as a
    hit of ``counts``, the plan cache it stands in front of, so that cache's
    :meth:`~tplower.core.lower.cache.LRUCache.cache_info` still counts every
    lookup a call made.

    Args:
        counts: the plan cache whose hit counter a hit here advances.
    """

    def __init__(self, counts: LRUCache[Any, Any]) -> None:
        super().__init__()
        self._counts = counts

    def lookup(self, local: torch.Tensor, src: object, dst: object, grad: object, global_shape: object) -> V | None:
        """The stored program of this call, or ``None`` (then the full path runs and stores it).

        ``local`` must be a plain ``torch.Tensor`` (the caller checks its
        type first). An unhashable argument is a miss, not an error.
        """
        if global_shape is not None and not _exact_shape(global_shape):
            return None
        try:
            found = self._data.get((src, dst, grad, global_shape, local.shape, local.device))
        except TypeError:  # a list or a mapping: never stored
            return None
        if found is not None:
            self._counts._hits += 1
        return found

    def store(
        self, local: torch.Tensor, src: object, dst: object, grad: object, global_shape: object, program: V
    ) -> None:
        """Remember ``program`` for this call, if its arguments can be keyed exactly (else nothing happens).

        Call it only after the full path has checked the call and returned
        ``program`` for it.
        """
        if not (_storable_spec(src) and _storable_spec(dst) and (grad is None or _storable_spec(grad))):
            return
        if global_shape is not None and not _exact_shape(global_shape):
            return
        try:
            self.put((src, dst, grad, global_shape, local.shape, local.device), program)
        except TypeError:  # a tuple holding something unhashable: the full path serves it each time
            return


class IdentityMap(Generic[V]):
    """Values keyed on the identity of live objects, which are held weakly.

    ``get(obj)`` is the value put for this very object (not an equal one),
    or ``None``. An entry goes away when its object is garbage collected;
    the value is held strongly until then.
    """

    def __init__(self) -> None:
        self._data: dict[int, tuple[weakref.ref[Any], V]] = {}

    def get(self, obj: object) -> V | None:
        """The value put for ``obj``, or ``None``."""
        entry = self._data.get(id(obj))
        if entry is not None and entry[0]() is obj:
            return entry[1]
        return None

    def put(self, obj: object, value: V) -> None:
        """Map ``obj`` (which must accept weak references) to ``value``, replacing any value it had.

        Raises:
            TypeError: ``obj`` cannot be weakly referenced.
        """
        key = id(obj)
        self._data[key] = (weakref.ref(obj, self._forget(key)), value)

    def _forget(self, key: int) -> Callable[[weakref.ref[Any]], None]:
        owner = weakref.ref(self)  # the callback must not keep this map alive

        def forget(ref: weakref.ref[Any]) -> None:
            live = owner()
            entry = None if live is None else live._data.get(key)
            if live is not None and entry is not None and entry[0] is ref:  # not a newer object at a reused id
                live._data.pop(key, None)

        return forget

    def __len__(self) -> int:
        return len(self._data)
