"""What ``tplower bench`` measures: transitions, sizes, and one callable per implementation.

Every implementation of a transition is built once per (case, size, mode)
on one rank and returned as a zero-argument callable that runs one call:
``fwd`` (forward, no autograd), ``fwd_grad`` (forward of an input that
requires grad: what a training forward pays) or ``fwd_bwd`` (forward then
backward with a preallocated output gradient, through ``torch.autograd.grad``
to the input, as inside a model: no accumulation into a leaf's ``.grad``,
which would add a copy of the gradient that no implementation asked for).

Implementations:

* ``raw``: the collectives of tplower's own plan, called directly through
  ``torch.distributed`` on preallocated flat buffers (the practical limit:
  same bytes, no allocation, no layout work, no autograd).
* ``tplower``: :func:`tplower.redistribute_local`.
* ``seed_op``: the seed-compatible :class:`tplower.TPExecutionOp`
  (``replicated_grad="replicate"``, the gradient convention of the others).
* ``megatron``: a minimal hand-written ``autograd.Function`` per transition
  around the same raw collective (Megatron's ``mappings.py`` style; it
  allocates its output as Megatron does).
* ``funcol``: ``torch.distributed._functional_collectives`` (differentiable
  variants under grad).
* ``dtensor``: ``DTensor.redistribute`` of a DTensor made beforehand (the
  ``from_local``/``to_local`` wrapping is not counted, in DTensor's favour).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from ..core.language.placements import format_placements, parse_placements, replicate_partials
from ..core.language.transitions import Step, plan_transition
from ..core.lower.lowering import TPExecutionOp
from ..core.lower.redistribute import redistribute_local
from .catalog import CASES, IMPLS, MODES, SIZES, Case
from .megatron import MEGATRON, ReduceFromTP, all_gather_into, reduce_scatter_into

__all__ = ["CASES", "IMPLS", "MODES", "SIZES", "Case", "build", "describe", "dtensor_leaf", "global_shape", "raw_call",
           "setup", "size_label"]

Call = Callable[[], object]

def size_label(nbytes: int) -> str:
    """``1 KiB``, ``64 KiB``, ``4 MiB``, ... for a byte count."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def global_shape(nbytes: int, world: int) -> tuple[int, int]:
    """A 2-D float32 shape of ``nbytes`` whose both dims divide by ``world`` (as square as possible).

    Raises:
        ValueError: ``nbytes`` is not a multiple of ``4 * world * world``.
    """
    elems = nbytes // 4
    if nbytes % 4 or elems % (world * world):
        raise ValueError(f"size {nbytes} bytes does not split into float32 [a, b] with a, b divisible by {world}")
    rows = 1 << (int(math.log2(elems)) // 2) if elems & (elems - 1) == 0 else world
    while elems % rows or rows % world or (elems // rows) % world:
        rows += world
    return rows, elems // rows


@dataclass
class _Setup:
    mesh: DeviceMesh
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    grad: tuple[Placement, ...]
    gshape: tuple[int, ...]
    local: torch.Tensor
    grad_out: torch.Tensor
    fwd: tuple[Step, ...]
    bwd: tuple[Step, ...]


def setup(case: Case, mesh: DeviceMesh, nbytes: int, device: torch.device) -> _Setup:
    """Placements, this rank's input, an output gradient and the plan of ``case`` at ``nbytes``."""
    names = tuple(mesh.mesh_dim_names or ())
    src = parse_placements(case.src, names, tensor_ndim=2, arg="src")
    dst = parse_placements(case.dst, names, tensor_ndim=2, arg="dst")
    grad = replicate_partials(dst)
    gshape = global_shape(nbytes, mesh.size())
    coord = tuple(mesh.get_coordinate() or ())
    plan = plan_transition(src, dst, gshape, tuple(mesh.shape), coord, grad)
    gen = torch.Generator().manual_seed(1234)
    local = torch.randn(plan.in_shape, generator=gen).to(device)
    grad_out = torch.randn(plan.out_shape, generator=gen).to(device)
    return _Setup(mesh, src, dst, grad, gshape, local, grad_out, plan.forward, plan.backward)


def _numel(shape: Sequence[int]) -> int:
    return int(math.prod(shape))


def _raw_step(step: Step, mesh: DeviceMesh, device: torch.device) -> Call:
    """One preallocated collective carrying ``step`` (flat buffers of the same byte counts)."""
    group = mesh.get_group(step.axis)
    a = torch.zeros(_numel(step.in_shape), device=device)
    b = torch.zeros(_numel(step.out_shape), device=device)
    kind = step.kind
    if kind == "all_gather":
        return lambda: all_gather_into(b, a, group=group)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(a, group=group)
    if kind == "reduce_scatter":
        return lambda: reduce_scatter_into(b, a, group=group)
    if kind == "all_to_all":
        return lambda: dist.all_to_all_single(b, a, group=group)
    if kind == "identity":
        return lambda: None
    return lambda: b.copy_(a[:b.numel()])  # chunk / partition / zero_fill: one local copy


def raw_call(steps: Sequence[Step], mesh: DeviceMesh, device: torch.device) -> Call:
    """One call that runs the collectives of ``steps`` on preallocated flat buffers (the practical limit)."""
    calls = [_raw_step(st, mesh, device) for st in steps]

    def run() -> None:
        for f in calls:
            f()
    return run


def _raw(s: _Setup, mode: str, device: torch.device) -> Call:
    return raw_call(s.fwd + (s.bwd if mode == "fwd_bwd" else ()), s.mesh, device)


def _leaf(t: torch.Tensor, mode: str) -> torch.Tensor:
    return t.detach().clone().requires_grad_(mode != "fwd")


def _autograd_call(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, g: torch.Tensor, mode: str) -> Call:
    if mode == "fwd":
        def fwd() -> object:
            with torch.no_grad():
                return fn(x)
        return fwd
    if mode == "fwd_grad":
        return lambda: fn(x)

    def fwd_bwd() -> None:
        torch.autograd.grad(fn(x), x, g)
    return fwd_bwd


def _tplower(s: _Setup, mode: str) -> Call:
    x = _leaf(s.local, mode)
    src, dst, mesh = s.src, s.dst, s.mesh
    return _autograd_call(lambda t: redistribute_local(t, mesh, src, dst), x, s.grad_out, mode)


def _seed_op(case: Case, s: _Setup, mode: str) -> Call | None:
    if case.seed is None or s.mesh.ndim != 1:
        return None
    kind, tdim, ddim = case.seed
    group = s.mesh.get_group()
    op = TPExecutionOp(kind, group, s.mesh.size(), s.mesh.get_local_rank(), tensor_dim=tdim, dst_dim=ddim,
                       replicated_grad="replicate")
    return _autograd_call(op.execute, _leaf(s.local, mode), s.grad_out, mode)


def dtensor_leaf(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement],
                 requires_grad: bool) -> DTensor:
    """A leaf DTensor of ``full`` distributed as ``placements`` (what a DTensor program holds)."""
    dt = distribute_tensor(full, mesh, placements).detach().requires_grad_(requires_grad)
    assert isinstance(dt, DTensor)
    return dt


def _dtensor(s: _Setup, mode: str) -> Call:
    full = torch.zeros(s.gshape, device=s.local.device)
    dt = dtensor_leaf(full, s.mesh, s.src, mode != "fwd")  # same local shape as s.local; values do not matter
    gdt = distribute_tensor(torch.zeros(s.gshape, device=s.local.device), s.mesh, s.grad)
    mesh, dst = s.mesh, s.dst
    if mode == "fwd":
        def fwd() -> object:
            with torch.no_grad():
                return dt.redistribute(mesh, dst)
        return fwd
    if mode == "fwd_grad":
        return lambda: dt.redistribute(mesh, dst)

    def fwd_bwd() -> None:
        torch.autograd.grad(dt.redistribute(mesh, dst), dt, gdt)
    return fwd_bwd


# ---- Megatron-style hand-written autograd Functions (1-D moves) --------------------------------


def _megatron(case: Case, s: _Setup, mode: str) -> Call | None:
    fn_cls = MEGATRON.get((case.src, case.dst))
    if fn_cls is None or s.mesh.ndim != 1:
        return None
    group, n, rank = s.mesh.get_group(), s.mesh.size(), s.mesh.get_local_rank()
    shape = tuple(s.grad_out.shape)
    x = _leaf(s.local, mode)
    if mode == "fwd_bwd" and fn_cls is ReduceFromTP:  # in-place forward needs a non-leaf input
        base = x

        def step(t: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = fn_cls.apply(t * 1.0 if t is base else t, group, n, rank, shape)
            return out
        return _autograd_call(step, x, s.grad_out, mode)
    if mode == "fwd_grad" and fn_cls is ReduceFromTP:
        x = x.detach()  # an in-place collective on a leaf that requires grad is refused
        return lambda: fn_cls.apply(x, group, n, rank, shape)

    def call(t: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = fn_cls.apply(t, group, n, rank, shape)
        return out
    return _autograd_call(call, x, s.grad_out, mode)


# ---- functional collectives ---------------------------------------------------------------------


def _funcol_fn(new: str, old: str) -> Callable[..., torch.Tensor]:
    fn: Callable[..., torch.Tensor] = getattr(funcol, new, None) or getattr(funcol, old)
    return fn


def _funcol(case: Case, s: _Setup, mode: str) -> Call | None:
    if s.mesh.ndim != 1 or (case.src, case.dst) not in MEGATRON:
        return None
    group, n, rank = s.mesh.get_group(), s.mesh.size(), s.mesh.get_local_rank()
    grad = mode != "fwd"
    # torch 2.13 renames *_tensor to *_single and warns on the old names; older releases only have the old ones.
    ag = _funcol_fn("all_gather_single_autograd", "all_gather_tensor_autograd") if grad else \
        _funcol_fn("all_gather_single", "all_gather_tensor")
    rs = _funcol_fn("reduce_scatter_single_autograd", "reduce_scatter_tensor_autograd") if grad else \
        _funcol_fn("reduce_scatter_single", "reduce_scatter_tensor")
    a2a = funcol.all_to_all_single_autograd if grad else funcol.all_to_all_single
    pair, shape = (case.src, case.dst), tuple(s.grad_out.shape)

    def f(t: torch.Tensor) -> torch.Tensor:
        if pair == ("S(0)", "R"):
            out: torch.Tensor = ag(t, 0, group)
        elif pair == ("P(sum)", "R"):
            out = funcol.all_reduce(t, "sum", group)
        elif pair == ("P(sum)", "S(0)"):
            out = rs(t, "sum", 0, group)
        elif pair == ("S(0)", "S(1)"):
            flat: torch.Tensor = funcol.wait_tensor(a2a(t.reshape(-1), None, None, group))
            return flat.view(shape)
        else:
            return t.chunk(n, 0)[rank].contiguous()
        waited: torch.Tensor = funcol.wait_tensor(out)
        return waited
    return _autograd_call(f, _leaf(s.local, mode), s.grad_out, mode)


def build(impl: str, case: Case, s: _Setup, mode: str) -> Call | None:
    """The callable of ``impl`` for ``case`` in ``mode``, or ``None`` when ``impl`` has no such transition.

    Raises:
        ValueError: an unknown ``impl`` or ``mode``.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; allowed: {', '.join(MODES)}")
    if impl == "raw":
        return _raw(s, mode, s.local.device)
    if impl == "tplower":
        return _tplower(s, mode)
    if impl == "seed_op":
        return _seed_op(case, s, mode)
    if impl == "megatron":
        return _megatron(case, s, mode)
    if impl == "funcol":
        return _funcol(case, s, mode)
    if impl == "dtensor":
        return _dtensor(s, mode)
    raise ValueError(f"impl={impl!r}; allowed: {', '.join(IMPLS)}")


def describe(case: Case, s: _Setup) -> str:
    """``S(0)->R: all_gather(dim=0) | bwd chunk`` style summary of the plan."""
    fwd = ", ".join(st.kind for st in s.fwd) or "identity"
    bwd = ", ".join(st.kind for st in s.bwd) or "identity"
    return f"{format_placements(s.src)}->{format_placements(s.dst)}: {fwd} | bwd {bwd}"

