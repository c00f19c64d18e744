"""The two tensor-parallel paths a run compares, and how their parameters are gathered back.

* :func:`parallelize_tplower`: :func:`tplower.nn.parallelize.parallelize`.
  Parameters become plain local shards; every boundary runs tplower's
  lowered collectives. Each installed boundary is recorded on its first
  call (local shapes, so the bytes it sends are known) for the report.
* :func:`parallelize_dtensor`: PyTorch's own ``parallelize_module`` with
  ``ColwiseParallel``/``RowwiseParallel`` on the same plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..core.language.placements import format_placement
from ..core.language.transitions import global_shape_from_local, plan_transition
from ..core.lower.redistribute import MeshLowerer, mesh_lowerer
from ..core.support.errors import TPLowerError
from ..nn.parallelize import installed_boundary, parallelize
from ..plans.entries import PlanValue, match_plan, resolve_entry
from ..plans.forms import BoundaryOp, parse_spec
from ..runtime.boundary import REPLACED, _Boundary
from .config import DTENSOR_STYLES, RunError
from .models import localize_heads

__all__ = ["BoundaryLog", "BoundaryRecord", "gather_params", "parallelize_dtensor", "parallelize_tplower",
           "shard_dims"]

# torch 2.13 warns on the old name; older releases only have it.
_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class BoundaryRecord:
    """One transition of an installed boundary as it ran first: placements on the tp axis, ops, bytes.

    ``fwd_bytes``/``bwd_bytes`` are bytes this rank sends in that forward /
    backward call, at the local shape ``shape`` the transition met
    (``-1`` when the tensor could not be found in the call). ``shared_with``:
    the sibling whose move of the same tensor this input takes
    (:mod:`tplower.runtime.fanout`); its bytes are then 0, counted once there.
    """

    module: str
    pattern: str
    form: str
    side: str
    transition: str
    forward: str
    backward: str
    fwd_bytes: int
    bwd_bytes: int
    shape: tuple[int, ...]
    shared_with: str | None = None


@dataclass
class BoundaryLog:
    """Every boundary tplower installed, filled in on each boundary's first call."""

    records: dict[tuple[str, str], BoundaryRecord] = field(default_factory=dict)
    #: each shared move's group key (:mod:`tplower.runtime.fanout`) and the module that made it first
    movers: dict[str, str] = field(default_factory=dict)

    def rows(self) -> list[BoundaryRecord]:
        """Records in call order."""
        return list(self.records.values())


def _tensor_of(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], output: Any, side: str) -> Any:
    if side == "out":
        items = list(output) if isinstance(output, tuple | list) else [output]
        i = 0 if name == "out" else int(name) if name.isdigit() else -1
        return items[i] if 0 <= i < len(items) else None
    if name.isdigit():
        i = int(name)
        return args[i] if i < len(args) else (next(iter(kwargs.values()), None) if i == 0 and not args else None)
    return kwargs.get(name)


def _bytes(op: BoundaryOp, t: torch.Tensor, side: str, lowerer: MeshLowerer) -> tuple[int, int]:
    """Bytes this rank sends for ``op`` on local tensor ``t`` (an input as it arrives, an output as it leaves)."""
    nd = t.ndim
    src, dst, grad = (lowerer.parse(p, nd, "placement") for p in (op.src, op.dst, op.grad))
    gshape = global_shape_from_local(tuple(t.shape), src if side == "in" else dst, lowerer.shape)
    plan = plan_transition(src, dst, gshape, lowerer.shape, lowerer.coord, grad)
    size = t.element_size()
    return (sum(s.send_elems for s in plan.forward) * size, sum(s.send_elems for s in plan.backward) * size)


class _Recorder:
    """A forward hook that records a boundary's transitions on its first call."""

    def __init__(self, log: BoundaryLog, lowerer: MeshLowerer, axis: str, qual: str, pattern: str) -> None:
        self.log, self.lowerer, self.qual, self.pattern = log, lowerer, qual, pattern
        self.axis = lowerer.names.index(axis) if axis in lowerer.names else 0
        self.handle: Any = None

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        info = installed_boundary(module)
        if info is None:
            return
        boundary = module.__dict__.get("forward")
        boundary = boundary if isinstance(boundary, _Boundary) else module.__dict__.get(REPLACED)
        fans = dict(zip((mv.name for mv in boundary.ins), boundary.fan, strict=True)) \
            if isinstance(boundary, _Boundary) else {}
        i = self.axis
        for side, ops in (("in", info.form.inputs), ("out", info.form.outputs)):
            for op in ops:
                if op.identity:
                    continue
                t = _tensor_of(op.name, args, kwargs, output, side)
                where = {"in": "input", "out": "output"}[side] + ("" if op.name in ("0", "out") else f" {op.name}")
                fb = _bytes(op, t, side, self.lowerer) if isinstance(t, torch.Tensor) else (-1, -1)
                fan = fans.get(op.name) if side == "in" else None
                first = self.log.movers.setdefault(fan, self.qual) if fan is not None else self.qual
                shared = first if first != self.qual else None
                if shared is not None:
                    fb = (0, 0)
                self.log.records.setdefault((self.qual, where), BoundaryRecord(
                    module=self.qual, pattern=self.pattern, form=info.form.form, side=where,
                    transition=f"{format_placement(op.src[i])}->{format_placement(op.dst[i])} "
                               f"grad {format_placement(op.grad[i])}",
                    forward=op.forward, backward=op.backward, fwd_bytes=fb[0], bwd_bytes=fb[1],
                    shape=tuple(t.shape) if isinstance(t, torch.Tensor) else (), shared_with=shared))
        self.handle.remove()


