"""Module boundaries: their forms and their annotations.

A boundary is a module's declared inputs and outputs, each a transition
``(src, dst, grad)`` on the mesh (see :mod:`tplower.plans.entries`). Classifying it
is pure, on the same single-axis table the runtime lowers with
(:func:`tplower.core.language.transitions.classify_axis`), so what ``tplower explain``
prints is what runs:

================  ==================================================================
form              when
================  ==================================================================
``region``        the entry has a local-compute injection (``local_compute``, or
                  ``injection="local"``)
``identity``      every transition is identity on the active axes, and no wrapper
                  injection; also any entry when no active axis is in the mesh,
                  unless an ``ep`` placement changes
``tp_collective`` every transition is identity or lowerable: it moves active axes
                  only, by pairs the table lowers
``generic``       anything else (another axis moves, ``P(x) -> P(y)``), or a
                  wrapper injection (``injection="wrapper"``): DTensor runs it
================  ==================================================================

Active axes are the tensor-parallel axes (``axes=("tp",)``) that the mesh has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..core.language.placements import format_placement, parse_placements, replicate_partials
from ..core.language.transitions import classify_axis
from ..core.support.argcheck import check_names, describe
from ..core.support.errors import TPLowerError
from .entries import BoundaryEntry, PlacementSpec, PlanValue, load_plan, resolve_entry, style_kind

__all__ = [
    "FORMS",
    "INJECTIONS",
    "BoundaryForm",
    "BoundaryOp",
    "classify_boundary_form",
    "deferred_bias_grad",
    "explain_plan_lines",
    "parse_spec",
]

#: Boundary forms, from the cheapest to run.
FORMS: tuple[str, ...] = ("identity", "tp_collective", "region", "generic")
#: Values of ``injection``: a local-compute function, or a wrapper that needs DTensors.
INJECTIONS: tuple[str, ...] = ("local", "wrapper")
_EP = "ep"
Placements = tuple[Placement, ...]


@dataclass(frozen=True)
class BoundaryOp:
    """One declared transition of a boundary.

    Attributes:
        name: the input or output name.
        src, dst, grad: one placement per mesh axis (shard dims as written,
            possibly negative); ``grad`` is the gradient arriving at ``dst``.
        forward, backward: what runs, e.g. ``all_gather(dim=1)``,
            ``identity``, or ``dtensor redistribute``.
        lowered: moves only active axes, by pairs the table lowers.
        annotation: one line like ``x: tp S(1) -> R ==> all_gather(dim=1)``,
            or ``None`` for an identity.
    """

    name: str
    src: Placements
    dst: Placements
    grad: Placements
    forward: str
    backward: str
    lowered: bool
    annotation: str | None

    @property
    def identity(self) -> bool:
        """Nothing moves, forward or backward."""
        return self.annotation is None


@dataclass(frozen=True)
class BoundaryForm:
    """The classified boundary of one module entry.

    Attributes:
        form: one of :data:`FORMS`.
        inputs, outputs: one :class:`BoundaryOp` per declared name.
        identity_inputs: names of inputs that pass unchanged.
        names: every declared name, inputs first.
        out_order: the output names in output order (``out_names``, else as declared).
        annotations: one line per non-identity transition.
        mesh_dim_names: the axis names the placements are for.
    """

    form: str
    inputs: tuple[BoundaryOp, ...]
    outputs: tuple[BoundaryOp, ...]
    identity_inputs: tuple[str, ...]
    names: tuple[str, ...]
    out_order: tuple[str, ...]
    annotations: tuple[str, ...]
    mesh_dim_names: tuple[str, ...]


def parse_spec(spec: PlacementSpec, names: Sequence[str], axes: Sequence[str], where: str, *,
               tensor_ndim: int | None = None) -> Placements:
    """Placements of ``spec`` on a mesh with axis ``names``; active-axis names the mesh lacks are dropped.

    ``tensor_ndim``, when given, normalises negative shard dims (as
    :func:`~tplower.parse_placements`).

    Raises:
        TPLowerError: an axis neither in the mesh nor in ``axes``, or a bad placement.
    """
    if isinstance(spec, Mapping):
        spec = {k: v for k, v in spec.items() if k in names or k not in axes}
    return parse_placements(spec, tuple(names), arg=where, tensor_ndim=tensor_ndim)


def op_text(kind: str, tdim: int | None, ddim: int | None, op: str | None) -> str:
    """A collective as text: ``all_gather(dim=1)``, ``all_to_all(dim=0->1)``, ``all_reduce(op=sum)``."""
    args = [f"dim={tdim}->{ddim}"] if kind == "all_to_all" else ([] if tdim is None else [f"dim={tdim}"])
    return f"{kind}({', '.join(args + ([] if op is None else [f'op={op}']))})"


def _moves(a: Placements, b: Placements) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


def _annotation(name: str, names: Sequence[str], src: Placements, dst: Placements, grad: Placements,
                fwd: str, bwd: str, lowered: bool) -> str:
    default = grad == replicate_partials(dst)
    axes = sorted(set(_moves(src, dst)) | set(_moves(grad, replicate_partials(dst))))
    text = f"{name}: " + ", ".join(f"{names[i]} {format_placement(src[i])} -> {format_placement(dst[i])}"
                                   for i in axes)
    if not default:
        text += f" (grad {', '.join(format_placement(grad[i]) for i in axes)})"
    if not lowered:
        return text + " ==> dtensor redistribute"
    return text + f" ==> {fwd}" + ("" if default else f"; backward {bwd}")


def _classify_op(name: str, src: Placements, dst: Placements, grad: Placements, names: Sequence[str],
                 active: Sequence[str], where: str) -> BoundaryOp:
    if replicate_partials(grad) != replicate_partials(dst):
        raise TPLowerError(f"{where}: grad placement {[format_placement(p) for p in grad]} does not fit dst "
                           f"{[format_placement(p) for p in dst]}; it must shard what dst shards (R and P(op) mix)")
    home = replicate_partials(src)
    fmoves, bmoves = _moves(src, dst), _moves(grad, home)
    if not fmoves and not bmoves:
        return BoundaryOp(name, src, dst, grad, "identity", "identity", True, None)
    lowered = all(names[i] in active for i in fmoves + bmoves)
    fwd = bwd = "dtensor redistribute"
    try:
        fwd = "; ".join(op_text(*classify_axis(src[i], dst[i])) for i in fmoves) or "identity"
        bwd = "; ".join(op_text(*classify_axis(grad[i], home[i])) for i in bmoves) or "identity"
    except TPLowerError:
        lowered = False
    if not lowered:
        fwd = bwd = "dtensor redistribute"
    return BoundaryOp(name, src, dst, grad, fwd, bwd, lowered,
                      _annotation(name, names, src, dst, grad, fwd, bwd, lowered))


def _sharded_axes(entry: BoundaryEntry, names: Sequence[str], axes: Sequence[str], module: str) -> set[int]:
    out: set[int] = set()
    for pname, spec in entry.params.items():
        ps = parse_spec(spec, names, axes, f"plan[{module!r}].params[{pname!r}]")
        out |= {i for i, p in enumerate(ps) if isinstance(p, Shard)}
    return out


def _side_ops(entry: BoundaryEntry, side: str, names: Sequence[str], axes: Sequence[str], active: Sequence[str],
              module: str, sharded: set[int]) -> tuple[BoundaryOp, ...]:
    srcs: Mapping[str, PlacementSpec] = getattr(entry, f"{side}_src")
    dsts: Mapping[str, PlacementSpec] = getattr(entry, f"{side}_dst")
    grads: Mapping[str, PlacementSpec] = getattr(entry, f"{side}_grad")
    order = entry.input_names() if side == "in" else entry.output_names()
    ops = []
    for name in order:
        where = f"plan[{module!r}].{side}"
        src_spec, dst_spec = srcs.get(name, dsts.get(name)), dsts.get(name, srcs.get(name))
        if src_spec is None or dst_spec is None:
            raise TPLowerError(f"{where}_grad[{name!r}]: {name!r} has a grad but no {side}_src or {side}_dst")
        src = parse_spec(src_spec, names, axes, f"{where}_src[{name!r}]")
        dst = parse_spec(dst_spec, names, axes, f"{where}_dst[{name!r}]")
        if name in grads:
            grad = parse_spec(grads[name], names, axes, f"{where}_grad[{name!r}]")
        else:  # see tplower.plans.entries: a sharded weight makes a replicated input's gradient partial
            partial_axes = sharded if side == "in" else set()
            grad = tuple(Partial("sum") if i in partial_axes and isinstance(p, Replicate) else p
                         for i, p in enumerate(replicate_partials(dst)))
        ops.append(_classify_op(name, src, dst, grad, names, active, f"{where}_grad[{name!r}]"))
    return tuple(ops)


def classify_boundary_form(entry: BoundaryEntry | PlanValue, mesh_dim_names: Sequence[str],
                           injection: str | None = None, *, axes: Sequence[str] = ("tp",),
                           module: str = "?") -> BoundaryForm:
    """Classify one boundary entry on a mesh with axis names ``mesh_dim_names``; pure.

    Args:
        entry: a :class:`~tplower.plans.entries.BoundaryEntry` or a plan value (an HF
            style string is read as for ``nn.Linear``).
        mesh_dim_names: the mesh's axis names.
        injection: ``None``, ``"local"`` (a local-compute function replaces
            the forward: ``region``) or ``"wrapper"`` (a wrapper needs
            DTensors: ``generic``).
        axes: the tensor-parallel axes; those in the mesh are active.
        module: the module name, for messages.

    Returns:
        The frozen :class:`BoundaryForm`.

    Raises:
        TPLowerError: an unknown axis, a bad placement, or a gradient
            placement that does not fit its ``dst``; the message names the
            module and the field.
        ValueError: ``injection`` not in :data:`INJECTIONS`.
        TypeError: ``mesh_dim_names`` or ``axes`` not a sequence of strings.
    """
    if injection is not None and injection not in INJECTIONS:
        raise ValueError(f"injection={injection!r}; allowed: None, {', '.join(INJECTIONS)}")
    names = check_names(mesh_dim_names, "mesh_dim_names", "classify_boundary_form")
    axes = check_names(axes, "axes", "classify_boundary_form")
    entry = resolve_entry(entry, module, axis=axes[0] if axes else "tp")
    active = [a for a in axes if a in names]
    sharded = _sharded_axes(entry, names, axes, module)
    inputs = _side_ops(entry, "in", names, axes, active, module, sharded)
    outputs = _side_ops(entry, "out", names, axes, active, module, sharded)
    ops = inputs + outputs
    if injection == "wrapper":
        form = "generic"
    elif injection == "local" or entry.local_compute is not None:
        form = "region"
    elif not active:
        ep = names.index(_EP) if _EP in names else None
        moved = ep is not None and any(ep in _moves(o.src, o.dst) + _moves(o.grad, replicate_partials(o.src))
                                       for o in ops)
        form = "generic" if moved else "identity"
    elif all(o.identity for o in ops):
        form = "identity"
    else:
        form = "tp_collective" if all(o.lowered for o in ops) else "generic"
    return BoundaryForm(
        form=form, inputs=inputs, outputs=outputs,
        identity_inputs=tuple(o.name for o in inputs if o.identity),
        names=tuple(o.name for o in ops),
        out_order=entry.out_names if entry.out_names is not None else tuple(o.name for o in outputs),
        annotations=tuple(o.annotation for o in ops if o.annotation is not None),
        mesh_dim_names=names)


def deferred_bias_grad(form: BoundaryForm) -> dict[str, str]:
    """Named placement of a deferred bias's local gradient: ``P(sum)`` on every axis the first output shards.

    A bias added to a shard of the output (``P -> S(1)``, sequence
    parallelism) sees only this rank's rows, so its gradient is partial there.
    """
    if not form.outputs:
        return {}
    dst = form.outputs[0].dst
    return {form.mesh_dim_names[i]: "P(sum)" for i, p in enumerate(dst) if isinstance(p, Shard)}


def explain_plan_lines(plan: Mapping[str, PlanValue] | str | Any, mesh_dim_names: Sequence[str], *,
                       axis: str = "tp") -> list[str]:
    """The annotated forms of a plan, two-space indented under each key.

    ``layers.*.mlp.down_proj: tp_collective`` then
    ``  out: tp P(sum) -> R ==> all_reduce(op=sum)``, and one
    ``  param weight: tp S(1)`` line per parameter that is not replicated.
    HF styles are read as for ``nn.Linear`` (a style only for other modules, ``conv1d_colwise``, as for
    those: :func:`tplower.plans.entries.style_kind`). ``plan`` is a mapping or a
    path to a YAML/JSON plan file.

    Raises:
        TPLowerError: as :func:`tplower.plans.entries.load_plan` and :func:`classify_boundary_form`.
        TypeError: ``mesh_dim_names`` not a sequence of strings, ``axis`` not a string.
    """
    names = check_names(mesh_dim_names, "mesh_dim_names", "explain_plan_lines")
    if not isinstance(axis, str):
        raise TypeError(f"explain_plan_lines: axis must be a str, got {describe(axis)}")
    lines = []
    for key, value in load_plan(plan).items():
        entry = resolve_entry(value, key, axis=axis, kind=style_kind(value))
        form = classify_boundary_form(entry, names, axes=(axis,), module=key)
        lines.append(f"{key}: {form.form}")
        lines.extend(f"  {a}" for a in form.annotations)
        for pname, spec in entry.params.items():
            ps = parse_spec(spec, names, (axis,), f"plan[{key!r}].params[{pname!r}]")
            moved = [f"{names[i]} {format_placement(p)}" for i, p in enumerate(ps) if not isinstance(p, Replicate)]
            if moved:
                lines.append(f"  param {pname}: {', '.join(moved)}")
        for pname, spec in entry.param_grads.items():
            ps = parse_spec(spec, names, (axis,), f"plan[{key!r}].param_grads[{pname!r}]")
            moved = [f"{names[i]} {format_placement(p)}" for i, p in enumerate(ps) if isinstance(p, Partial)]
            if moved:
                lines.append(f"  param {pname}: grad {', '.join(moved)} ==> backward all_reduce")
        if entry.deferred_bias:
            grad = deferred_bias_grad(form)
            tail = f"; grad {', '.join(f'{a} {p}' for a, p in grad.items())} ==> backward all_reduce" if grad else ""
            lines.append(f"  param {entry.deferred_bias}: added once after the output transition{tail}")
        lines.extend(f"  {name}: {axis} 1/n share of a sum ==> divide, forward and backward" for name in entry.share)
    return lines
