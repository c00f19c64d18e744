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

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from ..core.support.errors import TPLowerError
from .derive import derive_plan
from .entries import PlanValue, load_plan, matching_keys, plan_name

__all__ = ["AUTO", "COLWISE_STYLES", "DERIVE", "PACKED_PARTS", "model_ep_plan", "model_tp_plan",
           "param_key_placement", "resolve_model_plan", "shipped_keys"]

#: the plan argument that means "the model's own plan" (any case: :func:`tplower.plans.entries.plan_name`)
AUTO = "auto"
#: the plan argument that means "a plan derived from the model's module structure" (any case)
DERIVE = "derive"


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


def _resolve_keys(plan: Mapping[str, PlanValue], model: nn.Module) -> dict[str, PlanValue]:
    """``plan`` with each key in its first spelling (:func:`_spellings`) that names a module or parameter of
    ``model``; a key that names nothing in any spelling, or whose spelling another key already has, stays as
    written. One rule for every key and every model: whether a key is prefixed never depends on the others."""
    names = _names(model)
    keys = list(plan)
    spelled = {k: _spellings(k, model) for k in keys}
    found = matching_keys({s for options in spelled.values() for s in options}, names)
    out: dict[str, PlanValue] = {}
    for key in keys:
        name = next((s for s in spelled[key] if s in found), key)
        if name != key and (name in plan or name in out):  # two keys for one name: the written one wins
            name = key
        out[name] = plan[key]
    return out


def resolve_model_plan(plan: Mapping[str, PlanValue] | str | Path, model: nn.Module, *,
                       experts: str = "tp", axis: str = "tp", tp: int | None = None) -> dict[str, PlanValue]:
    """The plan keyed by ``model``'s own names.

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
    name = plan_name(plan)
    if name == DERIVE:  # at the axis' size where known: attention it cannot split stays whole
        return _resolve_keys(load_plan(derive_plan(model, axis=axis, tp=tp).plan), model)
    if name == AUTO:
        inner, _ = _wrapped_model(model)
        if experts == "ep":  # the expert-parallel keys replace the tensor-parallel ones they name
            shipped = {**model_tp_plan(inner), **model_ep_plan(inner)}
        else:
            shipped = model_tp_plan(inner)
        resolved = _resolve_keys(load_plan(shipped), model)
        used = matching_keys(resolved, _names(model))
        return {k: v for k, v in resolved.items() if k in used} if used else resolved
    return _resolve_keys(load_plan(plan), model)


# transformers' shard_param rules, per style, for a key that names one parameter
#: the styles that shard a parameter's output dim (``ndim - 2``)
COLWISE_STYLES = _COLWISE = ("colwise", "colwise_rep", "colwise_gather_output", "local_colwise")
_ROWWISE = ("rowwise", "rowwise_rep", "rowwise_split_input", "local_rowwise")


#: parts a packed style's parameter holds along its shard dim (gate and up: transformers' split_factor=2)
PACKED_PARTS = 2


def param_key_placement(style: str, name: str, ndim: int, axis: str, where: str
                        ) -> tuple[dict[str, str], dict[str, str] | None, int]:
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
        return ({axis: "S(-1)"}, None, 1) if ndim == 1 else ({axis: f"S({ndim - 2})"}, None, PACKED_PARTS)
    if style == "packed_rowwise":
        return ({axis: "R"}, None, 1) if ndim == 1 else ({axis: "S(-1)"}, None, PACKED_PARTS)
    if style == "grouped_gemm":  # expert parallelism: an [experts, ...] weight or bias sharded by expert
        return {axis: "S(0)"}, None, 1
    place, grad = _plain_param_placement(style, name, ndim, axis, where)
    return place, grad, 1


def _plain_param_placement(style: str, name: str, ndim: int, axis: str, where: str
                           ) -> tuple[dict[str, str], dict[str, str] | None]:
    if style in _COLWISE:
        return {axis: f"S({max(ndim - 2, 0)})"}, None
    if style in _ROWWISE:
        return {axis: "R" if name == "bias" else "S(-1)"}, None
    if style == "embedding_rowwise":
        return {axis: "S(0)"}, None
    if style == "embedding_colwise":
        return {axis: "S(1)"}, None
    if style == "replicate":
        return {axis: "R"}, None
    if style == "replicated_with_grad_allreduce":
        return {axis: "R"}, {axis: "P(sum)"}
    allowed = (*_COLWISE, *_ROWWISE, "packed_colwise", "packed_rowwise", "grouped_gemm", "embedding_rowwise",
               "embedding_colwise", "replicate", "replicated_with_grad_allreduce")
    raise TPLowerError(f"{where}: style {style!r} on a parameter has no translation; a parameter key takes one of "
                       f"{', '.join(allowed)}")
