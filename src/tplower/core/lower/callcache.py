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

* placements given as a ``str``, or as a ``tuple``, ``list`` or ``dict``
  (``{axis name: placement}``) whose entries are strings and PyTorch
  placements (or ``None`` for ``grad``). Strings, tuples and placements are
  immutable; a list or a dict could change after the call, so the key holds
  an immutable snapshot of it taken at every call (the entries of a list, the
  mapping's ``(name, placement)`` pairs in order): a list changed after a
  call looks up what it holds now. A list and a tuple of the same entries
  share a key (they parse alike), and so do ``Shard(d)``, ``Replicate()``
  and ``Partial(op)`` and their strings (``"S(d)"``, ``"R"``, ``"P(op)"``),
  which hash in C; a mapping's key carries a marker no sequence can hold,
  so a mapping never meets a sequence's program. Any
  other type (another ``Sequence`` or ``Mapping`` class, whose contents
  could come from anywhere) is never stored; those calls take the full
  path each time.
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
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .cache import LRUCache

__all__ = ["CallCache", "IdentityMap"]

V = TypeVar("V")


class _Mapping:
    """The marker that opens a mapping's key: no placement sequence can hold it, so no sequence meets that key."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<mapping>"


_MAPPING = _Mapping()
_UNKEYED = [None]  # unhashable: a key holding it misses every lookup and is never stored


def _entry_key(p: object) -> object:
    """One placement's part of a key: ``"R"``, ``"S(d)"`` or ``"P(op)"`` for the three plain types, else itself.

    The string parses to the very placement it stands for, so the two share
    a key exactly; and a string hashes and compares in C, where a placement's
    ``__hash__`` is Python code and its ``__eq__`` a binding call (together
    about 0.5 us a placement, more than the rest of the lookup).
    """
    kind = type(p)
    if kind is Replicate:
        return "R"
    if kind is Shard:
        return _SHARD_TEXT.get(p.dim, p)  # type: ignore[attr-defined]
    if kind is Partial:
        return _PARTIAL_TEXT.get(p.reduce_op, p)  # type: ignore[attr-defined]
    return p


_SHARD_TEXT = {d: f"S({d})" for d in range(-8, 8)}
_PARTIAL_TEXT = {op: f"P({op})" for op in ("sum", "avg", "max", "min")}
#: the keys of one-axis specs of one ``Shard``, ``Partial`` or ``Replicate``, made once (no tuple made per call)
_SHARD_KEYS = {d: (text,) for d, text in _SHARD_TEXT.items()}
_PARTIAL_KEYS = {op: (text,) for op, text in _PARTIAL_TEXT.items()}
_REPLICATE_KEY = ("R",)


def _snapshot(spec: object) -> object:
    """The key of a ``tuple``, ``list`` or ``dict`` spec as it is now; an unhashable marker for any other type.

    Strings and ``None`` never reach here (the callers keep them as they are, which is cheapest).
    """
    kind = type(spec)
    if kind is list or kind is tuple:
        if len(spec) == 1:  # type: ignore[arg-type]  # one mesh axis, the common case: a key made beforehand
            p = spec[0]  # type: ignore[index]
            kind = type(p)
            if kind is Replicate:
                return _REPLICATE_KEY
            if kind is Shard:
                return _SHARD_KEYS.get(p.dim) or (_entry_key(p),)
            if kind is Partial:
                return _PARTIAL_KEYS.get(p.reduce_op) or (_entry_key(p),)
            return (_entry_key(p),)
        return tuple(map(_entry_key, spec))  # type: ignore[call-overload]
    if kind is dict:
        return (_MAPPING, *spec.items())  # type: ignore[attr-defined]
    return _UNKEYED


def _entry(p: object) -> bool:
    return type(p) is str or isinstance(p, Placement)


def _storable_key(key: object) -> bool:
    """Whether a spec's key holds only strings and placements (a mapping's: axis names to them)."""
    if type(key) is str:
        return True
    if type(key) is not tuple:
        return False
    if key and key[0] is _MAPPING:
        return all(type(pair) is tuple and len(pair) == 2 and type(pair[0]) is str and _entry(pair[1])
                   for pair in key[1:])
    return all(_entry(p) for p in key)


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
        try:  # strings inline, the common spelling; lists and mappings by the snapshot of what they hold now
            found = self._data.get((src if type(src) is str else _snapshot(src),
                                    dst if type(dst) is str else _snapshot(dst),
                                    grad if grad is None or type(grad) is str else _snapshot(grad),
                                    global_shape, local.shape, local.device))
        except TypeError:  # unhashable (an entry of a list, another type): never stored
            return None
        if found is not None:
            self._counts._hits += 1
        return found

    def store(
        self, local: torch.Tensor, src: object, dst: object, grad: object, global_shape: object, program: V
    ) -> None:
        """Remember ``program`` for this call, if its arguments can be keyed exactly (else nothing happens).

        Call it only after the full path has checked the call and returned
        ``program`` for it, with the arguments as they were when it checked them.
        """
        keys = tuple(spec if type(spec) is str else _snapshot(spec) for spec in (src, dst))
        gkey = None if grad is None else grad if type(grad) is str else _snapshot(grad)
        if not (all(_storable_key(k) for k in keys) and (gkey is None or _storable_key(gkey))):
            return
        if global_shape is not None and not _exact_shape(global_shape):
            return
        try:
            self.put((*keys, gkey, global_shape, local.shape, local.device), program)
        except TypeError:  # a placement that cannot be hashed: the full path serves it each time
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
