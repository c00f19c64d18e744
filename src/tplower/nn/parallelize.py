"""Install a plan on an ``nn.Module``: shard parameters in place, lower each boundary once.

:func:`parallelize` walks the model's modules, finds each one's plan entry
(:func:`tplower.nn.plans.match_plan`), classifies its boundary
(:func:`tplower.nn.boundaries.classify_boundary_form`) and then, per module:

* replaces every declared parameter by an ``nn.Parameter`` holding a
  DTensor of the plan's placements (``torch.chunk`` pieces in mesh-axis
  order, as DTensor; no full copy stays), see :mod:`tplower.nn.params`;
* divides ``local_attrs`` (local head counts of attention);
* replaces ``forward`` on the instance (never the class or its source) with
  a boundary that takes the parameters' local tensors (with the reduction a
  partial parameter gradient needs in backward), moves the declared inputs,
  runs the local compute, moves the declared outputs and adds a deferred
  bias.

Attention head counts: with colwise q/k/v each rank holds ``heads / tp``
heads. A module that reshapes by a stored head count needs its entry to
make it local, e.g. ``local_attrs: {num_attention_heads: divide,
all_head_size: divide}`` on ``encoder.layer.*.attention.self`` for BERT of
older transformers releases (its ``transpose_for_scores``); Llama and BERT
of recent releases (checked on 5.24) reshape with ``-1`` heads and need none.

Activations' sharded dims must divide evenly over their axes (the global
shape is inferred as ``n * local``), unless the entry names the input or
output in ``uneven``: then the ranks exchange their local sizes each call
(:mod:`tplower.nn.uneven`) and the shards follow ``torch.chunk``. Under the debug
check (``TPLOWER_DEBUG=1``) a lowered boundary runs
:meth:`~tplower.MeshLowerer.checked`, so undeclared uneven sizes raise the same
error on every rank naming the module, the input or output and the dim.
Every sharded parameter dim must divide evenly.

Run modes: a ``tp_collective`` or ``region`` boundary runs the bound
programs of :class:`tplower.MeshLowerer` (direct collectives, no DTensor);
a ``generic`` one runs DTensor's ``redistribute``. Install re-validates a
lowerable boundary against the live mesh: every axis the plan names must be
in it (else :class:`~tplower.TPLowerError`), and each moved axis must run on
a backend tplower knows; where it does not, the boundary runs generic and a
warning names the module and the reason. An axis whose process group orders
its ranks unlike the mesh is lowered too: the lowerer puts pieces in
mesh-coordinate order (DTensor there is wrong for uneven shards).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from ..core import collectives as C
from ..core.argcheck import check_mesh
from ..core.errors import TPLowerError
from ..core.placements import replicate_partials
from ..core.redistribute import MeshLowerer, mesh_lowerer
from ..core.transitions import chunk_size_and_offset
from .boundaries import (
    BoundaryForm,
    BoundaryOp,
    classify_boundary_form,
    deferred_bias_grad,
)
from .boundary_runtime import REPLACED, InstalledBoundary, _Boundary, _Lookup, _Move, installed_boundary
from .coverage import COVER_MODES, install_coverage
from .derive import derive_plan
from .dropout import install_dropout_streams
from .expert_layout import expert_biases, expert_param_placement
from .experts import ExpertDispatch
from .fanout import link_fanouts
from .full_state import patch_save_pretrained, register_full_load
from .heads import config_head_counts
from .hf_plans import param_key_placement, resolve_model_plan
from .install_params import _deferred_bias, _localize_attrs, _param_layouts, _shard_params
from .lora import is_lora_layer, place_lora_layer, redirect_to_base, watch_registrations
from .params import ParamLayout, check_plain_parameter
from .plans import BoundaryEntry, PlanValue, match_plan, resolve_entry
from .rest_params import place_rest

__all__ = ["InstalledBoundary", "installed_boundary", "parallelize"]

_KINDS: tuple[tuple[type[nn.Module], str], ...] = ((nn.Linear, "linear"), (nn.Embedding, "embedding"))


def _kind(module: nn.Module) -> str:
    return next((k for t, k in _KINDS if isinstance(module, t)), "other")


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
               inspect.Parameter.VAR_POSITIONAL)
_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _input_slot(name: str, fwd: Callable[..., Any], where: str) -> tuple[int, str | None]:
    """Where input ``name`` (a ``forward`` parameter name or a position) arrives: (position or -1, keyword)."""
    sig = list(inspect.signature(fwd).parameters.values())
    named = [p for p in sig if p.kind != p.VAR_KEYWORD]
    if name.isdigit():
        p = named[int(name)] if int(name) < len(named) else None
    else:
        p = next((q for q in named if q.name == name), None)
    if p is None and (name.isdigit() or len(named) == len(sig)):  # no **kwargs to catch the name
        raise TPLowerError(f"{where}: forward has no input {name!r}; it has {[q.name for q in named]} "
                           "(or positions '0', '1', ...)")
    pos = named.index(p) if p is not None and p.kind in _POSITIONAL else -1
    return pos, name if p is None else (p.name if p.kind in _KEYWORD else None)


def _without_absent_inputs(entry: BoundaryEntry, fwd: Callable[..., Any], qual: str) -> BoundaryEntry:
    """``entry`` less the ``optional_inputs`` that ``fwd`` does not take."""
    absent = set()
    for name in entry.optional_inputs:
        try:
            _input_slot(name, fwd, qual)
        except TPLowerError:
            absent.add(name)
    if not absent:
        return entry

    def keep(m: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in m.items() if k not in absent}

    return dataclasses.replace(entry, in_src=keep(entry.in_src), in_dst=keep(entry.in_dst),
                               in_grad=keep(entry.in_grad))


def _opens_region(form: BoundaryForm, lowerer: MeshLowerer, axis: str) -> bool | None:
    """Whether the boundary's outputs stay sharded along ``axis`` (``True``), end whole or partial (``False``), or
    are not declared (``None``): where dropout enters or leaves a sharded region (:mod:`tplower.nn.dropout`)."""
    if not form.outputs or axis not in lowerer.names:
        return None
    i = lowerer.names.index(axis)
    return any(i < len(op.dst) and isinstance(op.dst[i], Shard) for op in form.outputs)


def _sized_axes(op: BoundaryOp, uneven: tuple[str, ...], known: frozenset[int] = frozenset()) -> tuple[int, ...]:
    """The mesh axes along which ``op``'s source shards a dim it moves, when nothing says that dim's global size.

    Not for a name declared ``uneven`` (exchanged anyway), nor along ``known``
    axes (an output dim a sharded parameter of the module sizes). A sequence
    entering ``S(1) -> R`` is the case: :func:`tplower.nn.uneven.agreed_global_shape`
    then learns or checks its size each call instead of assuming it divides.
    """
    if op.name in uneven:
        return ()
    return tuple(i for i, p in enumerate(op.src) if isinstance(p, Shard) and p != op.dst[i] and i not in known)


def _input_moves(ops: tuple[BoundaryOp, ...], fwd: Callable[..., Any], module: str,
                 uneven: tuple[str, ...] = ()) -> tuple[_Move, ...]:
    return tuple(_Move(*_input_slot(op.name, fwd, f"plan[{module!r}].in"), op.name, op.src, op.dst, op.grad,
                       f"module {module!r}, input {op.name!r}", op.name in uneven, _sized_axes(op, uneven))
                 for op in ops if not op.identity)


def _lookup(module: nn.Module, entry: BoundaryEntry, layouts: Mapping[str, ParamLayout], fwd: Callable[..., Any],
            qual: str) -> _Lookup | None:
    if entry.masked_lookup is None:
        return None
    where = f"plan[{qual!r}].masked_lookup"
    layout = layouts.get("weight")
    sharded = [i for i, q in enumerate(layout.placements) if isinstance(q, Shard)] if layout else []
    if layout is None or len(sharded) != 1 or layout.placements[sharded[0]] != Shard(0):
        raise TPLowerError(f"{where}: needs a 'weight' parameter sharded S(0) on one axis (its rows)")
    p = module._parameters["weight"]
    assert p is not None
    n, c = layout.mesh.size(sharded[0]), layout.mesh.get_coordinate()
    assert c is not None
    rows, offset = chunk_size_and_offset(p.shape[0], n, c[sharded[0]])  # torch.chunk rows: uneven when V % n
    pad = getattr(module, "padding_idx", None)
    local_pad = pad - offset if isinstance(pad, int) and 0 <= pad - offset < rows else None
    return _Lookup(*_input_slot(entry.masked_lookup, fwd, where), offset, rows, local_pad)


def _output_moves(ops: tuple[BoundaryOp, ...], entry: BoundaryEntry, module: str,
                  layouts: Mapping[str, ParamLayout]) -> tuple[_Move, ...]:
    # an output sharded along an axis that shards a parameter is sized by that parameter (colwise features)
    known = frozenset(j for layout in layouts.values() for j, q in enumerate(layout.placements) if isinstance(q, Shard))
    moves = []
    for op in ops:
        if op.identity:
            continue
        moves.append(_Move(_output_slot(op.name, entry, module, "out"), None, op.name, op.src, op.dst, op.grad,
                           f"module {module!r}, output {op.name!r}", op.name in entry.uneven,
                           _sized_axes(op, entry.uneven, known)))
    return tuple(moves)


def _output_slot(name: str, entry: BoundaryEntry, module: str, field: str) -> int:
    """The position of output ``name`` (``out``, a position, or one of ``out_names``) in what forward returns."""
    if name == "out" or name.isdigit():
        return 0 if name == "out" else int(name)
    if entry.out_names is not None and name in entry.out_names:
        return entry.out_names.index(name)
    raise TPLowerError(f"plan[{module!r}].{field}: output {name!r} is not 'out', a position or one of "
                       f"out_names={entry.out_names}")


def _live_reason(lowerer: MeshLowerer, form: BoundaryForm) -> str | None:
    for op in form.inputs + form.outputs:
        for i in sorted(set(_axes_moved(op))):
            backend = C.backend_for_device(str(dist.get_backend(lowerer.groups[i])), lowerer.mesh.device_type)
            if not C.backend_caps(backend).all_to_all:  # the safe minimum: a backend tplower does not know
                return f"axis {lowerer.names[i]!r}: backend {backend!r} is unknown to tplower"
    return None


def _axes_moved(op: BoundaryOp) -> list[int]:
    home = replicate_partials(op.src)
    return [i for i in range(len(op.src)) if op.src[i] != op.dst[i] or op.grad[i] != home[i]]


def _load_compute(module: nn.Module, path: str, qual: str) -> Callable[..., Any]:
    mod_name, _, fn_name = path.replace(":", ".").rpartition(".")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise TPLowerError(f"plan[{qual!r}].local_compute: {path!r} cannot be imported: {exc}") from None
    return functools.partial(fn, module)


def _tail_size(value: int | str, config: Any, qual: str) -> int:
    if isinstance(value, int):
        return value
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, value, None)
    if not isinstance(size, int) or size <= 0:
        raise TPLowerError(f"plan[{qual!r}].partial_tail: the model's config has no positive integer {value!r}")
    return size


def _install(module: nn.Module, qual: str, entry: BoundaryEntry, lowerer: MeshLowerer, axis: str,
             seen: dict[int, tuple[ParamLayout, nn.Parameter, nn.Parameter]], config: Any = None
             ) -> InstalledBoundary | None:
    entry = _without_absent_inputs(entry, module.forward, qual)
    num_experts = _global_experts(module, entry, lowerer, axis, qual)
    form = classify_boundary_form(entry, lowerer.names, axes=(axis,), module=qual)
    declared = [op.name for op in form.inputs + form.outputs]
    if unknown := [n for n in entry.uneven if n not in declared]:
        raise TPLowerError(f"plan[{qual!r}].uneven: {unknown} name no declared input or output; the entry "
                           f"declares {declared}")
    for name, p in module.named_parameters(recurse=False):
        check_plain_parameter(p, f"module {qual!r}: parameter {name!r}")
    entry, uses = expert_biases(module, entry, form, axis)  # biases follow their expert weights
    bias = _deferred_bias(module, entry, form, qual)
    grads: dict[str, Any] = dict(entry.param_grads)
    if bias is not None and bias not in grads:
        grads[bias] = deferred_bias_grad(form)
    layouts = _param_layouts(module, entry, grads, lowerer, axis, qual, uses)
    if entry.masked_lookup is None and not isinstance(module, nn.Embedding):  # those inputs are integer ids
        _check_partial_input_grads(entry, form, layouts, qual,
                                   {n: p.dim() for n, p in module.named_parameters(recurse=False)})
    entry = _uneven_outputs(module, entry, form, layouts, lowerer, axis)
    _shard_params(module, layouts, qual, seen)
    _localize_attrs(module, entry, lowerer, axis, qual)
    if form.form == "identity" and bias is None and not layouts and entry.partial_tail is None and not entry.share:
        return None
    reason = _live_reason(lowerer, form) if form.form in ("tp_collective", "region") else None
    if reason is not None:
        warnings.warn(f"tplower: module {qual!r} runs its boundary on DTensor: {reason}", stacklevel=3)
    mode = "lowered" if form.form in ("tp_collective", "region", "identity") and reason is None else "dtensor"
    info = InstalledBoundary(qual, form, mode, reason, bias)
    orig = module.forward
    compute = _load_compute(module, entry.local_compute, qual) if entry.local_compute else orig
    if num_experts is not None:
        compute = ExpertDispatch(compute, num_experts, lowerer, lowerer.names.index(axis), qual)
    ins = _input_moves(form.inputs, orig, qual, entry.uneven)
    boundary = _Boundary(info, module, compute, ins, _output_moves(form.outputs, entry, qual, layouts), lowerer,
                         tuple(layouts.items()), _lookup(module, entry, layouts, orig, qual))
    if entry.partial_tail is not None:
        boundary.tail = _tail_size(entry.partial_tail, config, qual)
        boundary.tail_rep = tuple(Replicate() for _ in lowerer.names)
        boundary.tail_grad = tuple(Partial() if n == axis else Replicate() for n in lowerer.names)
    if entry.share:
        boundary.share = tuple(_output_slot(n, entry, qual, "share") for n in entry.share)
        boundary.share_n = lowerer.shape[lowerer.names.index(axis)] if axis in lowerer.names else 1
    boundary.entry, boundary.axis = entry, axis
    boundary.region = _opens_region(form, lowerer, axis)
    module.forward = boundary
    return info if form.form != "identity" or bias is not None or entry.share else None


def _check_heads(model: nn.Module, entries: Mapping[str, BoundaryEntry], lowerer: MeshLowerer, axis: str) -> None:
    """Refuse, before anything is sharded, a plan that splits attention projections over a tp that does not
    divide the model config's head counts (each rank must own whole query and key/value heads)."""
    counts = config_head_counts(model)
    if not counts or axis not in lowerer.names:
        return
    n = lowerer.shape[lowerer.names.index(axis)]
    bad = {k: v for k, v in counts.items() if v % n}
    if not bad:
        return
    split = [q for q, e in entries.items() if (".attn" in q or "attention" in q or "self_attn" in q) and any(
        "S(" in str(spec) for spec in e.params.values())]
    if not split:
        return
    ok = [d for d in range(1, max(counts.values()) + 1) if all(v % d == 0 for v in counts.values())]
    what = ", ".join(f"{k}={v}" for k, v in bad.items())
    raise TPLowerError(f"plan[{split[0]!r}]: the plan splits attention heads over {n} ranks of axis {axis!r}, but "
                       f"the model's {what} does not divide over {n}: each rank must own whole query and key/value "
                       f"heads; use a tp size among {ok}, or a plan that leaves attention replicated")


