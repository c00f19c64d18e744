"""Ending a process that used torch.distributed without an abort: every reference to a destroyed group dropped.

Why this exists. A gloo ``ProcessGroup`` runs its collectives on worker
threads (``pt_gloo_runloop``) that stop only when the group object itself
is destroyed; ``dist.destroy_process_group()`` unregisters the group but
does not join them. A finished work item that a worker drops may hold the
last reference to a tensor made in Python, and dropping it takes the GIL.
If the interpreter has begun finalizing by then, CPython ends that thread
with ``pthread_exit``, whose forced unwind meets a ``noexcept`` destructor:
``std::terminate`` ("terminate called without an active exception",
SIGABRT) after all the script's work is done. The workers outlive
``destroy_process_group()`` because references to the group remain:

* each ``DeviceMesh`` keeps its groups in ``_pg_registry`` (PyTorch's; the
  mesh lives on in every DTensor parameter of a model);
* tplower's :class:`~tplower.core.lower.redistribute.MeshLowerer` holds each axis's
  group, and every bound :class:`~tplower.core.lower.redistribute.Program` holds
  the groups of its collectives, in the lowerer's cache, in a module's
  boundaries and in the autograd graph of a tensor that is still referenced
  (a ``loss`` kept in a global).

:func:`release_destroyed_groups` drops all of them for the groups that are
no longer registered with torch.distributed and collects while Python is
whole, so each group's destructor joins its workers. It runs by itself at
interpreter exit (an ``atexit`` handler, registered when this module is
imported with ``import tplower``: ``atexit`` handlers run before finalizing
begins), so a script that ends with ``dist.destroy_process_group()`` is
safe, and so is one that forgets it: if the default group is still
initialized at exit, the handler destroys it first. Destroying is a local
call (no collective, no store access), so it does not wait for ranks that
have already exited. Exit handlers registered *before* ``import tplower``
run after this one and find no process group.
:func:`shutdown` is the one call for a script that wants the groups gone
now: it destroys the default group (and with it every other) and releases.

Everything that binds a process group registers itself here with
:func:`track` (an object with a ``release()`` method, held weakly); this
module imports nothing else of tplower.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import weakref
from typing import Any, Protocol

import torch.distributed as dist

__all__ = ["live_gloo_worker_threads", "release_destroyed_groups", "shutdown", "track"]


class Releasable(Protocol):
    """An object that holds process groups and can drop them: ``release()`` must be idempotent."""

    def release(self) -> None: ...


_tracked: weakref.WeakSet[Any] = weakref.WeakSet()
_bound = False  # whether tplower has bound a group in this process (the exit hook acts only then)


def track(obj: Releasable) -> None:
    """Register ``obj`` (held weakly) to be released when its process groups are destroyed; arms the exit hook.

    Called when tplower binds a mesh or a group (a new lowerer, a new
    bound program): never on the hot path of a collective.
    """
    global _bound
    _tracked.add(obj)
    _bound = True  # what torch.compile traces here must stay plain Python: no lock, no atexit call


def _live_groups() -> set[int]:
    """Ids of the process groups torch.distributed still has registered (empty once the default one is destroyed)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None) or {}
    return {id(pg) for pg in pg_map}


def _forget_destroyed_mesh_groups(live: set[int]) -> int:
    """Remove destroyed groups from every ``DeviceMesh``'s ``_pg_registry``; returns how many entries were removed.

    Meshes are found by the garbage collector's list of objects (they are
    ordinary Python objects), so meshes tplower never saw are covered too.
    ``_pg_registry`` is PyTorch's private map (torch 2.13); a mesh without
    one is left alone.
    """
    from torch.distributed.device_mesh import DeviceMesh

    removed = 0
    for obj in gc.get_objects():
        # the class's own MRO, not isinstance: DeviceMesh's metaclass checks instances slowly (and warns on some)
        if DeviceMesh not in type(obj).__mro__:
            continue
        registry = getattr(obj, "_pg_registry", None)
        if not isinstance(registry, dict):
            continue
        for name in [n for n, pg in registry.items() if id(pg) not in live]:
            del registry[name]
            removed += 1
    return removed


