"""Hugging Face transformers plans as they ship: ``"auto"``, base-model prefixes, parameter-level keys.

transformers (5.x) keeps a model's tensor-parallel plan in two places: the
config's ``base_model_tp_plan`` (keys relative to the base model, e.g.
``layers.*.mlp.up_proj``) and the model's own ``tp_plan``/``_tp_plan``
(the base plan under ``base_model_prefix``, e.g. ``model.layers.*...``, plus
the head: ``lm_head: colwise_gather_output``). Some keys name a parameter
rather than a module (``layers.*.self_attn.sinks``): that parameter is
placed, and its module's entry (``local_params``) runs on local tensors.

:func:`resolve_model_plan` turns ``"auto"`` or a dict taken from either
place into keys of the model's own module names, by one rule per key for
every model (as written, else under ``base_model_prefix``, else inside a
wrapper's model); :func:`param_key_placement`
gives the placement a style means for a single parameter, following
transformers' ``shard_param`` rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..core.support.argcheck import check_int
from ..core.support.errors import TPLowerError
from .derive import derive_plan
from .entries import PlanValue, ReadValue, matching_keys, plan_name, plan_source, read_plan

__all__ = ["AUTO", "COLWISE_STYLES", "DERIVE", "PACKED_PARTS", "model_ep_plan", "model_tp_plan",
           "param_key_placement", "plan_for", "read_model_plan", "resolve_model_plan", "shipped_keys"]

#: the plan argument that means "the model's own plan" (any case: :func:`tplower.plans.entries.plan_name`)
AUTO = "auto"
#: the plan argument that means "a plan derived from the model's module structure" (any case)
DERIVE = "derive"
V = TypeVar("V")


def _shipped_plan(model: nn.Module, kind: str) -> dict[str, str] | None:
    """The model's ``{kind}_plan`` / ``_{kind}_plan``, else ``config.base_model_{kind}_plan`` under the prefix."""
    plan: Any = None
    for attr in (f"{kind}_plan", f"_{kind}_plan"):
        try:
            plan = getattr(model, attr, None)
        except Exception:  # a property of a model that cannot build its plan: try the next source
            plan = None
        if plan:
            break
    if not plan:
        base = getattr(getattr(model, "config", None), f"base_model_{kind}_plan", None)
        if base:
            plan = _resolve_keys(dict(base), model)
    return {str(k): str(v) for k, v in plan.items()} if plan else None


def shipped_keys(model: nn.Module) -> frozenset[str]:
    """Every key of ``model``'s own plans (``tp_plan``/``ep_plan`` and the config's base plans, of the model or
    of a wrapper's model) in each spelling that may name something of it (:func:`_spellings`).

    A transformers plan ships keys for every layer kind of its architecture (dense MLPs and experts alike); a
    config may lack some, so such keys name nothing without being a mistake.
    """
    inner, _ = _wrapped_model(model)
    keys: set[str] = set()
    for kind in ("tp", "ep"):
        for source in (inner, getattr(inner, "config", None)):
            for attr in (f"{kind}_plan", f"_{kind}_plan", f"base_model_{kind}_plan"):
                try:
                    plan = getattr(source, attr, None)
                except Exception:  # a property that cannot build its plan: it ships nothing
                    plan = None
                if isinstance(plan, Mapping):
                    keys.update(str(k) for k in plan)
    return frozenset(s for k in keys for s in _spellings(k, model))


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's own tensor-parallel plan: ``tp_plan`` / ``_tp_plan``, else the config's under the prefix.

    Raises:
        TPLowerError: the model carries no plan (not a transformers model,
            or an architecture without ``base_model_tp_plan``).
    """
    plan = _shipped_plan(model, "tp")
    if plan is None:
        raise TPLowerError(f"plan='auto': {type(model).__name__} has no tp_plan, _tp_plan or "
                           "config.base_model_tp_plan; use plan='derive' (a plan derived from its module "
                           "structure; `tplower plan` shows it) or pass a plan mapping")
    return plan


def model_ep_plan(model: nn.Module) -> dict[str, str]:
    """The model's expert-parallel plan: ``ep_plan`` / ``_ep_plan``, else the config's under the prefix.

    Raises:
        TPLowerError: the model carries no expert-parallel plan (a dense
            model, or MoE experts transformers does not dispatch, e.g. Llama 4).
    """
    plan = _shipped_plan(model, "ep")
    if plan is None:
        raise TPLowerError(f"experts='ep': {type(model).__name__} has no ep_plan or config.base_model_ep_plan "
                           "(a dense model, or experts transformers does not dispatch); use experts='tp'")
    return plan


def _wrapped_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The transformers model inside a wrapper that names it ``get_base_model()`` (a PEFT ``PeftModel``), and
    its name in ``model`` plus a dot; ``(model, "")`` for anything else."""
    get = getattr(type(model), "get_base_model", None)
    if not callable(get):
        return model, ""
    inner = model.get_base_model()  # type: ignore[operator]
    if inner is model or not isinstance(inner, nn.Module):
        return model, ""
    qual = next((q for q, m in model.named_modules() if m is inner), None)
    return (inner, f"{qual}.") if qual else (model, "")