def _uneven_outputs(module: nn.Module, entry: BoundaryEntry, form: BoundaryForm,
                    layouts: Mapping[str, ParamLayout], lowerer: MeshLowerer, axis: str) -> BoundaryEntry:
    """``entry`` with its axis-sharded outputs added to ``uneven`` when a parameter's shard dim does not divide.

    A colwise layer of 129 output features on 2 ranks gives pieces of 65 and 64; a move of that output
    (``S(-1) -> R``) then learns the global size from the ranks' sizes, as a declared ``uneven`` output does.
    """
    if axis not in lowerer.names:
        return entry
    uneven = False
    for name, layout in layouts.items():
        p = module._parameters[name]
        for j, q in enumerate(layout.placements):
            if isinstance(q, Shard) and p is not None and (p.shape[q.dim] // layout.packed) % layout.mesh.size(j):
                uneven = True
    if not uneven:
        return entry
    i = lowerer.names.index(axis)
    add = [o.name for o in form.outputs if isinstance(o.src[i], Shard) and o.name not in entry.uneven]
    return dataclasses.replace(entry, uneven=(*entry.uneven, *add)) if add else entry


def _global_experts(module: nn.Module, entry: BoundaryEntry, lowerer: MeshLowerer, axis: str, qual: str
                    ) -> int | None:
    """The expert count of an ``expert_dispatch`` entry's module, checked to divide over ``axis`` (else ``None``)."""
    attr = entry.expert_dispatch
    if attr is None:
        return None
    value = getattr(module, attr, None)
    n = lowerer.shape[lowerer.names.index(axis)] if axis in lowerer.names else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TPLowerError(f"plan[{qual!r}].expert_dispatch: the module has no positive integer {attr!r}")
    if value % n:
        raise TPLowerError(f"plan[{qual!r}]: {value} experts do not divide over the {n} ranks of axis {axis!r}; "
                           "use experts='tp' (tensor parallelism inside the experts) or a mesh axis whose size "
                           "divides the expert count")
    return value


def _check_partial_input_grads(entry: BoundaryEntry, form: BoundaryForm, layouts: Mapping[str, ParamLayout],
                               qual: str, module_param_ndim: Mapping[str, int]) -> None:
    """Refuse the silent partial sums of a module whose own parameters the plan shards by parameter keys.

    Two forms: 3-D expert weights split inside each expert with no output reduced (the ``moe_tp_experts``
    entry left out), and an output reduced with no input declared (its inputs' gradients would stay each
    rank's share: ``all_reduce`` on shared experts held as 3-D parameters).
    """
    sharded = [n for n, lay in layouts.items() if any(isinstance(q, Shard) for q in lay.placements)]
    if entry.style == "moe_tp_experts" and not sharded:
        raise TPLowerError(f"plan[{qual!r}]: 'moe_tp_experts' sums every rank's piece of the experts, but no expert "
                           "weight of the module is sharded; place them by their own keys (e.g. "
                           f"'{qual}.gate_up_proj': 'packed_colwise', '{qual}.down_proj': 'rowwise')")
    split_experts = [n for n, lay in layouts.items() if n in sharded and module_param_ndim.get(n) == 3
                     and any(isinstance(q, Shard) and q.dim % 3 != 0 for q in lay.placements)]
    if split_experts and not form.outputs and entry.expert_dispatch is None:
        raise TPLowerError(f"plan[{qual!r}]: expert weights {split_experts} are split inside each expert, so the "
                           "module's output is a partial sum, but its entry reduces no output; give the module "
                           "'moe_tp_experts' (or shard the experts by index: 'grouped_gemm' with "
                           "'ep_dispatch_experts')")
    reduced = any(isinstance(q, Partial) and not isinstance(d, Partial)
                  for op in form.outputs for q, d in zip(op.src, op.dst, strict=True))
    if sharded and reduced and not entry.input_names():
        raise TPLowerError(f"plan[{qual!r}]: the module's own parameters {sharded} are sharded and its output is "
                           "reduced, but no input is declared, so its inputs' gradients would stay partial on each "
                           "rank; declare its tensor inputs in an entry (e.g. {'style': 'all_reduce', 'in_src': "
                           "{'0': 'R'}, 'in_dst': {'0': 'R'}} with every tensor input)")


def _with_param(entry: BoundaryEntry, pname: str, value: PlanValue, module: nn.Module, axis: str,
                where: str, config: Any) -> BoundaryEntry:
    if not isinstance(value, str):
        raise TPLowerError(f"plan[{where!r}]: a key naming a parameter takes an HF style string, not {value!r}")
    p = module._parameters[pname]
    assert p is not None
    # an expert weight or bias: split on the intermediate dim its module's layout declares (tplower.nn.expert_layout)
    expert = expert_param_placement(module, pname, value, axis, where.rpartition(".")[0], config)
    place, grad, packed = expert or param_key_placement(value, pname, p.ndim, axis, f"plan[{where!r}]")
    return dataclasses.replace(entry, params={**entry.params, pname: place},
                               param_grads={**entry.param_grads, **({pname: grad} if grad else {})},
                               packed={**entry.packed, **({pname: packed} if packed > 1 else {})})


def _install_adapter(module: nn.Module, qual: str, entry: BoundaryEntry, lowerer: MeshLowerer, axis: str) -> None:
    """Install one LoRA adapter's entry (:mod:`tplower.nn.lora`), its whole parameters in place."""
    _install(module, qual, entry, lowerer, axis, {})
    register_full_load(module)


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: Mapping[str, PlanValue] | str | Path, *,
                axis: str = "tp", experts: str = "tp", replicate_rest: bool = True,
                cover: str = "reduce") -> nn.Module:
    """Shard ``model`` in place by ``plan`` on ``mesh`` and install each module's lowered boundary.

    Args:
        model: the full model (every parameter holds its full value; each
            rank must hold the same values).
        mesh: the device mesh; this rank must be in it.
        plan: ``{module name or glob: HF style or entry}``, a path to a
            YAML/JSON file of the same (see :mod:`tplower.nn.plans`), or
            ``"auto"``: a transformers model's own plan (see
            :mod:`tplower.nn.hf_plans`; a ``config.base_model_tp_plan`` given
            for a model with a ``base_model_prefix`` is put under it), or
            ``"derive"``: a plan derived from the module structure
            (:func:`tplower.nn.derive.derive_plan`). A key
            may also name a parameter (``layers.*.self_attn.sinks``): it is
            placed as the style places a parameter.
        axis: the tensor-parallel mesh axis HF styles shard on.
        experts: how ``"auto"`` parallelizes mixture-of-experts blocks:
            ``"tp"`` (default; the model's ``tp_plan``: every rank holds a
            piece of every expert, the block's output is reduced once) or
            ``"ep"`` (its ``ep_plan`` over the ``tp_plan``: the experts are
            sharded by index over ``axis``, each rank takes its piece of the
            tokens and dispatches each to the rank holding its expert;
            :mod:`tplower.nn.experts`). Ignored for other plans, whose styles
            say it.
        replicate_rest: every parameter the plan does not place becomes a
            ``Replicate`` DTensor on ``mesh[axis]`` too, a local view while
            its module or that module's parent runs
            (:mod:`tplower.nn.rest_params`), so every parameter is a DTensor and ``clip_grad_norm_``,
            ``foreach``/``fused`` optimizers and DCP take the whole model as
            they take ``parallelize_module``'s fully placed one. ``False``
            leaves those parameters plain tensors. Each rank's gradient of
            such a parameter is taken as whole, as before: a parameter used
            on a sharded activation needs a plan entry (``P(sum)`` gradient).

    Returns:
        ``model`` itself. Every parameter the plan places is an
        ``nn.Parameter`` holding a DTensor with the plan's placements and
        the global shape (on ``mesh[axis]`` when it is placed on ``axis``
        alone, as ``parallelize_module(model, mesh[axis], ...)`` makes it;
        see :mod:`tplower.nn.params`), so ``state_dict``, DCP,
        ``clip_grad_norm_``, optimizers and FSDP2 treat it as they treat
        ``parallelize_module``'s; its ``.grad`` is a DTensor of the same
        placements, reduced over the axis where the local gradient is
        partial. Matched modules run their boundaries on local tensors:
        inputs the plan declares take local tensors (``None`` passes
        through), outputs are local tensors, and activations move only
        through tplower's collectives.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``mesh`` not a
            ``DeviceMesh`` or ``axis`` not a string (before any collective).
        ValueError: ``experts`` is neither ``"tp"`` nor ``"ep"``, or ``cover``
            neither ``"reduce"`` nor ``"refuse"``.
        TPLowerError: a plan error (naming the module, field and value), a
            module already parallelized, a parameter that is already a
            DTensor (e.g. from ``parallelize_module``), attention split over
            a tp that does not divide the config's head counts (a parameter
            dim that does not divide is sharded unevenly, ``torch.chunk``
            pieces), a bias that a partial output
            would add per rank, an ``uneven`` name that is no declared
            input or output, a parameter-key shard that would leave a silent
            partial sum (expert weights split with no ``moe_tp_experts``, a
            reduced module with undeclared inputs), an expert weight whose
            intermediate dim neither its module's layout nor its shapes tell
            (:mod:`tplower.nn.expert_layout`), or, with ``experts="ep"``,
            a model without an ``ep_plan`` or an expert count that does not
            divide over ``axis``. At call time (raised by the model's forward):
            under the debug check, on every rank alike when the ranks'
            boundary moves disagree (undeclared uneven local sizes: the
            message names the module, the input or output and the dim);
            for an ``uneven`` tensor, local sizes that are not
            ``torch.chunk`` pieces.

    Warns:
        UserWarning: per module whose boundary runs on DTensor because the
        live mesh runs a moved axis on a backend tplower does not know.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize: model must be a torch.nn.Module, got {type(model).__name__}")
    check_mesh(mesh, "mesh", "parallelize")
    if not isinstance(axis, str):
        raise TypeError(f"parallelize: axis must be a mesh axis name (str), got {type(axis).__name__}")
    if experts not in ("tp", "ep"):
        raise ValueError(f"parallelize: experts={experts!r}; allowed: 'tp' (tensor parallelism inside the experts) "
                         "or 'ep' (expert parallelism)")
    if cover not in COVER_MODES:
        raise ValueError(f"parallelize: cover={cover!r}; allowed: {', '.join(map(repr, COVER_MODES))}")
    if isinstance(plan, str) and plan == "derive":  # at this axis' size: attention it cannot split stays whole
        names = mesh.mesh_dim_names or ()
        plan = derive_plan(model, axis=axis, tp=mesh.size(names.index(axis)) if axis in names else None).plan
    plan = resolve_model_plan(plan, model, experts=experts)
    lowerer = mesh_lowerer(mesh)
    if axis not in lowerer.names:
        warnings.warn(f"tplower: mesh axes {lowerer.names} have no {axis!r}; HF styles shard nothing", stacklevel=2)
    modules = dict(model.named_modules())
    params = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in modules]
    matched = redirect_to_base(match_plan(plan, [*modules, *params]), modules)  # LoRA layers: their base
    entries = {qual: resolve_entry(plan[key], key, kind=_kind(modules[qual]), axis=axis)
               for qual, key in matched.items() if qual in modules}
    for name, key in matched.items():  # keys that name a parameter: place it within its module's entry
        if name not in modules:
            owner, _, pname = name.rpartition(".")
            entries[owner] = _with_param(entries.get(owner, BoundaryEntry()), pname, plan[key], modules[owner],
                                         axis, name, getattr(model, "config", None))
    _check_heads(model, entries, lowerer, axis)
    seen: dict[int, tuple[ParamLayout, nn.Parameter, nn.Parameter]] = {}
    for qual in (q for q in modules if q in entries):
        module = modules[qual]
        if isinstance(module.__dict__.get("forward"), _Boundary) or REPLACED in module.__dict__:
            raise TPLowerError(f"module {qual!r} is already parallelized by tplower; parallelize a fresh model")
        _install(module, qual, entries[qual], lowerer, axis, seen, getattr(model, "config", None))
    link_fanouts(modules)  # siblings that read one tensor (q, k, v; gate, up) share its move
    watch_registrations(_install_adapter)
    for qual, module in modules.items():  # adapters added before parallelize: placed from their base's entry
        if is_lora_layer(module):
            place_lora_layer(module, qual)
    for module in modules.values():  # keep ties: modules outside the plan that share a placed parameter
        for name, p in module._parameters.items():
            if p is not None and id(p) in seen:
                module._parameters[name] = seen[id(p)][1]
    if axis in lowerer.names:
        boundaries = [b for m in modules.values() if isinstance(b := m.__dict__.get("forward"), _Boundary)]
        install_dropout_streams(model, boundaries, mesh.device_type, lowerer.coord[lowerer.names.index(axis)])
        install_coverage(model, mesh, axis, place_rest(modules, mesh, axis) if replicate_rest else None, cover)
    register_full_load(model)  # load_state_dict of whole tensors: each rank takes its boxes
    patch_save_pretrained(model)  # save_pretrained writes whole weights from rank 0
    return model
