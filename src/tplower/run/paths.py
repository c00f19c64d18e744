"""The two tensor-parallel paths a run compares, and how their parameters are gathered back.

* :func:`parallelize_tplower`: tplower's path. Parameters become plain
  local shards; every boundary runs tplower's lowered collectives
  (:func:`tplower.redistribute_local`) and is recorded for the report.
* :func:`parallelize_dtensor`: PyTorch's own ``parallelize_module`` with
  ``ColwiseParallel``/``RowwiseParallel`` on the same plan.

Until ``tplower.parallelize`` exists, :func:`parallelize_tplower` installs
the two styles itself, Megatron's way, with the transitions of DESIGN.md:

==========  ================  =====================  =====================
style       weight shard      input boundary         output boundary
==========  ================  =====================  =====================
colwise     ``S(0)`` (bias    ``R -> R``, grad ``P``:  local ``S(-1)``
            ``S(0)``)         identity / all_reduce
rowwise     ``S(1)`` (bias    local ``S(-1)``        ``P -> R``, grad ``R``:
            ``R``, added                             all_reduce / identity
            after the sum)
==========  ================  =====================  =====================
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..models import localize_heads
from ..placements import format_placements
from ..redistribute import mesh_lowerer
from .config import STYLES, RunError

__all__ = [
    "BoundaryLog",
    "BoundaryRecord",
    "RowwiseLinear",
    "gather_params",
    "parallelize_dtensor",
    "parallelize_tplower",
    "shard_dims",
]

# torch 2.13 warns on the old name; older releases only have it.
_all_gather_base = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: style -> (weight dim sharded, bias dim sharded or None)
_SHARD_DIMS: dict[str, tuple[int, int | None]] = {"colwise": (0, 0), "rowwise": (1, None)}


@dataclass
class BoundaryRecord:
    """One module boundary as it ran: placements on the tp axis, ops and bytes of one call.

    ``fwd_bytes``/``bwd_bytes`` are bytes this rank sends in one forward /
    backward call at the shape of the first call (``shape``).
    """

    module: str
    pattern: str
    style: str
    side: str
    form: str
    forward: str
    backward: str
    fwd_bytes: int
    bwd_bytes: int
    shape: tuple[int, ...]


@dataclass
class BoundaryLog:
    """Every boundary tplower installed, filled in on each boundary's first call."""

    records: dict[tuple[str, str], BoundaryRecord] = field(default_factory=dict)

    def rows(self) -> list[BoundaryRecord]:
        """Records in call order."""
        return list(self.records.values())