def _forget_destroyed_default_args(live: set[int]) -> int:
    """Reset default arguments of ``torch.distributed.nn.functional`` that hold a destroyed group to ``None``.

    Its collectives declare ``group=group.WORLD``, evaluated when the module
    is first imported: ``None`` before ``init_process_group``, the default
    group itself after it. ``torch._dynamo`` imports the module, so a script
    that imports ``torch._dynamo`` (``torch.compile``, or tplower itself)
    after ``init_process_group`` pins the default group in those defaults
    for the life of the process, and its gloo workers outlive
    ``destroy_process_group()``. ``None`` is what an import before
    ``init_process_group`` leaves there, and means the default group at call
    time. Returns how many defaults were reset.
    """
    import sys

    module = sys.modules.get("torch.distributed.nn.functional")
    if module is None:
        return 0
    reset = 0
    for fn in vars(module).values():
        defaults = getattr(fn, "__defaults__", None)
        if not isinstance(defaults, tuple) or getattr(fn, "__module__", None) != module.__name__:
            continue
        stale = [isinstance(d, dist.ProcessGroup) and id(d) not in live for d in defaults]
        if any(stale):
            fn.__defaults__ = tuple(None if s else d for d, s in zip(defaults, stale, strict=True))
            reset += sum(stale)
    return reset


def release_destroyed_groups() -> int:
    """Drop every reference tplower and live meshes hold to destroyed process groups; collect if gloo threads remain.

    A group counts as destroyed when torch.distributed no longer has it
    registered (after ``dist.destroy_process_group()``, every group).
    When the default group is gone, every tracked tplower object is
    released: its lowerer or program raises :class:`~tplower.TPLowerError`
    if used again (make a new mesh after a new ``init_process_group``).
    While the default group is still up nothing tplower holds is released
    (a live group may still be in use); meshes lose only their destroyed
    sub-groups. Safe to call any number of times, on any rank, alone: it
    runs no collective.

    Returns:
        The number of tplower objects released (lowerers and programs).
    """
    released = 0
    if not dist.is_initialized():
        for obj in list(_tracked):
            obj.release()
            released += 1
        _tracked.clear()
        _clear_dtensor_caches()
    live = _live_groups()
    _forget_destroyed_mesh_groups(live)
    _forget_destroyed_default_args(live)
    if not live and live_gloo_worker_threads():
        gc.collect()  # cycles that still hold a last reference go now, while Python is whole
    return released


def _clear_dtensor_caches() -> None:
    """DTensor's process-wide redistribution plan caches (keyed on meshes), emptied."""
    from torch.distributed.tensor import _redistribute

    clear = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear is not None:
        clear()
    infos = getattr(_redistribute, "_gen_transform_infos", None)
    if infos is not None and hasattr(infos, "cache_clear"):
        infos.cache_clear()


def shutdown() -> None:
    """End this process's use of torch.distributed so that it exits cleanly.

    Destroys the default process group (and so every group) if it is still
    initialized, then :func:`release_destroyed_groups`: the gloo worker
    threads are joined before this returns, unless the caller still holds a
    ``ProcessGroup`` itself (``mesh.get_group()`` kept in a variable: ``del``
    it first). tplower's exit hook does the same at interpreter exit, so a
    script need not call it; it is for ending distributed work earlier
    (before more work in the same process). Harmless after
    ``dist.destroy_process_group()``; do not call
    ``destroy_process_group()`` after it (torch raises on a second destroy).
    Call it on every rank. Runs no collective. It raises nothing of its own;
    an error of ``destroy_process_group`` propagates.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    release_destroyed_groups()


def _at_exit() -> None:
    # atexit handlers run before the interpreter starts finalizing, so a group destructor that joins its
    # workers here lets them drop Python objects normally. A default group the script left up is destroyed
    # first: destroy_process_group is local (each backend's shutdown, no collective), so ranks that already
    # exited are not waited for. Never raise at exit.
    with contextlib.suppress(Exception):  # a failing teardown must not mask the script's own exit status
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            release_destroyed_groups()
        elif _bound:
            release_destroyed_groups()


atexit.register(_at_exit)  # at import: the handlers registered before tplower is imported run after it


def live_gloo_worker_threads() -> list[str]:
    """Names of this process's threads that belong to gloo (``pt_gloo_runloop``, ``gloo_tcp_loop``); Linux only.

    Read from ``/proc/self/task/*/comm`` (the kernel's 15-character thread
    names); an empty list where ``/proc`` does not exist.
    """
    import glob

    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                name = f.read().strip()
        except OSError:  # the thread ended while we looked
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)