def _names(model: nn.Module) -> list[str]:
    modules = [n for n, _ in model.named_modules()]
    params = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    return list(dict.fromkeys([*modules, *params]))


def _spellings(key: str, model: nn.Module) -> list[str]:
    """Where ``key`` may name something of ``model``, in order: as written, under the model's
    ``base_model_prefix`` (a ``config.base_model_tp_plan`` key on a ``*ForCausalLM``), then each spelling of
    it inside a wrapper's model (a PEFT ``PeftModel``'s ``get_base_model()``) under the wrapper's name for it."""
    out = [key]
    prefix = getattr(model, "base_model_prefix", "")
    if isinstance(prefix, str) and prefix and isinstance(getattr(model, prefix, None), nn.Module):
        out.append(f"{prefix}.{key}" if key else prefix)
    inner, qual = _wrapped_model(model)
    if qual:
        out += [f"{qual}{s}" for s in _spellings(key, inner)]
    return out


def _key_names(keys: Iterable[str], model: nn.Module) -> dict[str, str]:
    """Each key's first spelling (:func:`_spellings`) that names a module or parameter of ``model``; a key that
    names nothing in any spelling, or whose spelling another key already has, stays as written. One rule for
    every key and every model: whether a key is prefixed never depends on the others."""
    names = _names(model)
    keys = list(keys)
    spelled = {k: _spellings(k, model) for k in keys}
    found = matching_keys({s for options in spelled.values() for s in options}, names)
    out: dict[str, str] = {}
    for key in keys:
        name = next((s for s in spelled[key] if s in found), key)
        if name != key and (name in keys or name in out.values()):  # two keys for one name: the written one wins
            name = key
        out[key] = name
    return out


def _resolve_keys(plan: Mapping[str, V], model: nn.Module) -> dict[str, V]:
    """``plan`` keyed by :func:`_key_names`."""
    return {name: plan[key] for key, name in _key_names(plan, model).items()}


def resolve_model_plan(plan: Mapping[str, PlanValue] | str | Path, model: nn.Module, *,
                       experts: str = "tp", axis: str = "tp", tp: int | None = None) -> dict[str, PlanValue]:
    """The plan keyed by ``model``'s own names: :func:`read_model_plan`'s plan as written.

    Args:
        plan: ``"auto"`` (the model's own plan, :func:`model_tp_plan`),
            ``"derive"`` (:func:`tplower.plans.derive.derive_plan`), either
            in any case (``"Auto"``), a mapping, or a YAML/JSON file path.
        model: the model it is for.
        experts: with ``"auto"``: ``"tp"`` (tensor parallelism inside the
            experts, the model's ``tp_plan``) or ``"ep"`` (its ``ep_plan``'s
            keys over the ``tp_plan``: experts sharded by index, tokens
            dispatched).
        axis, tp: with ``"derive"``: the tensor-parallel axis and its size
            (``None``: unknown), as :func:`~tplower.plans.derive.derive_plan` takes them.

    Returns:
        The checked plan, each key resolved on its own by one rule for every
        model: as written where it names a module or parameter, else under
        the model's ``base_model_prefix`` (a ``config.base_model_tp_plan``
        key on a ``*ForCausalLM``), else under a wrapper's model (a PEFT
        ``PeftModel``'s ``get_base_model()``); a key naming nothing stays as
        written (``parallelize`` refuses it, unless the model's own plan
        ships it: :func:`shipped_keys`). For ``"auto"`` the shipped
        keys that name nothing of this model are left out (a plan ships keys
        for dense and MoE layers alike; a config may have only one kind), so
        they never warn.

    Raises:
        TPLowerError: as :func:`tplower.plans.entries.load_plan`, ``"auto"`` on a
            model without a plan, or ``"derive"`` on one no rule matches.
    """
    return read_model_plan(plan, model, experts=experts, axis=axis, tp=tp)[0]


