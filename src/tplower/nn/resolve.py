"""Resolve: a model's modules and a plan into one frozen description per module, changing nothing.

The first of :func:`tplower.parallelize`'s three stages (resolve, place,
install). :func:`resolve_plan` matches the plan to the model's modules (and
parameter keys), reads each module's entry, classifies its boundary, lays out
its parameters, finds where each declared input and output arrives, and runs
every check and refusal (:mod:`tplower.nn.checks`, :mod:`tplower.nn.partners`). The result, a
:class:`ResolvedPlan` of :class:`ModulePlan`\\ s, is everything the later
stages do: no parameter is sharded, no hook installed, no collective issued
(the mesh's lowerer is made, which reads its process groups' ranks).
``tplower explain --plan --model``, the code generator and the verifier read
the same description, so a refusal names a module the same way whichever
command meets it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from ..adapters.lora import redirect_to_base
from ..core.language.placements import format_placement, format_placements
from ..core.lower.redistribute import MeshLowerer, mesh_lowerer
from ..core.support.errors import TPLowerError
from ..core.support.words import closest
from ..plans.entries import BoundaryEntry, PlanValue, ReadValue, match_plan
from ..plans.expert_layout import expert_biases, expert_param_placement
from ..plans.forms import BoundaryForm, classify_boundary_form, deferred_bias_grad
from ..plans.hf import param_key_placement, read_model_plan, shipped_keys
from ..runtime.boundary import REPLACED, InstalledBoundary, _Boundary, _Lookup
from ..runtime.movers import _Move
from ..runtime.params import ParamLayout, check_plain_parameter
from . import checks, moves, partners
from .layouts import deferred_bias, param_layouts

__all__ = ["ModulePlan", "ResolvedPlan", "bind_compute", "resolve_module", "resolve_plan"]

_KINDS: tuple[tuple[type[nn.Module], str], ...] = ((nn.Linear, "linear"), (nn.Embedding, "embedding"))


@dataclasses.dataclass(frozen=True)
class ModulePlan:
    """What the plan does to one module, decided before anything changes.

    Attributes:
        qual: the module's qualified name.
        entry: its entry as resolved (absent optional inputs dropped, expert biases following their weights,
            outputs of uneven parameters marked ``uneven``).
        form: the classified boundary.
        layouts: ``(parameter, layout)`` of every parameter the entry places.
        info: the boundary installed (what :func:`tplower.nn.parallelize.installed_boundary` reports), or
            ``None`` when only parameters and attributes change (an identity boundary).
        ins, outs: the input and output moves (identities left out).
        lookup: a vocabulary-parallel lookup's rows, or ``None``.
        num_experts: the global expert count of an expert-parallel module, or ``None``.
        compute: the plan's ``local_compute`` function (called with the module first), or ``None``.
        local_attrs: ``(attribute, value on this rank)`` pairs.
        tail: ``partial_tail`` features; ``share``: output slots given as this rank's ``1/share_n``.
        region: whether the outputs open (``True``) or close (``False``) a sharded region for dropout.
    """

    qual: str
    entry: BoundaryEntry
    form: BoundaryForm
    layouts: tuple[tuple[str, ParamLayout], ...]
    info: InstalledBoundary | None
    ins: tuple[_Move, ...] = ()
    outs: tuple[_Move, ...] = ()
    lookup: _Lookup | None = None
    num_experts: int | None = None
    compute: Callable[..., Any] | None = None
    local_attrs: tuple[tuple[str, int], ...] = ()
    tail: int = 0
    share: tuple[int, ...] = ()
    share_n: int = 1
    region: bool | None = None

    def lines(self) -> list[str]:
        """``qual: form, mode`` and two-space indented lines: each move's annotation, each parameter sharded or
        with a reduced gradient (``param weight: tp S(0)``, as :func:`tplower.plans.forms.explain_plan_lines`
        writes them), each local attribute."""
        mode = f", {self.info.mode}" if self.info is not None else ""
        out = [f"{self.qual or '(root)'}: {self.form.form}{mode}", *(f"  {a}" for a in self.form.annotations)]
        for n, lay in self.layouts:
            names = tuple(lay.mesh.mesh_dim_names or ())
            moved = [f"{names[i]} {format_placement(p)}" for i, p in enumerate(lay.placements)
                     if not isinstance(p, Replicate)]
            if moved:
                out.append(f"  param {n}: {', '.join(moved)}")
            grads = [f"{names[i]} {format_placement(p)}" for i, p in enumerate(lay.grad or ())
                     if isinstance(p, Partial)]
            if grads:
                out.append(f"  param {n}: grad {', '.join(grads)} ==> backward all_reduce")
        out += [f"  local {attr} = {value}" for attr, value in self.local_attrs]
        return out


@dataclasses.dataclass(frozen=True)
class ResolvedPlan:
    """A plan resolved on a model and a mesh: one :class:`ModulePlan` per planned module, in module order.

    Attributes:
        axis: the tensor-parallel axis; ``experts``: ``"tp"`` or ``"ep"``.
        names, shape: the mesh's axis names and sizes.
        plan: the plan as resolved (``"auto"``/``"derive"`` made explicit), key by key.
        modules: the module plans.
        context: the context-parallel axis (every parameter's gradient summed over it), or ``None``.
    """

    axis: str
    experts: str
    names: tuple[str, ...]
    shape: tuple[int, ...]
    plan: tuple[tuple[str, PlanValue], ...]
    modules: tuple[ModulePlan, ...]
    context: str | None = None

    def __iter__(self) -> Iterator[ModulePlan]:
        return iter(self.modules)

    def __getitem__(self, qual: str) -> ModulePlan:
        for m in self.modules:
            if m.qual == qual:
                return m
        raise KeyError(qual)

    def lines(self) -> list[str]:
        """Every module plan's :meth:`ModulePlan.lines`, in module order."""
        return [line for m in self.modules for line in m.lines()]


def _kind(module: nn.Module) -> str:
    return next((k for t, k in _KINDS if isinstance(module, t)), "other")


def _load_compute(path: str, qual: str) -> Callable[..., Any]:
    mod_name, _, fn_name = path.replace(":", ".").rpartition(".")
    try:
        fn: Callable[..., Any] = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise TPLowerError(f"plan[{qual!r}].local_compute: {path!r} cannot be imported: {exc}") from None
    return fn


def _uneven_outputs(module: nn.Module, entry: BoundaryEntry, form: BoundaryForm,
                    layouts: Mapping[str, ParamLayout], lowerer: MeshLowerer, axis: str) -> BoundaryEntry:
    """``entry`` with its axis-sharded outputs added to ``uneven`` when a parameter's shard dim does not divide.

    A colwise layer of 129 output features on 2 ranks gives pieces of 65 and 64; a move of that output
    (``S(-1) -> R``) then learns the global size from the ranks' sizes, as a declared ``uneven`` output does.
    """
    if axis not in lowerer.names:
        return entry
    uneven = any(isinstance(q, Shard) and (p := module._parameters[name]) is not None
                 and (p.shape[q.dim] // layout.packed) % layout.mesh.size(j)
                 for name, layout in layouts.items() for j, q in enumerate(layout.placements))
    if not uneven:
        return entry
    i = lowerer.names.index(axis)
    add = [o.name for o in form.outputs if isinstance(o.src[i], Shard) and o.name not in entry.uneven]
    return dataclasses.replace(entry, uneven=(*entry.uneven, *add)) if add else entry


def resolve_module(module: nn.Module, qual: str, entry: BoundaryEntry, lowerer: MeshLowerer, axis: str,
                   config: Any = None, summed: tuple[str, ...] = ()) -> ModulePlan:
    """One module's :class:`ModulePlan` (see the module docstring); reads the module, changes nothing.

    Raises:
        TPLowerError: any refusal of :mod:`tplower.nn.checks`, a parameter that is already a DTensor, a bad
            ``local_compute`` path or a bad input or output name.
    """
    entry = moves.without_absent_inputs(entry, module.forward, qual)
    num_experts = checks.global_experts(module, entry, lowerer, axis, qual)
    form = classify_boundary_form(entry, lowerer.names, axes=(axis,), module=qual)
    checks.check_uneven_names(entry, form, qual)
    for name, p in module.named_parameters(recurse=False):
        check_plain_parameter(p, f"module {qual!r}: parameter {name!r}")
    entry, uses = expert_biases(module, entry, form, axis)  # biases follow their expert weights
    bias = deferred_bias(module, entry, form, qual)
    grads: dict[str, Any] = dict(entry.param_grads)
    if bias is not None and bias not in grads:
        grads[bias] = deferred_bias_grad(form)
    layouts = param_layouts(module, entry, grads, lowerer, axis, qual, uses, summed)
    if entry.masked_lookup is None and not isinstance(module, nn.Embedding):  # those inputs are integer ids
        checks.check_partial_input_grads(entry, form, layouts, qual,
                                         {n: p.dim() for n, p in module.named_parameters(recurse=False)})
    entry = _uneven_outputs(module, entry, form, layouts, lowerer, axis)
    local_attrs = checks.local_attr_values(module, entry, lowerer, axis, qual)
    items = tuple(layouts.items())
    if form.form == "identity" and bias is None and not layouts and entry.partial_tail is None and not entry.share:
        return ModulePlan(qual, entry, form, items, None, local_attrs=local_attrs)
    reason = moves.live_reason(lowerer, form) if form.form in ("tp_collective", "region") else None
    mode = "lowered" if form.form in ("tp_collective", "region", "identity") and reason is None else "dtensor"
    fwd = module.forward
    n = lowerer.shape[lowerer.names.index(axis)] if axis in lowerer.names else 1
    return ModulePlan(
        qual, entry, form, items, InstalledBoundary(qual, form, mode, reason, bias),
        moves.input_moves(form.inputs, fwd, qual, entry.uneven), moves.output_moves(form.outputs, entry, qual, layouts),
        moves.lookup(module, entry, layouts, fwd, qual), num_experts,
        _load_compute(entry.local_compute, qual) if entry.local_compute else None, local_attrs,
        checks.tail_size(entry.partial_tail, config, qual) if entry.partial_tail is not None else 0,
        tuple(moves.output_slot(s, entry, qual, "share") for s in entry.share), n,
        moves.opens_region(form, lowerer, axis))


def _with_param(entry: BoundaryEntry, pname: str, value: PlanValue, read: ReadValue, module: nn.Module, axis: str,
                where: str, config: Any) -> BoundaryEntry:
    if not read.bare or read.style is None:
        raise TPLowerError(f"plan[{where!r}]: a key naming a parameter takes an HF style string, not {value!r}")
    p = module._parameters[pname]
    assert p is not None
    # an expert weight or bias: split on the intermediate dim its module's layout declares (tplower.plans.expert_layout)
    expert = expert_param_placement(module, pname, read.style, axis, where.rpartition(".")[0], config)
    place, grad, packed = expert or param_key_placement(read.style, pname, p.ndim, axis, f"plan[{where!r}]")
    return dataclasses.replace(entry, params={**entry.params, pname: place},
                               param_grads={**entry.param_grads, **({pname: grad} if grad else {})},
                               packed={**entry.packed, **({pname: packed} if packed > 1 else {})})


def _check_ties(model: nn.Module, resolved: tuple[ModulePlan, ...]) -> None:
    """A parameter shared by two planned modules (tied weights) must get one placement."""
    modules = dict(model.named_modules())
    seen: dict[int, tuple[ParamLayout, str]] = {}
    for mp in resolved:
        for name, layout in mp.layouts:
            p = modules[mp.qual]._parameters[name]
            first = seen.setdefault(id(p), (layout, mp.qual))
            if (first[0].mesh, first[0].placements) != (layout.mesh, layout.placements):
                raise TPLowerError(f"plan[{mp.qual!r}].params[{name!r}]: a shared parameter gets two placements "
                                   f"(module {first[1]!r} places it {format_placements(first[0].placements)})")


def _made(made: dict[tuple[str, str], BoundaryEntry], read: ReadValue, kind: str, axis: str) -> BoundaryEntry:
    """``read``'s entry for a module of ``kind``, made once per plan key and kind (entries are immutable)."""
    got = made.get((read.key, kind))
    if got is None:
        got = made[(read.key, kind)] = read.entry(kind, axis)
    return got


def resolve_plan(model: nn.Module, mesh: DeviceMesh, plan: Mapping[str, PlanValue] | str | Path | None, *,
                 axis: str = "tp", experts: str = "tp", context: str | None = None,
                 strict: bool = True) -> ResolvedPlan:
    """Resolve ``plan`` on ``model`` and ``mesh``: :class:`ResolvedPlan`, the model left exactly as it was.

    Args:
        model, mesh, plan, axis, experts, context, strict: as :func:`tplower.parallelize` (``plan=None``: no
            module is planned; with ``context``, context parallelism alone).

    Raises:
        TPLowerError: every refusal :func:`tplower.parallelize` makes before it changes the model (a plan
            error naming the module, field and value; with ``strict``, a key naming nothing; a module already
            parallelized; attention split over a tp that does not divide the head counts; a ``context`` axis
            the mesh lacks; ...).
    """
    names_ = tuple(mesh.mesh_dim_names or ())
    if context is not None and context not in names_:
        near = closest(context, names_, fallback="cp")
        raise TPLowerError(f"parallelize: context={context!r} is not an axis of the mesh {names_}{near}; " + (
            "pass the mesh's context-parallel axis by its name" if near else
            f"make the mesh with a {context!r} axis, e.g. init_device_mesh(device, (cp, tp), "
            f"mesh_dim_names=({context!r}, 'tp'))"))
    if context is not None and context == axis:
        raise TPLowerError(f"parallelize: context={context!r} is the tensor-parallel axis too; give the sequence "
                           "its own mesh axis")
    summed = (context,) if context is not None else ()
    if plan is None:
        plan = {}
    tp = mesh.size(names_.index(axis)) if axis in names_ else None
    plan, read = read_model_plan(plan, model, experts=experts, axis=axis, tp=tp)  # every value read once
    lowerer = mesh_lowerer(mesh)
    config = getattr(model, "config", None)
    modules = dict(model.named_modules())
    params = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in modules]
    matched = redirect_to_base(match_plan(plan, [*modules, *params], strict=strict, owner=type(model).__name__,
                                          may_miss=shipped_keys(model)), modules)  # LoRA layers: their base
    made: dict[tuple[str, str], BoundaryEntry] = {}  # one entry per key and module kind
    entries = {qual: _made(made, read[key], _kind(modules[qual]), axis)
               for qual, key in matched.items() if qual in modules}
    for name, key in matched.items():  # keys that name a parameter: place it within its module's entry
        if name not in modules:
            owner, _, pname = name.rpartition(".")
            entries[owner] = _with_param(entries.get(owner, BoundaryEntry()), pname, plan[key], read[key],
                                         modules[owner], axis, name, config)
    checks.check_heads(model, entries, lowerer, axis)
    resolved = []
    for qual in (q for q in modules if q in entries):
        module = modules[qual]
        if isinstance(module.__dict__.get("forward"), _Boundary) or REPLACED in module.__dict__:
            raise TPLowerError(f"module {qual!r} is already parallelized by tplower; parallelize a fresh model")
        resolved.append(resolve_module(module, qual, entries[qual], lowerer, axis, config, summed))
    _check_ties(model, tuple(resolved))
    partners.check_partners(model, {mp.qual: dict(mp.layouts) for mp in resolved},
                            {mp.qual: mp.entry for mp in resolved}, axis)
    return ResolvedPlan(axis, experts, lowerer.names, lowerer.shape, tuple(plan.items()), tuple(resolved), context)


def bind_compute(module: nn.Module, mp: ModulePlan) -> Callable[..., Any]:
    """The local compute a module's boundary runs: the plan's ``local_compute`` bound to it, or its forward."""
    return functools.partial(mp.compute, module) if mp.compute is not None else module.forward

