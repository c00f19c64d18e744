"""Plans bound to a live mesh, and the general entry point :func:`redistribute_local`.

A :class:`MeshLowerer` belongs to one ``DeviceMesh``: it checks once that each
axis's process group orders its ranks as the mesh does, keeps a cache of
bound programs keyed on ``(src, dst, grad, shape, device)`` (least recently
used dropped beyond :func:`tplower.set_cache_size`'s bound), and runs them;
in front of that cache, ``redistribute_local`` finds the program of a call it
has seen by the call's own arguments (:mod:`tplower.core.lower.callcache`).
Everything it cannot lower goes to DTensor's ``redistribute`` (forward and
backward), logged at debug level with the reason.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.placement_types import Placement

from ..language.placements import (
    REDUCE_OPS,
    PlacementsLike,
    check_reduce_ops,
    format_placements,
    parse_placements,
    replicate_partials,
)
from ..language.transitions import global_shape_from_local, plan_transition
from ..support import teardown
from ..support.argcheck import check_bool, check_local_tensor, check_mesh, check_shape
from ..support.errors import TPLowerError
from ..support.words import count
from . import collectives as C
from . import debug_path
from .agreement import debug_enabled
from .binding import bind_step
from .cache import CacheInfo, LRUCache
from .callcache import CallCache, IdentityMap
from .debug_path import name_type_error
from .mesh_facts import axis_order, mesh_facts
from .program import Program
from .traced import _TRACED, _slot, _traced_dims, _traced_slot

__all__ = ["MeshLowerer", "bind_step", "mesh_lowerer", "redistribute_local"]

log = logging.getLogger("tplower")

_is_compiling = torch.compiler.is_compiling  # bound once: read on every call


def _key(spec: Any) -> Hashable:
    if spec is None or isinstance(spec, str):
        return spec
    if isinstance(spec, dict):
        return ("map", tuple(spec.items()))
    if not isinstance(spec, Sequence):  # a tensor, an array, a number: never iterate it
        raise TypeError(f"placements must be a str, a sequence or a mapping, got {type(spec).__name__}")
    return tuple(spec)


class MeshLowerer:
    """Lowers transitions on one ``DeviceMesh`` for this rank; owns the plan cache.

    Args:
        mesh: the device mesh; this rank must be part of it.

    Attributes:
        names: mesh axis names (``dim0``, ``dim1``, ... when the mesh has none).
        shape: ranks per axis.
        coord: this rank's mesh coordinate.
        groups: the process group of each axis.
        orders: per axis, ``None`` when the group orders its ranks as the
            mesh does along that axis, else ``order[c]`` = the group rank of
            mesh coordinate ``c``: collectives then put pieces in mesh order,
            so results follow the mesh coordinates (as DTensor's placements
            mean) whatever order the group was built in.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        check_mesh(mesh, "mesh", "MeshLowerer")
        coord, mesh_ranks, group_ranks = mesh_facts(mesh)
        if coord is None:
            raise TPLowerError(f"mesh={mesh!r}: this rank ({dist.get_rank()}) is not part of the mesh")
        # Held weakly: the module-level map of lowerers must not keep meshes (and, through DTensor's
        # weakref-keyed caches, their stale plans) alive after the caller drops them.
        self._mesh_ref = weakref.ref(mesh)
        self.names: tuple[str, ...] = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
        self.shape: tuple[int, ...] = tuple(mesh.shape)
        self.coord: tuple[int, ...] = tuple(coord)
        self._groups: tuple[ProcessGroup, ...] | None = tuple(mesh.get_group(i) for i in range(mesh.ndim))
        self.orders: tuple[tuple[int, ...] | None, ...] = tuple(
            self._axis_order(i, list(mesh_ranks[i]), list(group_ranks[i])) for i in range(mesh.ndim))
        self._cache: LRUCache[Hashable, Program] = LRUCache()
        #: the programs of calls seen before, keyed on redistribute_local's arguments as given (its fast path)
        self.calls: CallCache[Program] = CallCache(self._cache)
        self._flat_group: ProcessGroup | None = None
        self._planned_dims: LRUCache[Hashable, tuple[frozenset[int] | None]] = LRUCache()
        #: run the debug check on every call (``TPLOWER_DEBUG=1`` when the lowerer was made)
        self.debug: bool = debug_enabled()
        teardown.track(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> MeshLowerer:
        """This lowerer itself: it stands for the live process groups of one mesh, which a copied model shares.

        ``copy.deepcopy`` of a parallelized model then works as for ``parallelize_module``'s (a DTensor's
        copy shares its mesh's groups too); process groups cannot be copied.
        """
        return self

    @property
    def groups(self) -> tuple[ProcessGroup, ...]:
        """The process group of each mesh axis.

        Raises:
            TPLowerError: the groups were destroyed and released (:meth:`release`).
        """
        if self._groups is None:
            raise TPLowerError(f"the process groups of mesh axes {self.names} were destroyed "
                               "(dist.destroy_process_group() or tplower.shutdown()); after a new "
                               "init_process_group, make a new DeviceMesh")
        return self._groups

    def release(self) -> None:
        """Drop this lowerer's process groups and cached programs (called once the groups are destroyed).

        Afterwards :attr:`groups` and every new :meth:`program` raise
        :class:`TPLowerError`; programs built before are released on their own
        (:meth:`Program.release`). Idempotent.
        """
        self._groups = None
        self._flat_group = None
        self._cache.clear()
        self.calls.clear()
        self._planned_dims.clear()

    @property
    def ordered(self) -> tuple[bool, ...]:
        """Per axis, whether its process group orders ranks as the mesh does."""
        return tuple(o is None for o in self.orders)

    @property
    def mesh(self) -> DeviceMesh:
        """The device mesh (raises :class:`TPLowerError` if it was garbage collected)."""
        mesh = self._mesh_ref()
        if mesh is None:
            raise TPLowerError("the DeviceMesh of this lowerer no longer exists; make a lowerer for a live mesh")
        return mesh

    def _axis_order(self, axis: int, mesh_ranks: list[int], group_ranks: list[int]) -> tuple[int, ...] | None:
        return axis_order(self.names[axis], mesh_ranks, group_ranks)

    def parse(self, spec: PlacementsLike, tensor_ndim: int, arg: str) -> tuple[Placement, ...]:
        """Placements of this mesh from any accepted form, shard dims normalised."""
        return parse_placements(spec, self.names, tensor_ndim=tensor_ndim, arg=arg)

    def program(self, src: PlacementsLike, dst: PlacementsLike, local_shape: Sequence[int], device_type: str, *,
                grad: PlacementsLike | None = None, global_shape: Sequence[int] | None = None) -> Program:
        """The cached program for a transition of a local tensor of ``local_shape`` (see :func:`redistribute_local`).

        The cache is bounded (:mod:`tplower.core.lower.cache`): beyond its bound the least
        recently used program is dropped and rebuilt, the same, when next needed.

        Under ``torch.compile`` the lookup is not traced (it runs at trace
        time), so the graph guards on nothing in the cache and the first trace,
        cold cache or warm, is the one every later call reuses.
        """
        if torch.compiler.is_compiling():
            # Traced, a cache lookup would make the graph guard on the cache's contents: a first trace on a
            # cold cache would guard on the program being absent and recompile at the next call, which finds
            # it. So the lookup runs untraced, at trace time, and the trace reads the program from an
            # attribute of its own that never changes (tplower.core.lower.traced).
            dims = _traced_dims(self, src, dst, grad, len(local_shape), global_shape, device_type)
            # The sizes of the dims the placements shard are part of the plan: the graph specializes on them.
            planned = tuple(int(s) if dims is None or i in dims else 1 for i, s in enumerate(local_shape))
            slot = _traced_slot(self, src, dst, planned, device_type, grad, global_shape)
            prog: Program = getattr(_TRACED, slot)
            return prog
        return self._program(src, dst, local_shape, device_type, grad, global_shape)

    def _dims(self, src: PlacementsLike, dst: PlacementsLike, grad: PlacementsLike | None, ndim: int,
              global_shape: Sequence[int] | None, device_type: str) -> tuple[Hashable, frozenset[int] | None]:
        """The placements' part of the cache key, and the dims whose sizes the plan depends on (``None``: all)."""
        pkey = (_key(src), _key(dst), _key(grad), None if global_shape is None else tuple(global_shape), ndim,
                device_type)
        found = self._planned_dims.peek(pkey)
        if found is None:
            found = (self._shaping_dims(src, dst, grad, ndim, global_shape),)
            self._planned_dims.put(pkey, found)
        return pkey, found[0]

    def _program(self, src: PlacementsLike, dst: PlacementsLike, local_shape: Sequence[int], device_type: str,
                 grad: PlacementsLike | None, global_shape: Sequence[int] | None) -> Program:
        pkey, dims = self._dims(src, dst, grad, len(local_shape), global_shape, device_type)
        # Only the sizes of sharded dims change a plan: the others stay out of the key (1 in the planned
        # shape), so a batch dim can stay dynamic under torch.compile.
        shape = tuple(local_shape) if dims is None else tuple(s if i in dims else 1 for i, s in enumerate(local_shape))
        key = (pkey, shape)
        prog = self._cache.get(key)
        if prog is None:
            prog = self._build(src, dst, grad, shape, global_shape, device_type)
            self._cache.put(key, prog)
        return prog

    def _shaping_dims(self, src: PlacementsLike, dst: PlacementsLike, grad: PlacementsLike | None, ndim: int,
                      global_shape: Sequence[int] | None) -> frozenset[int] | None:
        """The tensor dims whose sizes a plan depends on: those any placement shards (``None``: every dim)."""
        if global_shape is not None:
            return None
        try:
            parsed = [self.parse(spec, ndim, arg) for spec, arg in ((src, "src"), (dst, "dst"))]
            if grad is not None:
                parsed.append(self.parse(grad, ndim, "grad"))
        except (TPLowerError, TypeError, ValueError):
            return None  # the build raises the error with the real shape
        if any(self._fallback_reason(ps, ps, ps) is not None for ps in parsed):
            return None  # DTensor runs it on the real global shape
        return frozenset(p.dim for ps in parsed for p in ps if isinstance(p, Shard))

    def cache_info(self) -> CacheInfo:
        """Hits, misses, size, bound and evictions of this mesh's program cache."""
        return self._cache.cache_info()

    def _build(self, src_spec: PlacementsLike, dst_spec: PlacementsLike, grad_spec: PlacementsLike | None,
               lshape: tuple[int, ...], global_shape: Sequence[int] | None, device_type: str) -> Program:
        nd = len(lshape)
        src = self.parse(src_spec, nd, "src")
        dst = self.parse(dst_spec, nd, "dst")
        grad = replicate_partials(dst) if grad_spec is None else self.parse(grad_spec, nd, "grad")
        for ps, arg in ((src, "src"), (dst, "dst"), (grad, "grad")):
            check_reduce_ops(ps, arg)
        if global_shape is None:
            gshape = global_shape_from_local(lshape, src, self.shape)
        else:
            gshape = check_shape(global_shape, "global_shape", "redistribute_local")
            if len(gshape) != nd:
                raise TPLowerError(f"global_shape={gshape} has {count(len(gshape), 'dim')} but the local tensor "
                                   f"has {nd}")
        reason = self._fallback_reason(src, dst, grad)
        if reason is not None:
            log.debug("tplower: %s -> %s falls back to DTensor: %s", format_placements(src),
                      format_placements(dst), reason)
            fallback = functools.partial(self.dtensor_redistribute, src=src, dst=dst, grad=grad, gshape=gshape)
            return Program(None, (fallback,), (), reason, gshape)
        plan = plan_transition(src, dst, gshape, self.shape, self.coord, grad)
        if plan.in_shape != lshape:
            raise TPLowerError(
                f"local tensor has shape {lshape} but {format_placements(src)!r} of global shape {gshape} on mesh "
                f"{dict(zip(self.names, self.shape, strict=True))} gives {plan.in_shape} at coordinate {self.coord}; "
                "pass global_shape= for uneven shards")
        for axis, g in enumerate(self.groups):
            C.check_device(str(dist.get_backend(g)), device_type, f"mesh axis {self.names[axis]!r}")
        caps = [C.backend_caps(C.backend_name_for(g, device_type)) for g in self.groups]
        fwd = tuple(bind_step(s, self.groups[s.axis], caps[s.axis], order=self.orders[s.axis]) for s in plan.forward)
        bwd = tuple(bind_step(s, self.groups[s.axis], caps[s.axis], order=self.orders[s.axis]) for s in plan.backward)
        return Program(plan, fwd, bwd, None, gshape)

    def checked(self, local: torch.Tensor, src: PlacementsLike, dst: PlacementsLike, *,
                grad: PlacementsLike | None = None, global_shape: Sequence[int] | None = None,
                where: str | None = None, hint: str | None = None) -> torch.Tensor:
        """:func:`redistribute_local` after the debug check (:func:`tplower.core.lower.debug_path.checked`);
        collective."""
        return debug_path.checked(self, local, src, dst, grad=grad, global_shape=global_shape, where=where, hint=hint)

    def _fallback_reason(self, src: Sequence[Placement], dst: Sequence[Placement],
                         grad: Sequence[Placement]) -> str | None:
        for ps in (src, dst, grad):
            for p in ps:
                if isinstance(p, Partial) and p.reduce_op not in REDUCE_OPS:
                    return f"Partial({p.reduce_op!r}) is not lowered"
                if type(p).__name__ not in ("Shard", "Replicate", "Partial"):
                    return f"placement {p!r} is not lowered"
        return None

    def dtensor_redistribute(self, local: torch.Tensor, *, src: Sequence[Placement], dst: Sequence[Placement],
                             grad: Sequence[Placement], gshape: Sequence[int]) -> torch.Tensor:
        """DTensor's ``redistribute`` of ``local`` (global shape ``gshape``), forward and backward: the fallback.

        ``src``/``dst``/``grad`` are parsed placements with non-negative shard dims.
        """
        stride = torch.empty(gshape, device="meta").stride()
        dt = DTensor.from_local(local, self.mesh, tuple(src), run_check=False, shape=torch.Size(gshape),
                                stride=stride)
        return dt.redistribute(self.mesh, tuple(dst)).to_local(grad_placements=tuple(grad))


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]
def _traced_lowerer_slot(mesh: DeviceMesh) -> str:
    """The attribute of :data:`_TRACED` holding ``mesh``'s lowerer (made at trace time, untraced)."""
    return _slot(mesh_lowerer(mesh))