def plan_for(model: nn.Module, plan: str = "auto", *, experts: str = "tp", axis: str = "tp",
             tp: int | None = None) -> dict[str, PlanValue]:
    """The plan ``parallelize(model, mesh, plan)`` would install, as the plain mapping a user edits and passes back.

    ``parallelize(model, mesh, plan_for(model, "auto"))`` places every parameter and runs every boundary as
    ``parallelize(model, mesh, "auto")`` does; change one key first for "the model's own plan, with one change"
    (embeddings whole, experts planned by hand, a LoRA target left out). Keys are the model's own names (a key
    shipped under the base model is given under its prefix, ``model.layers.*.mlp.up_proj``), values as written
    (HF style strings; ``"derive"`` also gives entry mappings), so the result is also what ``load_plan`` takes
    and YAML writes. This is the public route to a transformers model's own plan: code that read it from an
    internal module (``tplower.nn.hf_plans.model_tp_plan``, moved since) calls this instead.

    Args:
        model: the model it is for (a transformers model for ``"auto"``); nothing about it changes.
        plan: ``"auto"`` (the model's own ``tp_plan``, else ``config.base_model_tp_plan``) or ``"derive"`` (a
            plan derived from its module structure, :func:`tplower.plans.derive.derive_plan`), in any case.
        experts: with ``"auto"``: ``"tp"`` (the ``tp_plan``) or ``"ep"`` (its ``ep_plan``'s keys over it), as
            :func:`tplower.parallelize` takes it.
        axis: the tensor-parallel mesh axis (``"derive"`` names it in the entries it writes).
        tp: with ``"derive"``: the axis' size the plan is for (``mesh.size(axis)``, which ``parallelize`` uses:
            attention whose head counts it does not divide stays whole); ``None``: unknown, every rule applies.

    Returns:
        ``{module or parameter name or glob: HF style or entry mapping}``, a fresh ``dict`` in the plan's order.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``axis`` not a ``str`` or ``tp`` not an int.
        ValueError: ``experts`` is neither ``"tp"`` nor ``"ep"``.
        TPLowerError: ``plan`` is neither ``"auto"`` nor ``"derive"`` (a mapping or a file is a plan already:
            pass it to ``parallelize``, or read it with ``load_plan``), ``tp`` below 1, ``"auto"`` on a model
            without a plan, ``experts="ep"`` on one without an ``ep_plan``, or ``"derive"`` on one no rule matches.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan_for: model must be a torch.nn.Module, got {type(model).__name__}")
    if plan_name(plan) is None:
        raise TPLowerError(f"plan_for: plan={plan!r}; allowed: 'auto' (the model's own transformers plan) or "
                           "'derive' (derived from its modules), in any case; a mapping or a YAML/JSON file is a "
                           "plan already: pass it to parallelize, or read it with tplower.load_plan")
    if experts not in ("tp", "ep"):
        raise ValueError(f"plan_for: experts={experts!r}; allowed: 'tp' (tensor parallelism inside the experts) "
                         "or 'ep' (expert parallelism)")
    if not isinstance(axis, str):
        raise TypeError(f"plan_for: axis must be a mesh axis name (str), got {type(axis).__name__}")
    size = check_int(tp, "tp", "plan_for", optional=True)
    if size is not None and size < 1:
        raise TPLowerError(f"plan_for: tp={size}; the axis' size is at least 1 (or None: unknown)")
    return resolve_model_plan(plan, model, experts=experts, axis=axis, tp=size)


def read_model_plan(plan: Mapping[str, PlanValue] | str | Path, model: nn.Module, *, experts: str = "tp",
                    axis: str = "tp", tp: int | None = None) -> tuple[dict[str, PlanValue], dict[str, ReadValue]]:
    """The plan keyed by ``model``'s own names (as :func:`resolve_model_plan` describes), as written and read.

    The first stage of ``parallelize``: each value is read once (:func:`tplower.plans.entries.read_plan`:
    placement text into PyTorch's types, styles checked), before any key is matched; every later stage takes
    the read values.

    Returns:
        ``(plan as written, {key: read value})``, the same keys in the same order.

    Raises:
        TPLowerError: as :func:`resolve_model_plan`.
    """
    name = plan_name(plan)
    if name == DERIVE:  # at the axis' size where known: attention it cannot split stays whole
        source = plan_source(derive_plan(model, axis=axis, tp=tp).plan)
    elif name == AUTO:
        inner, _ = _wrapped_model(model)
        if experts == "ep":  # the expert-parallel keys replace the tensor-parallel ones they name
            source = plan_source({**model_tp_plan(inner), **model_ep_plan(inner)})
        else:
            source = plan_source(model_tp_plan(inner))
    else:
        source = plan_source(plan)
    read = read_plan(source)
    names = _key_names(source, model)
    if name == AUTO and (used := matching_keys(names.values(), _names(model))):
        names = {key: n for key, n in names.items() if n in used}
    return ({n: source[key] for key, n in names.items()},
            {n: read[key] if n == key else dataclasses.replace(read[key], key=n) for key, n in names.items()})


# transformers' shard_param rules, per style, for a key that names one parameter
#: the styles that shard a parameter's output dim (``ndim - 2``)
COLWISE_STYLES = _COLWISE = ("colwise", "colwise_rep", "colwise_gather_output", "local_colwise")
_ROWWISE = ("rowwise", "rowwise_rep", "rowwise_split_input", "local_rowwise")


#: parts a packed style's parameter holds along its shard dim (gate and up: transformers' split_factor=2)
PACKED_PARTS = 2


def param_key_placement(style: str, name: str, ndim: int, axis: str, where: str
                        ) -> tuple[dict[str, Placement], dict[str, Placement] | None, int]:
    """The placement, partial-gradient placement and packing an HF style gives one parameter named by a plan key.

    Colwise styles shard dim ``ndim - 2`` (dim 0 of a vector; dim 1, the
    output features, of a 3-D ``[experts, out, in]`` expert weight), rowwise
    styles the last dim (a ``bias`` is replicated), ``embedding_rowwise``
    rows and ``embedding_colwise`` columns, as transformers'
    ``shard_param``; ``replicate`` keeps the whole value and
    ``replicated_with_grad_allreduce`` also reduces its gradient.
    ``packed_colwise`` (a fused gate/up weight) shards dim ``ndim - 2`` with
    its 2 packed parts each sharded on its own (a vector: plain ``S(-1)``),
    ``packed_rowwise`` the last dim alike (a vector: replicated), as
    transformers' ``PackedColwiseParallel``/``PackedRowwiseParallel``;
    ``grouped_gemm`` (expert parallelism) shards the expert dim 0.

    Returns:
        ``(placement, grad placement or None, packed parts)`` (``1``: not packed).

    Raises:
        TPLowerError: a style that has no meaning for a single parameter.
    """
    if style == "packed_colwise":
        return ({axis: Shard(-1)}, None, 1) if ndim == 1 else ({axis: Shard(ndim - 2)}, None, PACKED_PARTS)
    if style == "packed_rowwise":
        return ({axis: Replicate()}, None, 1) if ndim == 1 else ({axis: Shard(-1)}, None, PACKED_PARTS)
    if style == "grouped_gemm":  # expert parallelism: an [experts, ...] weight or bias sharded by expert
        return {axis: Shard(0)}, None, 1
    place, grad = _plain_param_placement(style, name, ndim, axis, where)
    return place, grad, 1


def _plain_param_placement(style: str, name: str, ndim: int, axis: str, where: str
                           ) -> tuple[dict[str, Placement], dict[str, Placement] | None]:
    if style in _COLWISE:
        return {axis: Shard(max(ndim - 2, 0))}, None
    if style in _ROWWISE:
        return {axis: Replicate() if name == "bias" else Shard(-1)}, None
    if style == "embedding_rowwise":
        return {axis: Shard(0)}, None
    if style == "embedding_colwise":
        return {axis: Shard(1)}, None
    if style == "replicate":
        return {axis: Replicate()}, None
    if style == "replicated_with_grad_allreduce":
        return {axis: Replicate()}, {axis: Partial("sum")}
    allowed = (*_COLWISE, *_ROWWISE, "packed_colwise", "packed_rowwise", "grouped_gemm", "embedding_rowwise",
               "embedding_colwise", "replicate", "replicated_with_grad_allreduce")
    raise TPLowerError(f"{where}: style {style!r} on a parameter has no translation; a parameter key takes one of "
                       f"{', '.join(allowed)}")