def _modules_matching(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    parts = pattern.split(".")
    return [(name, m) for name, m in model.named_modules()
            if len(name.split(".")) == len(parts)
            and all(fnmatch.fnmatchcase(a, b) for a, b in zip(name.split("."), parts, strict=True))]


def _matches(plan: Mapping[str, str], model: nn.Module) -> list[tuple[str, str, str, nn.Linear]]:
    out: list[tuple[str, str, str, nn.Linear]] = []
    for pattern, style in plan.items():
        if style not in STYLES:
            raise RunError(f"plan entry {pattern!r}: style {style!r} is not run here; allowed: {', '.join(STYLES)}")
        for name, module in _modules_matching(model, pattern):
            if not isinstance(module, nn.Linear):
                raise RunError(f"plan entry {pattern!r} -> {name} is a {type(module).__name__}; "
                               f"{style} applies to nn.Linear modules")
            out.append((pattern, style, name, module))
    return out


def _shard(p: torch.Tensor, dim: int, n: int, rank: int) -> nn.Parameter:
    return nn.Parameter(p.detach().chunk(n, dim)[rank].clone(), requires_grad=p.requires_grad)


class _Boundary:
    """Runs one lowered transition on the tp axis and records it on first call."""

    def __init__(self, mesh: DeviceMesh, axis: str, log: BoundaryLog, key: tuple[str, str], pattern: str,
                 style: str, src: str, dst: str, grad: str) -> None:
        self.lowerer = mesh_lowerer(mesh)
        self.axis, self.log, self.key, self.pattern, self.style = axis, log, key, pattern, style
        self.src, self.dst, self.grad = {axis: src}, {axis: dst}, {axis: grad}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        prog = self.lowerer.program(self.src, self.dst, x.shape, x.device.type, grad=self.grad)
        if self.key not in self.log.records and prog.plan is not None:
            plan, size = prog.plan, x.element_size()
            i = self.lowerer.names.index(self.axis)
            self.log.records[self.key] = BoundaryRecord(
                module=self.key[0], pattern=self.pattern, style=self.style, side=self.key[1],
                form=f"{format_placements(plan.src[i:i + 1])}->{format_placements(plan.dst[i:i + 1])} "
                     f"grad {format_placements(plan.grad[i:i + 1])}",
                forward="; ".join(s.op_str() for s in plan.forward) or "identity",
                backward="; ".join(s.op_str() for s in plan.backward) or "identity",
                fwd_bytes=sum(s.send_elems for s in plan.forward) * size,
                bwd_bytes=sum(s.send_elems for s in plan.backward) * size, shape=tuple(x.shape))
        return prog(x)


def _colwise_pre_hook(boundary: _Boundary) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (boundary(args[0]), *args[1:])
    return hook


class RowwiseLinear(nn.Module):
    """A row-parallel ``nn.Linear``: ``y = all_reduce(x_shard @ W_shard.T) + b``, the bias added once, after the sum.

    Keeps the replaced module's ``weight`` (this rank's ``S(1)`` shard) and
    ``bias`` (whole) under the same names.
    """

    def __init__(self, linear: nn.Linear, boundary: _Boundary) -> None:
        super().__init__()
        self.weight, self.bias, self.boundary = linear.weight, linear.bias, boundary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in / tp]`` -> ``[..., out]``, replicated."""
        y = self.boundary(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def parallelize_tplower(model: nn.Module, mesh: DeviceMesh, plan: Mapping[str, str], *,
                        axis: str = "tp") -> BoundaryLog:
    """Shard ``model`` in place on ``mesh``'s ``axis`` per ``plan``; boundaries run tplower's collectives.

    Args:
        model: the unsharded model (parameters are replaced by this rank's shards).
        mesh: the device mesh; ``axis`` is the tensor-parallel axis.
        plan: module name/glob -> ``"colwise"`` or ``"rowwise"`` (nn.Linear only).

    Returns:
        A :class:`BoundaryLog` that fills in as boundaries first run.

    Raises:
        RunError: a style other than colwise/rowwise, a non-Linear module,
            or a size the ``axis`` does not divide.
    """
    names = tuple(mesh.mesh_dim_names or ())
    if axis not in names:
        raise RunError(f"axis={axis!r} is not a mesh axis; the mesh has {names}")
    n, rank = mesh.size(names.index(axis)), mesh.get_local_rank(axis)
    log = BoundaryLog()
    for pattern, style, name, module in _matches(plan, model):
        wdim, bdim = _SHARD_DIMS[style]
        if module.weight.shape[wdim] % n:
            raise RunError(f"{name}: {style} shards dim {wdim} of size {module.weight.shape[wdim]}, which "
                           f"tp={n} does not divide; choose a tp that divides it")
        module.weight = _shard(module.weight, wdim, n, rank)
        if module.bias is not None and bdim is not None:
            module.bias = _shard(module.bias, bdim, n, rank)
        if style == "colwise":
            b = _Boundary(mesh, axis, log, (name, "input"), pattern, style, "R", "R", "P(sum)")
            module.register_forward_pre_hook(_colwise_pre_hook(b))
        else:
            b = _Boundary(mesh, axis, log, (name, "output"), pattern, style, "P(sum)", "R", "R")
            model.set_submodule(name, RowwiseLinear(module, b))
    localize_heads(model, n)
    return log


def parallelize_dtensor(model: nn.Module, mesh: DeviceMesh, plan: Mapping[str, str], *, axis: str = "tp") -> None:
    """PyTorch's ``parallelize_module`` on ``mesh[axis]`` with Colwise/RowwiseParallel per ``plan`` (in place).

    Raises:
        RunError: a style other than colwise/rowwise.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    bad = {k: v for k, v in plan.items() if v not in styles}
    if bad:
        raise RunError(f"plan entries {bad} have no DTensor style here; allowed: {', '.join(styles)}")
    parallelize_module(model, mesh[axis], {k: styles[v]() for k, v in plan.items()})
    localize_heads(model, mesh[axis].size())


def shard_dims(model: nn.Module, plan: Mapping[str, str]) -> dict[str, int]:
    """Parameter name -> the dim ``plan`` shards it on (parameters left out are replicated)."""
    out: dict[str, int] = {}
    for pattern, style in plan.items():
        wdim, bdim = _SHARD_DIMS[style]
        for name, module in _modules_matching(model, pattern):
            out[f"{name}.weight"] = wdim
            if getattr(module, "bias", None) is not None and bdim is not None:
                out[f"{name}.bias"] = bdim
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