# Keyed on the mesh object itself, held weakly: the map must not keep meshes (and, through DTensor's
# weakref-keyed caches, their stale plans) alive after the caller drops them.
_LOWERERS: IdentityMap[MeshLowerer] = IdentityMap()


def mesh_lowerer(mesh: DeviceMesh) -> MeshLowerer:
    """The :class:`MeshLowerer` of ``mesh`` (one per live mesh object, made on first use).

    Raises:
        TypeError: ``mesh`` is not a ``DeviceMesh``.
        TPLowerError: this rank is not part of ``mesh``.
    """
    lowerer = _LOWERERS.get(mesh)
    if lowerer is None:
        check_mesh(mesh, "mesh", "mesh_lowerer")
        lowerer = MeshLowerer(mesh)
        _LOWERERS.put(mesh, lowerer)
    return lowerer


def redistribute_local(local: torch.Tensor, mesh: DeviceMesh, src: PlacementsLike, dst: PlacementsLike, *,
                       grad: PlacementsLike | None = None, global_shape: Sequence[int] | None = None,
                       check: bool | None = None) -> torch.Tensor:
    """Move this rank's local tensor from ``src`` to ``dst`` placements on ``mesh``.

    Args:
        local: this rank's local tensor (any dtype the backend carries;
            non-contiguous is fine; never modified).
        mesh: the device mesh; ``src``/``dst``/``grad`` have one placement
            per mesh axis.
        src, dst: placements in any form :func:`~tplower.parse_placements`
            accepts (``"S(0),R"``, ``[Shard(0), Replicate()]``,
            ``{"tp": "S(1)"}``).
        grad: placement of the gradient arriving at the output in backward;
            default ``dst`` with every ``Partial`` read as ``Replicate`` (the
            gradient of a partial sum is the full gradient on every rank;
            DTensor's ``to_local`` default in torch 2.13). Backward moves it
            to ``src`` with ``Partial`` read as ``Replicate``.
        global_shape: logical shape of the whole tensor; needed when shards
            are uneven (``torch.chunk`` semantics). Without it every shard is
            assumed even and the global shape is inferred from ``local``.
        check: run the debug check first (every rank describes its call, the
            ranks compare, all raise alike on a difference or on any rank's
            error); it costs one small ``all_gather`` of a 64-bit digest per
            call, and the full descriptions travel (``all_gather_object``)
            only when the digests differ (:mod:`tplower.core.lower.agreement`). Default
            ``TPLOWER_DEBUG=1``. Must be the same on every rank.

    Returns:
        The local tensor of ``dst``: a new tensor, except that an identity
        transition outside autograd returns ``local`` itself.

    Raises:
        TPLowerError: bad placements, a pair with no correct lowering
            (``P(x) -> P(y)`` on one axis; a tensor ``Partial`` with ``max`` or
            ``min`` and another reduce op on other axes), a ``grad`` that does
            not fit the output, or a ``local`` whose shape does not match
            ``src`` and ``global_shape``; with ``check``, on every rank when
            any rank's call differs or fails.
        TypeError: an argument of the wrong type (``local`` not a
            ``torch.Tensor`` or a DTensor, ``mesh`` not a ``DeviceMesh``,
            placements neither a string, a sequence nor a mapping,
            ``global_shape`` not a sequence of ints, ``check`` not a bool),
            raised before any collective, naming the argument. With
            ``check``, a wrong ``local`` (or placements) on any rank raises
            :class:`~tplower.core.support.errors.TPLowerTypeError` (a ``TypeError`` and a
            ``TPLowerError``) on every rank.

    Lowered to direct collectives when :mod:`tplower.core.language.transitions` can plan
    it; otherwise (placements other than Shard/Replicate/Partial of
    sum/avg/max/min) DTensor's ``redistribute`` runs it, forward and
    backward. Shards follow mesh coordinates even where an axis's process
    group orders its ranks differently (DTensor gets uneven shards wrong there).

    A call whose arguments were seen before (the same mesh object, placements
    given as the same strings or tuples, global shape, local shape and
    device) goes straight to its program (:mod:`tplower.core.lower.callcache`);
    every other call is checked in full first.
    """
    if not _is_compiling():
        lowerer = _LOWERERS.get(mesh)
        if lowerer is not None and type(local) is torch.Tensor:
            if check is False or (check is None and not lowerer.debug):
                prog = lowerer.calls.lookup(local, src, dst, grad, global_shape)
                if prog is not None:
                    return prog(local)
    try:
        # Traced, the lookup would guard on the map of lowerers (and a first use would make the lowerer inside
        # the graph): it runs untraced at trace time, as the program lookup does.
        lowerer = getattr(_TRACED, _traced_lowerer_slot(mesh)) if torch.compiler.is_compiling() else \
            mesh_lowerer(mesh)
    except TypeError:
        check_mesh(mesh, "mesh", "redistribute_local")
        raise
    if check is not None and not isinstance(check, bool):
        check_bool(check, "check", "redistribute_local", optional=True)
    if check or (check is None and lowerer.debug):
        return lowerer.checked(local, src, dst, grad=grad, global_shape=global_shape)
    if type(local) is not torch.Tensor:  # a Parameter passes; a DTensor, a list or None does not
        check_local_tensor(local, "local", "redistribute_local")
    if global_shape is not None:  # every time: a cached key does not tell (8.0, 3) from (8, 3)
        check_shape(global_shape, "global_shape", "redistribute_local")
    try:
        prog = lowerer.program(src, dst, local.shape, local.device.type, grad=grad, global_shape=global_shape)
    except TypeError:  # e.g. an unhashable spec fails in the cache lookup: name the argument instead
        name_type_error(lowerer.names, src, dst, grad, global_shape)
        raise
    if type(local) is torch.Tensor and not _is_compiling():
        lowerer.calls.store(local, src, dst, grad, global_shape, prog)
    return prog(local)
