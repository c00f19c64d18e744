"""The seed-compatible TP lowering surface.

Names and results users of the seed system rely on:
:func:`classify_tp_transition`, :class:`TPExecutionOp`,
:class:`TPCollectiveLowerer` and :func:`create_tp_collective_lowerer`. They
lower one axis (``tp`` by default, any name with ``axis=``) and run on the
same table, planner and collectives as :func:`tplower.redistribute_local`.

Gradient convention (``replicated_grad``): the seed system assumes the
gradient of a replicated output arrives as a partial sum (``"partial"``:
all_gather's backward is reduce_scatter, all_reduce's backward is
all_reduce, Megatron's ``gather_from_sp_region``); DTensor assumes it is
replicated (``"replicate"``: all_gather's backward is a local chunk,
all_reduce's backward is the identity, Megatron's ``reduce_from_tp_region``).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..language.placements import REDUCE_OPS, PlacementsLike, parse_placements
from ..language.transitions import classify_axis, global_shape_from_local, plan_transition
from ..support.argcheck import check_int, check_local_tensor, check_mesh, check_names, describe
from ..support.errors import TPLowerError
from . import collectives as C
from .binding import bind_step
from .cache import CacheInfo, LRUCache
from .program import Program

__all__ = [
    "EXECUTION_KINDS",
    "REPLICATED_GRADS",
    "TPCollectiveLowerer",
    "TPExecutionOp",
    "classify_tp_transition",
    "create_tp_collective_lowerer",
]

log = logging.getLogger("tplower")

#: Kinds a :class:`TPExecutionOp` runs.
EXECUTION_KINDS: tuple[str, ...] = ("all_gather", "all_reduce", "reduce_scatter", "all_reduce_shard", "all_to_all")
#: Values of ``replicated_grad``.
REPLICATED_GRADS: tuple[str, ...] = ("partial", "replicate")
_SEED_KINDS = ("all_gather", "all_reduce", "reduce_scatter")


def _check_str(value: Any, arg: str, func: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{func}: {arg} must be a str, got {describe(value)}")
    return value


def _check_group(value: Any, arg: str, func: str, *, optional: bool = True) -> ProcessGroup | None:
    # None is accepted where only classification runs (no collective); running needs a group.
    if not isinstance(value, ProcessGroup) and not (value is None and optional):
        raise TypeError(f"{func}: {arg} must be a torch.distributed ProcessGroup (e.g. mesh.get_group('tp')), "
                        f"got {describe(value)}")
    return value


def classify_tp_transition(src: PlacementsLike, dst: PlacementsLike, mesh_dim_names: Sequence[str], *,
                           axis: str = "tp") -> dict[str, Any] | None:
    """Classify a whole-mesh transition that changes only the ``axis`` axis.

    Args:
        src, dst: one placement per mesh axis (any form
            :func:`~tplower.parse_placements` accepts).
        mesh_dim_names: the mesh's axis names.
        axis: the axis that may change (``"tp"``).

    Returns:
        ``{"kind": "identity"}`` when ``src == dst``; on ``axis``:
        ``S(d) -> R`` gives ``{"kind": "all_gather", "tensor_dim": d}``,
        ``P(sum) -> R`` gives ``{"kind": "all_reduce", "reduce_op": "sum"}``,
        ``P(sum) -> S(d)`` gives ``{"kind": "reduce_scatter",
        "tensor_dim": d, "reduce_op": "sum"}``. ``None`` when the mesh has no
        such axis, another axis differs, or the pair is none of these.

    Pure: needs no process group.

    Raises:
        TPLowerError: bad placements (see :func:`~tplower.parse_placements`).
        TypeError: ``mesh_dim_names`` is not a sequence of strings, ``axis``
            not a string, or a placement spec of the wrong type.
    """
    names = check_names(mesh_dim_names, "mesh_dim_names", "classify_tp_transition")
    _check_str(axis, "axis", "classify_tp_transition")
    s = parse_placements(src, names, arg="src")
    d = parse_placements(dst, names, arg="dst")
    if s == d:
        return {"kind": "identity"}
    if axis not in names:
        return None
    i = names.index(axis)
    if any(a != b for k, (a, b) in enumerate(zip(s, d, strict=True)) if k != i):
        return None
    try:
        kind, tdim, _, op = classify_axis(s[i], d[i])
    except TPLowerError:
        return None
    if kind not in _SEED_KINDS or (op is not None and op != "sum"):
        return None
    out: dict[str, Any] = {"kind": kind}
    if tdim is not None:
        out["tensor_dim"] = tdim
    if op is not None:
        out["reduce_op"] = op
    return out


@dataclass(frozen=True)
class TPExecutionOp:
    """One differentiable collective on one process group, by kind.

    ==================  ============  ==============  ======================
    kind                forward       local shapes    backward (grad ``P``
                                                      / grad ``R``)
    ==================  ============  ==============  ======================
    all_gather          ``S(d)->R``   ``[s] -> [n*s]``  reduce_scatter / chunk
    all_reduce          ``P->R``      unchanged       all_reduce / identity
    reduce_scatter      ``P->S(d)``   ``[L] -> [piece]``  all_gather
    all_reduce_shard    ``P->S(d)``   as above        all_gather
    all_to_all          ``S(d)->S(j)``  trade pieces  all_to_all ``j -> d``
    ==================  ============  ==============  ======================

    ``all_reduce_shard`` is ``all_reduce`` then this rank's ``torch.chunk``
    piece, for backends without ``reduce_scatter``. ``execute`` assumes
    even shards for ``all_gather``/``all_to_all`` (``n * local`` is the
    global size); ``reduce_scatter`` handles any length (``torch.chunk``
    semantics). For uneven gathers use :func:`tplower.redistribute_local`
    with ``global_shape``.

    Args:
        kind: one of :data:`EXECUTION_KINDS`.
        group: the process group; ``group_size`` ranks, this one at ``group_rank``
            (``None`` only for an op that is never executed: ``execute`` raises).
        tensor_dim: the gathered/scattered dim (negative counts from the end);
            for ``all_to_all`` the dim sharded on input.
        reduce_op: ``sum``, ``avg``, ``max`` or ``min``.
        dst_dim: for ``all_to_all``, the dim sharded on output.
        replicated_grad: ``"partial"`` (seed, default) or ``"replicate"`` (DTensor).
        backend: backend name deciding remaps (default: the group's own,
            judged for each tensor's device).

    Raises:
        ValueError: an unknown kind, reduce op or ``replicated_grad``, a
            missing ``tensor_dim``, or a ``group_rank`` outside the group.
        TypeError: ``group`` not a ``ProcessGroup``, a size, rank or dim
            that is not an int, or a name that is not a string.
    """

    kind: str
    group: ProcessGroup
    group_size: int
    group_rank: int
    tensor_dim: int | None = None
    reduce_op: str = "sum"
    dst_dim: int | None = None
    replicated_grad: str = "partial"
    backend: str | None = None
    _programs: LRUCache[Hashable, Program] = field(default_factory=LRUCache, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        func = "TPExecutionOp"
        for name in ("kind", "reduce_op", "replicated_grad"):
            _check_str(getattr(self, name), name, func)
        if self.backend is not None:
            _check_str(self.backend, "backend", func)
        check_int(self.group_size, "group_size", func)
        check_int(self.group_rank, "group_rank", func)
        check_int(self.tensor_dim, "tensor_dim", func, optional=True)
        check_int(self.dst_dim, "dst_dim", func, optional=True)
        if self.kind not in EXECUTION_KINDS:
            raise ValueError(f"kind={self.kind!r} is not a TP execution kind; allowed: {', '.join(EXECUTION_KINDS)}")
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(f"reduce_op={self.reduce_op!r} is not supported; allowed: {', '.join(REDUCE_OPS)}")
        if self.replicated_grad not in REPLICATED_GRADS:
            raise ValueError(f"replicated_grad={self.replicated_grad!r}; allowed: {', '.join(REPLICATED_GRADS)}")
        if self.kind != "all_reduce" and self.tensor_dim is None:
            raise ValueError(f"kind={self.kind!r} needs tensor_dim")
        if self.kind == "all_to_all" and self.dst_dim is None:
            raise ValueError("kind='all_to_all' needs dst_dim")
        if not 0 <= self.group_rank < self.group_size:
            raise ValueError(f"group_rank={self.group_rank} is outside a group of group_size={self.group_size}")
        _check_group(self.group, "group", func)

    def placements(self, ndim: int) -> tuple[Placement, Placement, Placement]:
        """``(src, dst, grad)`` on the group's axis for a tensor of rank ``ndim``."""
        d = 0 if self.tensor_dim is None else self.tensor_dim % ndim
        j = 0 if self.dst_dim is None else self.dst_dim % ndim
        src: Placement = Partial(self.reduce_op)
        dst: Placement = Replicate()
        if self.kind == "all_gather":
            src = Shard(d)
        elif self.kind == "all_to_all":
            src, dst = Shard(d), Shard(j)
        elif self.kind != "all_reduce":
            dst = Shard(d)
        grad: Placement = dst
        if isinstance(dst, Replicate) and self.replicated_grad == "partial":
            grad = Partial("sum")
        return src, dst, grad

    def execute(self, tensor: torch.Tensor) -> torch.Tensor:
        """Run the collective on ``tensor`` (never modified); differentiable.

        Raises:
            ValueError: ``tensor_dim`` out of range for ``tensor``.
            TypeError: ``tensor`` is not a plain ``torch.Tensor`` (a DTensor:
                pass its ``to_local()``, as :class:`~tplower.TPOperators` does).
        """
        if type(tensor) is not torch.Tensor:  # a Parameter passes; a DTensor, a list or None does not
            check_local_tensor(tensor, "tensor", "TPExecutionOp.execute")
        if self.group is None:
            _check_group(self.group, "group", "TPExecutionOp.execute", optional=False)
        key = (tensor.shape, tensor.device.type)
        prog = self._programs.get(key)
        if prog is None:
            prog = self._build(tuple(tensor.shape), tensor.device.type)
            self._programs.put(key, prog)
        return prog(tensor)

    def cache_info(self) -> CacheInfo:
        """Hits, misses, size, bound and evictions of this op's per-shape program cache
        (:mod:`tplower.core.lower.cache`)."""
        return self._programs.cache_info()

    def _build(self, shape: tuple[int, ...], device_type: str) -> Program:
        nd = len(shape)
        for name, dim in (("tensor_dim", self.tensor_dim), ("dst_dim", self.dst_dim)):
            if dim is not None and not -nd <= dim < nd:
                raise ValueError(f"{name}={dim} is out of range for a {nd}-d tensor of shape {shape}")
        src, dst, grad = self.placements(nd)
        n, r = (self.group_size,), (self.group_rank,)
        plan = plan_transition((src,), (dst,), global_shape_from_local(shape, (src,), n), n, r, (grad,))
        C.check_device(self.backend or str(dist.get_backend(self.group)), device_type)
        backend = C.backend_for_device(self.backend, device_type) if self.backend else C.backend_name_for(
            self.group, device_type)
        caps = C.backend_caps(backend)
        force = self.kind == "all_reduce_shard"
        return Program(plan, tuple(bind_step(s, self.group, caps, force_all_reduce_shard=force) for s in plan.forward),
                       tuple(bind_step(s, self.group, caps) for s in plan.backward))


@dataclass(frozen=True)
class TPCollectiveLowerer:
    """Lowers ``tp``-axis transitions to :class:`TPExecutionOp` on one process group.

    Args:
        mesh_dim_names: the mesh's axis names.
        group, group_size, group_rank: the ``axis`` process group (``None``
            to classify only: its ops cannot execute) and this
            rank's index in it.
        backend: backend name (``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``).
        replicated_grad: ``"partial"`` (seed default) or ``"replicate"``.
        axis: the mesh axis this lowerer owns (default ``"tp"``).

    ``__call__(src, dst)`` returns the op, or ``None`` for identity and for
    anything :func:`classify_tp_transition` does not lower.

    Raises:
        ValueError: an unknown ``replicated_grad``.
        TypeError: ``mesh_dim_names`` not a sequence of strings, ``group``
            not a ``ProcessGroup``, ``group_size``/``group_rank`` not ints,
            ``backend`` or ``axis`` not a string.
    """

    mesh_dim_names: tuple[str, ...]
    group: ProcessGroup
    group_size: int
    group_rank: int
    backend: str
    replicated_grad: str = "partial"
    axis: str = "tp"

    def __post_init__(self) -> None:
        func = "TPCollectiveLowerer"
        object.__setattr__(self, "mesh_dim_names", check_names(self.mesh_dim_names, "mesh_dim_names", func))
        check_int(self.group_size, "group_size", func)
        check_int(self.group_rank, "group_rank", func)
        for name in ("backend", "replicated_grad", "axis"):
            _check_str(getattr(self, name), name, func)
        if self.replicated_grad not in REPLICATED_GRADS:
            raise ValueError(f"replicated_grad={self.replicated_grad!r}; allowed: {', '.join(REPLICATED_GRADS)}")
        _check_group(self.group, "group", func)

    def __call__(self, src: PlacementsLike, dst: PlacementsLike) -> TPExecutionOp | None:
        info = classify_tp_transition(src, dst, self.mesh_dim_names, axis=self.axis)
        if info is None or info["kind"] == "identity":
            return None
        return self.execution_op(info["kind"], info.get("tensor_dim"), info.get("reduce_op", "sum"))

    def execution_op(self, kind: str, tensor_dim: int | None = None, reduce_op: str = "sum", *,
                     dst_dim: int | None = None) -> TPExecutionOp:
        """An op by kind for the bare-operator path, with the same backend remap.

        A single backend without a native ``reduce_scatter`` for
        ``reduce_op`` turns ``reduce_scatter`` into ``all_reduce_shard``; a
        multi-device backend (``cpu:gloo,cuda:nccl``) decides per tensor
        device at execution.

        Raises:
            ValueError: as :class:`TPExecutionOp`.
        """
        if kind == "reduce_scatter" and ":" not in self.backend and \
                reduce_op not in C.backend_caps(self.backend).reduce_scatter_ops:
            kind = "all_reduce_shard"
        return TPExecutionOp(kind, self.group, self.group_size, self.group_rank, tensor_dim, reduce_op,
                             dst_dim=dst_dim, replicated_grad=self.replicated_grad, backend=self.backend)


def create_tp_collective_lowerer(mesh: DeviceMesh, mesh_dim_names: Sequence[str], *,
                                 collective_backend: str | None = None, replicated_grad: str = "partial",
                                 axis: str = "tp") -> TPCollectiveLowerer | None:
    """A :class:`TPCollectiveLowerer` for the ``axis`` sub-mesh of ``mesh``, or ``None``.

    Uses ``mesh`` itself when ``mesh_dim_names == (axis,)``, else
    ``mesh[axis]``. Returns ``None`` when there is no such axis, and ``None``
    with a logged warning when the sub-mesh orders its ranks unlike its
    process group (the caller then uses DTensor). ``collective_backend``
    defaults to the group's backend.

    Raises:
        TypeError: ``mesh`` not a ``DeviceMesh``, ``mesh_dim_names`` not a
            sequence of strings, ``axis`` or ``collective_backend`` not a string.
    """
    func = "create_tp_collective_lowerer"
    check_mesh(mesh, "mesh", func)
    names = check_names(mesh_dim_names, "mesh_dim_names", func)
    _check_str(axis, "axis", func)
    if collective_backend is not None:
        _check_str(collective_backend, "collective_backend", func)
    if axis not in names:
        return None
    sub = mesh if names == (axis,) else mesh[axis]
    group = sub.get_group()
    group_ranks = dist.get_process_group_ranks(group)
    mesh_ranks = sub.mesh.flatten().tolist()
    if mesh_ranks != group_ranks:
        log.warning("tplower: %s sub-mesh orders ranks %s but its process group orders %s; "
                    "not lowering (use the DTensor path)", axis, mesh_ranks, group_ranks)
        return None
    return TPCollectiveLowerer(names, group, sub.size(), group_ranks.index(dist.get_rank()),
                               collective_backend or str(dist.get_backend(group)), replicated_grad, axis)
