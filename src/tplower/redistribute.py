"""Plans bound to a live mesh, and the general entry point :func:`redistribute_local`.

A :class:`MeshLowerer` belongs to one ``DeviceMesh``: it checks once that each
axis's process group orders its ranks as the mesh does, keeps a cache of
bound programs keyed on ``(src, dst, grad, shape, device)``, and runs them.
Everything it cannot lower goes to DTensor's ``redistribute`` (forward and
backward), logged at debug level with the reason.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.placement_types import Placement

from . import collectives as C
from .agreement import check_agreement, debug_enabled
from .errors import TPLowerError
from .placements import REDUCE_OPS, PlacementsLike, format_placements, parse_placements, replicate_partials
from .transitions import Step, TransitionPlan, global_shape_from_local, plan_transition

__all__ = ["MeshLowerer", "Program", "bind_step", "mesh_lowerer", "redistribute_local"]

log = logging.getLogger("tplower")


def bind_step(step: Step, group: ProcessGroup | None, caps: C.BackendCaps, *,
              force_all_reduce_shard: bool = False, order: tuple[int, ...] | None = None) -> C.BoundStep:
    """The collective function that carries ``step`` on ``group``, arguments bound.

    The remap for a backend without a native collective is chosen here,
    once, from ``caps``: ``reduce_scatter`` becomes ``all_reduce`` + chunk,
    ``all_to_all`` becomes ``all_gather`` + chunk, ``avg`` becomes sum + divide.
    ``order[c]`` is the group rank of mesh coordinate ``c`` when the group
    orders its ranks unlike the mesh (``None`` when they agree). ``group``
    may be ``None`` only for steps that do not communicate.
    """
    n, r, ls, d = step.group_size, step.rank, step.logical_shape, step.tensor_dim
    op = step.reduce_op or "sum"
    kind = step.kind
    if kind == "chunk":
        assert d is not None
        return functools.partial(C.chunk, n=n, rank=r, dim=d)
    if kind == "partition":
        return functools.partial(C.partition, n=n, op=op)
    if kind == "zero_fill":
        assert d is not None
        return functools.partial(C.zero_fill, n=n, rank=r, dim=d, size=ls[d], op=op)
    assert group is not None, f"step {step} needs a process group"
    native_avg = "avg" in caps.all_reduce_ops
    if kind == "all_gather":
        assert d is not None
        return functools.partial(C.all_gather, group=group, n=n, dim=d, size=ls[d], order=order)
    if kind == "all_reduce":
        return functools.partial(C.all_reduce, group=group, op=op, n=n, native=op in caps.all_reduce_ops)
    if kind == "reduce_scatter":
        assert d is not None
        if not force_all_reduce_shard and op in caps.reduce_scatter_ops:
            return functools.partial(C.reduce_scatter, group=group, n=n, rank=r, dim=d, op=op, order=order)
        if not force_all_reduce_shard and op == "avg" and "sum" in caps.reduce_scatter_ops:
            return functools.partial(C.reduce_scatter, group=group, n=n, rank=r, dim=d, op=op, native_avg=False,
                                     order=order)
        return functools.partial(C.all_reduce_chunk, group=group, n=n, rank=r, dim=d, op=op, native_avg=native_avg)
    if kind == "all_to_all":
        j = step.dst_dim
        assert d is not None and j is not None
        fn = C.all_to_all if caps.all_to_all else C.all_to_all_via_gather
        return functools.partial(fn, group=group, n=n, rank=r, src_dim=d, dst_dim=j, src_size=ls[d], dst_size=ls[j],
                                 order=order)
    raise AssertionError(f"unknown step kind {kind!r}")


@dataclass(frozen=True)
class Program:
    """A transition ready to run on one rank: bound forward and backward steps, or a fallback.

    Attributes:
        plan: the pure plan (``None`` when falling back).
        forward, backward: bound steps.
        fallback_reason: why DTensor runs this transition, or ``None``.
        global_shape: the global shape given or inferred.
    """

    plan: TransitionPlan | None
    forward: tuple[C.BoundStep, ...]
    backward: tuple[C.BoundStep, ...]
    fallback_reason: str | None = None
    global_shape: tuple[int, ...] | None = None

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        """Run forward; differentiable through :class:`~tplower.collectives.LoweredTransition`."""
        if self.fallback_reason is not None:  # DTensor's own autograd carries the backward
            return self.forward[0](local)
        if local.requires_grad and torch.is_grad_enabled():
            out: torch.Tensor = C.LoweredTransition.apply(local, self)
            return out
        return C.run_steps(local, self.forward)


def _key(spec: Any) -> Hashable:
    if spec is None or isinstance(spec, str):
        return spec
    if isinstance(spec, dict):
        return ("map", tuple(spec.items()))
    return tuple(spec)


def _describe(spec: PlacementsLike, names: Sequence[str]) -> str:
    try:
        return format_placements(parse_placements(spec, names))
    except (TPLowerError, TypeError):
        return repr(spec)


def _check_partials(ps: Sequence[Placement], arg: str) -> None:
    ops = {p.reduce_op for p in ps if isinstance(p, Partial)}
    if len(ops) > 1:
        raise TPLowerError(f"{arg}={format_placements(ps)!r} mixes Partial reduce ops {sorted(ops)}; "
                           "use one reduce op per tensor (as DTensor requires)")


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
        coord = mesh.get_coordinate()
        if coord is None:
            raise TPLowerError(f"mesh={mesh!r}: this rank ({dist.get_rank()}) is not part of the mesh")
        # Held weakly: the module-level map of lowerers must not keep meshes (and, through DTensor's
        # weakref-keyed caches, their stale plans) alive after the caller drops them.
        self._mesh_ref = weakref.ref(mesh)
        self.names: tuple[str, ...] = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(mesh.ndim)))
        self.shape: tuple[int, ...] = tuple(mesh.shape)
        self.coord: tuple[int, ...] = tuple(coord)
        self.groups: tuple[ProcessGroup, ...] = tuple(mesh.get_group(i) for i in range(mesh.ndim))
        self.orders: tuple[tuple[int, ...] | None, ...] = tuple(self._axis_order(i, mesh) for i in range(mesh.ndim))
        self._cache: dict[Hashable, Program] = {}
        self._flat_group: ProcessGroup | None = None
        #: run the debug check on every call (``TPLOWER_DEBUG=1`` when the lowerer was made)
        self.debug: bool = debug_enabled()

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

    def _axis_order(self, axis: int, mesh: DeviceMesh) -> tuple[int, ...] | None:
        index: list[int | slice] = list(self.coord)
        index[axis] = slice(None)
        mesh_ranks = mesh.mesh[tuple(index)].tolist()
        group_ranks = dist.get_process_group_ranks(self.groups[axis])
        if sorted(mesh_ranks) != sorted(group_ranks):
            raise TPLowerError(f"mesh axis {self.names[axis]!r} holds ranks {mesh_ranks} but its process group "
                               f"holds {group_ranks}")
        if mesh_ranks == group_ranks:
            return None
        return tuple(group_ranks.index(r) for r in mesh_ranks)

    def parse(self, spec: PlacementsLike, tensor_ndim: int, arg: str) -> tuple[Placement, ...]:
        """Placements of this mesh from any accepted form, shard dims normalised."""
        return parse_placements(spec, self.names, tensor_ndim=tensor_ndim, arg=arg)

    def program(self, src: PlacementsLike, dst: PlacementsLike, local_shape: Sequence[int], device_type: str, *,
                grad: PlacementsLike | None = None, global_shape: Sequence[int] | None = None) -> Program:
        """The cached program for a transition of a local tensor of ``local_shape`` (see :func:`redistribute_local`)."""
        key = (_key(src), _key(dst), _key(grad), None if global_shape is None else tuple(global_shape),
               tuple(local_shape), device_type)
        prog = self._cache.get(key)
        if prog is None:
            prog = self._build(src, dst, grad, tuple(local_shape), global_shape, device_type)
            self._cache[key] = prog
        return prog

    def _build(self, src_spec: PlacementsLike, dst_spec: PlacementsLike, grad_spec: PlacementsLike | None,
               lshape: tuple[int, ...], global_shape: Sequence[int] | None, device_type: str) -> Program:
        nd = len(lshape)
        src = self.parse(src_spec, nd, "src")
        dst = self.parse(dst_spec, nd, "dst")
        grad = replicate_partials(dst) if grad_spec is None else self.parse(grad_spec, nd, "grad")
        for ps, arg in ((src, "src"), (dst, "dst"), (grad, "grad")):
            _check_partials(ps, arg)
        if global_shape is None:
            gshape = global_shape_from_local(lshape, src, self.shape)
        else:
            gshape = tuple(int(s) for s in global_shape)
            if len(gshape) != nd:
                raise TPLowerError(f"global_shape={gshape} has {len(gshape)} dims but the local tensor has {nd}")
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
                grad: PlacementsLike | None = None, global_shape: Sequence[int] | None = None) -> torch.Tensor:
        """:func:`redistribute_local` after the debug check (:mod:`tplower.agreement`); collective.

        Raises:
            TPLowerError: on every rank alike when the ranks' calls disagree
                or any rank's call is invalid.
        """
        prog, error = None, None
        try:
            prog = self.program(src, dst, local.shape, local.device.type, grad=grad, global_shape=global_shape)
        except (TPLowerError, TypeError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        record = {"rank": dist.get_rank(), "src": _describe(src, self.names), "dst": _describe(dst, self.names),
                  "grad": None if grad is None else _describe(grad, self.names), "dtype": str(local.dtype),
                  "device": local.device.type, "error": error,
                  "global_shape": prog.global_shape if prog is not None else global_shape}
        check_agreement(record, self._debug_group(), local.device)
        assert prog is not None  # check_agreement raised otherwise
        return prog(local)

    def _debug_group(self) -> ProcessGroup | None:
        if self.mesh.mesh.numel() == dist.get_world_size():
            return None
        if self.mesh.ndim == 1:
            return self.groups[0]
        if self._flat_group is None:
            self._flat_group = self.mesh._flatten().get_group()
        return self._flat_group

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


_LOWERERS: weakref.WeakKeyDictionary[DeviceMesh, MeshLowerer] = weakref.WeakKeyDictionary()


def mesh_lowerer(mesh: DeviceMesh) -> MeshLowerer:
    """The :class:`MeshLowerer` of ``mesh`` (one per live mesh object, made on first use)."""
    lowerer = _LOWERERS.get(mesh)
    if lowerer is None or lowerer._mesh_ref() is not mesh:  # an equal but other mesh object
        lowerer = MeshLowerer(mesh)
        _LOWERERS[mesh] = lowerer
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
            ranks compare, all raise alike on a difference; one extra
            ``all_gather_object``); default ``TPLOWER_DEBUG=1``. Must be the
            same on every rank.

    Returns:
        The local tensor of ``dst``: a new tensor, except that an identity
        transition outside autograd returns ``local`` itself.

    Raises:
        TPLowerError: bad placements, a pair with no correct lowering
            (``P(x) -> P(y)``), a ``grad`` that does not fit the output, or a
            ``local`` whose shape does not match ``src`` and ``global_shape``;
            with ``check``, on every rank when any rank's call differs.

    Lowered to direct collectives when :mod:`tplower.transitions` can plan
    it; otherwise (placements other than Shard/Replicate/Partial of
    sum/avg/max/min) DTensor's ``redistribute`` runs it, forward and
    backward. Shards follow mesh coordinates even where an axis's process
    group orders its ranks differently (DTensor gets uneven shards wrong there).
    """
    lowerer = mesh_lowerer(mesh)
    if check or (check is None and lowerer.debug):
        return lowerer.checked(local, src, dst, grad=grad, global_shape=global_shape)
    return lowerer.program(src, dst, local.shape, local.device.type, grad=grad, global_shape=global_shape)(local)
