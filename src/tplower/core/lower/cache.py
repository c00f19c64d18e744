"""Bounded least-recently-used caches: every cache tplower keeps in a process is one of these.

tplower caches one bound :class:`~tplower.core.lower.redistribute.Program` per transition
and local shape, in each mesh's :class:`~tplower.core.lower.redistribute.MeshLowerer` and
in each seed-compatible :class:`~tplower.core.lower.lowering.TPExecutionOp` (and the ops
of :class:`~tplower.plans.forms.TPOperators`). Serving and training with
variable sequence lengths make a new key for every new length, so a cache
without a bound grows for as long as the process lives (about 5 KiB of
resident memory per program). Each :class:`LRUCache` keeps at most its bound and drops
the least recently used entry beyond it; a dropped program is rebuilt, the
same program, on its next call.

The bound (entries per cache, the same for every cache):

* default :data:`DEFAULT_CACHE_SIZE`;
* ``TPLOWER_CACHE_SIZE=N`` in the environment, read when the first cache is
  made (a bad value raises ``ValueError`` there, naming the variable);
* :func:`set_cache_size` at any time: live caches shrink or grow at once.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["CACHE_SIZE_ENV", "DEFAULT_CACHE_SIZE", "CacheInfo", "LRUCache", "cache_size", "set_cache_size"]

#: Entries per cache unless set otherwise. A program holds 2-4 KiB of Python objects (its plan and bound
#: steps; about 5 KiB of resident memory), so a full cache is at most about 20 MiB per mesh. One sequence
#: length needs only the few distinct (transition, sharded sizes) keys of its boundaries (layers of the same
#: shapes share them), so 4096 entries keep the programs of several hundred recent lengths. A miss beyond
#: that plans and binds again: 85-180 µs against about 1.5 µs for a hit (2-core CPU, ``tplower bench
#: --phases fake``, the plan cache table), about one small collective's latency, so even a workload that
#: misses every call stays correct and pays well under a millisecond per boundary.
DEFAULT_CACHE_SIZE = 4096

#: The environment variable that sets the bound of every cache (entries, an integer >= 1).
CACHE_SIZE_ENV = "TPLOWER_CACHE_SIZE"

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_bound: int | None = None  # None: not read yet (environment or default on first use)
_followers: weakref.WeakSet[LRUCache[Any, Any]] = weakref.WeakSet()


def _checked(n: object, arg: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{arg}={n!r} is not a valid cache size; allowed: an integer >= 1 (entries per cache; "
                         f"default {DEFAULT_CACHE_SIZE})")
    return n


def _from_env() -> int:
    text = os.environ.get(CACHE_SIZE_ENV, "").strip()
    if not text:
        return DEFAULT_CACHE_SIZE
    value: object = text
    with contextlib.suppress(ValueError):
        value = int(text)
    return _checked(value, CACHE_SIZE_ENV)


def cache_size() -> int:
    """The bound of every tplower cache now, in entries.

    Raises:
        ValueError: ``TPLOWER_CACHE_SIZE`` is set but is not an integer >= 1
            (read on the first call, unless :func:`set_cache_size` came first).
    """
    global _bound
    if _bound is None:
        _bound = _from_env()
    return _bound


def set_cache_size(n: int) -> int:
    """Bound every tplower plan cache of this process to ``n`` entries; returns the previous bound.

    Applies to the caches that exist (each drops its least recently used
    entries beyond ``n`` at once) and to every cache made later; overrides
    ``TPLOWER_CACHE_SIZE``. Call it on every rank alike: a dropped program is
    rebuilt on its next call with the same result, so ranks with different
    bounds still agree, but their planning times differ.

    Args:
        n: entries per cache (an integer >= 1). The default,
            :data:`DEFAULT_CACHE_SIZE` = 4096, holds about 20 MiB of programs
            per mesh at most.

    Returns:
        The bound before this call (so a caller can restore it).

    Raises:
        ValueError: ``n`` is not an integer >= 1.
    """
    global _bound
    n = _checked(n, "n")
    old = cache_size()
    _bound = n
    for cache in list(_followers):
        cache._shrink(n)
    return old


@dataclass(frozen=True)
class CacheInfo:
    """Counters of one :class:`LRUCache`.

    Attributes:
        hits: lookups that found their entry.
        misses: lookups that did not (each is followed by a build).
        size: entries held now.
        maxsize: the bound.
        evictions: entries dropped to keep within the bound.
    """

    hits: int
    misses: int
    size: int
    maxsize: int
    evictions: int


class LRUCache(Generic[K, V]):
    """A mapping of at most ``maxsize`` entries that drops the least recently used one beyond it.

    ``get`` marks an entry used; ``put`` inserts (or refreshes) one and
    evicts the oldest beyond the bound. Values must not be ``None`` (``get``
    returns ``None`` for a missing key).

    Without a lock, so that ``torch.compile`` traces a lookup without a
    graph break: each step is one ``OrderedDict`` operation, atomic under
    the GIL, and a race costs at most a rebuild (two threads missing the
    same key both build, the later ``put`` wins; an entry evicted by another
    thread between two steps is dropped a little early). The counters are
    exact in one thread and approximate when threads share a cache.

    Args:
        maxsize: a fixed bound (an integer >= 1); ``None`` (default) follows
            the process-wide bound (:func:`cache_size`, :func:`set_cache_size`).

    Raises:
        ValueError: ``maxsize`` is not an integer >= 1, or (``maxsize=None``)
            ``TPLOWER_CACHE_SIZE`` is not one.
    """

    def __init__(self, maxsize: int | None = None) -> None:
        self._data: OrderedDict[K, V] = OrderedDict()
        self._hits = self._misses = self._evictions = 0
        if maxsize is None:
            self._maxsize = cache_size()
            _followers.add(self)
        else:
            self._maxsize = _checked(maxsize, "maxsize")

    def get(self, key: K) -> V | None:
        """The entry of ``key`` (now the most recently used), or ``None``; counts a hit or a miss."""
        value = self._data.get(key)
        if value is None:
            self._misses += 1
            return None
        try:
            self._data.move_to_end(key)
        except KeyError:  # another thread evicted it meanwhile: the value is still good
            pass
        self._hits += 1
        return value

    def peek(self, key: K) -> V | None:
        """The value of ``key`` or ``None``, without counting a hit or a miss or refreshing its recency.

        What runs under ``torch.compile`` uses it: a graph would guard on the
        counters and the order, and recompile every call.
        """
        return self._data.get(key)

    def put(self, key: K, value: V) -> None:
        """Store ``value`` under ``key`` as the most recently used; evict the oldest beyond the bound."""
        self._data[key] = value
        try:
            self._data.move_to_end(key)
        except KeyError:  # another thread evicted it meanwhile; it is built again when next needed
            pass
        self._evict(self._maxsize)

    def get_or_build(self, key: K, build: Callable[[], V]) -> V:
        """The entry of ``key``; on a miss ``build()``'s result, stored (exceptions propagate, nothing stored)."""
        value = self.get(key)
        if value is None:
            value = build()
            self.put(key, value)
        return value

    def _evict(self, bound: int) -> None:
        while len(self._data) > bound:
            try:
                self._data.popitem(last=False)
            except KeyError:  # another thread emptied it meanwhile
                return
            self._evictions += 1

    def _shrink(self, bound: int) -> None:
        self._maxsize = bound
        self._evict(bound)

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        self._data.clear()

    def __getitem__(self, key: K) -> V:
        """The value of ``key``, as :meth:`peek` (no counting, no refresh).

        Raises:
            KeyError: ``key`` is not cached (never built, or evicted).
        """
        return self._data[key]

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    @property
    def maxsize(self) -> int:
        """The bound, in entries."""
        return self._maxsize

    def cache_info(self) -> CacheInfo:
        """Hits, misses, size, bound and evictions so far."""
        return CacheInfo(self._hits, self._misses, len(self._data), self._maxsize, self._evictions)