def parallelize_tplower(model: nn.Module, mesh: DeviceMesh, plan: Mapping[str, PlanValue], *,
                        axis: str = "tp", codegen: str | None = None) -> BoundaryLog:
    """:func:`tplower.nn.parallelize.parallelize` ``model`` in place on ``mesh`` by ``plan``; record its boundaries.

    With ``codegen`` (a file path) the model runs generated forwards in
    place of the hooks (:func:`tplower.codegen.install`): those of the file
    when it exists (edited or not; install refuses one emitted for another
    model, plan or mesh), else freshly emitted ones (:func:`tplower.codegen.emit`,
    the same text on every rank), which rank 0 writes there.

    Returns:
        A :class:`BoundaryLog` that fills in as each boundary first runs.

    Raises:
        RunError: anything :func:`~tplower.nn.parallelize.parallelize` rejects
            (its message names the module, field and value).
    """
    try:
        if codegen is None:
            parallelize(model, mesh, plan, axis=axis)
        else:
            from ..codegen.emit import emit, install

            if Path(codegen).is_file():
                source = Path(codegen).read_text()
            else:
                source = emit(model, mesh, plan, axis=axis)
                dist.barrier()  # every rank has looked for the file before rank 0 writes it
                if dist.get_rank() == 0:
                    Path(codegen).write_text(source)
            install(model, mesh, source)
        keys = match_plan(plan, [n for n, _ in model.named_modules()])
    except TPLowerError as exc:
        raise RunError(str(exc)) from None
    log = BoundaryLog()
    lowerer = mesh_lowerer(mesh)
    for qual, module in model.named_modules():
        if installed_boundary(module) is not None:
            rec = _Recorder(log, lowerer, axis, qual, keys.get(qual, qual))
            rec.handle = module.register_forward_hook(rec, with_kwargs=True)
    return log


def parallelize_dtensor(model: nn.Module, mesh: DeviceMesh, plan: Mapping[str, PlanValue], *,
                        axis: str = "tp") -> None:
    """PyTorch's ``parallelize_module`` on ``mesh[axis]`` with Colwise/RowwiseParallel per ``plan`` (in place).

    Entries that only make attributes local (``{"local_attrs": ...}``) are
    left to :func:`tplower.run.models.localize_heads`.

    Raises:
        RunError: an entry other than ``"colwise"``/``"rowwise"`` or ``local_attrs``.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles: dict[str, Any] = dict(zip(DTENSOR_STYLES, (
        ColwiseParallel, RowwiseParallel, lambda: ColwiseParallel(output_layouts=Replicate()),
        lambda: RowwiseParallel(input_layouts=Replicate())), strict=True))
    dt_plan: dict[str, Any] = {}
    for key, value in plan.items():
        if isinstance(value, str) and value in styles:
            dt_plan[key] = styles[value]()
        elif not (isinstance(value, Mapping) and set(value) == {"local_attrs"}):
            raise RunError(f"plan entry {key!r}: {value!r} has no DTensor counterpart for the comparison; "
                           f"tplower run compares plans of {', '.join(styles)} (and local_attrs) entries")
    parallelize_module(model, mesh[axis], dt_plan)
    localize_heads(model, mesh[axis].size())


def shard_dims(model: nn.Module, plan: Mapping[str, PlanValue], mesh: DeviceMesh, *,
               axis: str = "tp") -> dict[str, int]:
    """Parameter name -> the tensor dim ``plan`` shards it on along ``axis`` (others are replicated there).

    Read from the plan's own entries (:func:`tplower.plans.entries.resolve_entry`),
    so a gather does not trust the sharded model's state.
    """
    names = tuple(mesh.mesh_dim_names or ())
    i = names.index(axis)
    modules = dict(model.named_modules())
    out: dict[str, int] = {}
    for qual, key in match_plan(plan, modules).items():
        kind = "linear" if isinstance(modules[qual], nn.Linear) else \
            "embedding" if isinstance(modules[qual], nn.Embedding) else "other"
        entry = resolve_entry(plan[key], key, kind=kind, axis=axis)
        own = dict(modules[qual].named_parameters(recurse=False))
        for pname, spec in entry.params.items():
            for target in (own if pname == "*" else [pname] if pname in own else []):
                p = own[target]
                ps = parse_spec(spec, names, (axis,), f"plan[{key!r}].params[{pname!r}]", tensor_ndim=p.ndim)
                q = ps[i]
                if isinstance(q, Shard):
                    out[f"{qual}.{target}"] = q.dim
    return out


def gather_params(model: nn.Module, dims: Mapping[str, int], mesh: DeviceMesh, *,
                  axis: str = "tp") -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` whole, on every rank (a collective: call it on all ranks).

    DTensor parameters give ``full_tensor()``; a plain local shard named in
    ``dims`` is all-gathered along its dim over ``axis``; anything else is
    already whole. Returns detached CPU tensors.
    """
    group = mesh.get_group(axis)
    n = dist.get_world_size(group)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if isinstance(p, DTensor):
                full = p.full_tensor()
            elif name in dims and n > 1:
                d = dims[name]
                local = p.detach().movedim(d, 0).contiguous()
                buf = local.new_empty((n * local.shape[0], *local.shape[1:]))
                _all_gather_base(buf, local, group=group)
                full = buf.movedim(0, d)
            else:
                full = p.detach()
            out[name] = full.cpu().clone()
    return out
