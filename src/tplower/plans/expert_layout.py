"""Which dim of a transformers experts module's parameters tensor parallelism inside the experts splits.

transformers 5 holds the experts of a mixture-of-experts block as 3-D parameters named by its experts interface
(``integrations/moe.py``, which every experts implementation reads): ``gate_up_proj`` (``up_proj`` without a
gate) from the hidden size ``H`` to the intermediate features, ``down_proj`` back, each with an optional 2-D
``<name>_bias``. The module declares their layout (``@use_experts_implementation(is_transposed=...,
is_concatenated=...)`` sets these attributes on it):

=====================  ===============  ===================  =======================
parameter              ``[E, out, in]``  ``is_transposed``    split (intermediate) dim
=====================  ===============  ===================  =======================
``gate_up_proj``       ``[E, 2I, H]``    ``[E, H, 2I]``       the ``2I`` one
``up_proj``            ``[E, I, H]``     ``[E, H, I]``        the ``I`` one
``down_proj``          ``[E, H, I]``     ``[E, I, H]``        the ``I`` one
``gate_up_proj_bias``  ``[E, 2I]``                            1
``down_proj_bias``     ``[E, H]``                             none (the hidden side)
=====================  ===============  ===================  =======================

Tensor parallelism inside the experts (``moe_tp_experts``) gives every rank a piece of every expert's
intermediate features: the one split whose pieces the block's single reduction adds up to the whole (a split of
``H`` would cut gate/up's contraction before the activation, or down's output). So every split style on an
expert parameter (``colwise``, ``rowwise``, ``packed_colwise``, ``packed_rowwise`` and their variants) shards
its intermediate dim, wherever the layout puts it. transformers' ``shard_param`` reads the dim from the style
alone (``colwise``: dim ``ndim - 2``, ``rowwise``: the last), right for ``[E, out, in]``; its plans for
transposed experts say the other name (Llama 4's and Aria's ``packed_rowwise`` gate/up and ``colwise`` down)
and get the same dims here, as does a plan that names the layout's meaning (gpt-oss: ``gate_up_proj``
``colwise``, ``down_proj`` ``rowwise``).

Packing: a concatenated gate/up (``[gate; up]``, ``is_concatenated``) has each half split on its own (2 parts,
as ``packed_*``); an interleaved one (gpt-oss: gates at even features, ups at odd) is split whole, which keeps
each gate beside its up. A style that says otherwise is corrected, with a warning. A module that declares no
layout (Llama 4, LongCat-Flash) packs as its style says.

The hidden-side bias has no intermediate dim: it stays whole (``R``), and where the block's output is a partial
sum each rank adds its ``1/n`` share (``R -> P(sum)``, DTensor's partition of a replicated value added into a
partial one; its gradient arrives whole), so the reduction counts it once. A gate/up bias the plan leaves out is
split as its weight is (:func:`expert_biases`).

A module without ``is_transposed`` (Llama 4, LongCat-Flash, Inkling's shared experts) has its layout read from
its weights' shapes: of ``[E, out, in]`` and ``[E, in, out]``, the one under which every weight has the same
hidden size (the module's ``hidden_size`` or ``hidden_dim``, else its config's or the model's, where known) and
the same intermediate size (gate/up's output holds two). Where both fit (``H == I`` with no gate, say) or none
does, the parameter is refused naming its shape and the fix.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from ..core.support.errors import TPLowerError
from .entries import BoundaryEntry
from .forms import BoundaryForm, parse_spec
from .hf import COLWISE_STYLES

__all__ = ["ExpertParam", "expert_biases", "expert_param", "expert_param_placement"]

_UP, _DOWN = "up", "down"
#: transformers' experts interface: weight name -> which side its output features are on
_ROLES = {"gate_up_proj": _UP, "up_proj": _UP, "gate_proj": _UP, "down_proj": _DOWN}
#: the styles that split a parameter inside each expert (tensor parallelism), as opposed to by expert or none
_SPLITS = frozenset({*COLWISE_STYLES, "rowwise", "rowwise_rep", "rowwise_split_input", "local_rowwise",
                     "packed_colwise", "packed_rowwise"})


@dataclass(frozen=True)
class ExpertParam:
    """Where one expert parameter's intermediate features lie.

    Attributes:
        dim: the intermediate dim, or ``None`` for a bias on the hidden side (``down_proj_bias``).
        parts: gate and up parts the module declares along ``dim`` (``2``: concatenated, ``1``:
            interleaved or no gate), or ``None`` where it declares none (the style says).
    """

    dim: int | None
    parts: int | None


def _hidden_size(module: nn.Module, config: Any) -> int | None:
    """The module's ``hidden_size``/``hidden_dim``, else its own config's ``hidden_size``, else ``config``'s."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for owner, attr in ((module, "hidden_size"), (module, "hidden_dim"),
                        (getattr(module, "config", None), "hidden_size"), (text, "hidden_size")):
        value = getattr(owner, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _fits(module: nn.Module, transposed: bool, h: int | None) -> bool:
    """Whether ``module``'s expert weights read as ``[E, in, out]`` (``transposed``) or ``[E, out, in]`` agree:
    one hidden size (``h`` where known) and one intermediate size (gate/up's output counts gate and up)."""
    hidden, inner = set(), set()
    for name, role in _ROLES.items():
        w = module._parameters.get(name)
        if w is None or w.ndim != 3:
            continue
        d = (1 if transposed else 2) if role == _UP else (2 if transposed else 1)  # the hidden side
        parts = 2 if name == "gate_up_proj" else 1
        hidden.add(w.shape[d])
        inner.add(w.shape[3 - d] / parts)
    return len(hidden) == 1 and len(inner) == 1 and (h is None or hidden == {h})


def _transposed(module: nn.Module, pname: str, qual: str, axis: str, config: Any) -> bool:
    """Whether ``module``'s expert weights are ``[E, in, out]``: its ``is_transposed``, else the one layout its
    shapes fit."""
    flag = getattr(module, "is_transposed", None)
    if isinstance(flag, bool):
        return flag
    h = _hidden_size(module, config)
    fits = [t for t in (False, True) if _fits(module, t, h)]
    if len(fits) == 1:
        return fits[0]
    p = module._parameters[pname]
    assert p is not None
    known = "" if h is None else f" with hidden size {h}"
    why = (f"its weights' shapes fit both [E, out, in] and [E, in, out]{known}" if fits else
           f"its weights' shapes fit neither [E, out, in] nor [E, in, out]{known}")
    raise TPLowerError(
        f"plan[{qual + '.' + pname!r}]: cannot tell which dim of {pname!r} {tuple(p.shape)} holds each expert's "
        f"intermediate features: {type(module).__name__} declares no is_transposed and {why}; declare the layout "
        "(set is_transposed on the module: True for [experts, in, out] weights, as transformers' "
        "use_experts_implementation does) or name the dim in the module's entry: "
        f"{{{qual!r}: {{'style': 'moe_tp_experts', 'params': {{{pname!r}: {{{axis!r}: 'S(d)'}}}}}}}} with d the "
        "intermediate dim, 1 or 2")


def expert_param(module: nn.Module, pname: str, qual: str = "?", axis: str = "tp", config: Any = None
                 ) -> ExpertParam | None:
    """Where parameter ``pname`` of ``module`` holds its intermediate features, or ``None`` if it is no expert one.

    An expert parameter is a 3-D weight of transformers' experts interface (``gate_up_proj``, ``up_proj``,
    ``gate_proj``, ``down_proj``) or the 2-D ``<weight>_bias`` of one; see the module docstring for the dims.
    ``config``: the model's config, whose (text) ``hidden_size`` is the last place the hidden size is read from.

    Raises:
        TPLowerError: a weight whose layout cannot be known (no ``is_transposed`` and shapes that do not tell),
            naming ``qual.pname``, its shape and the fix.
    """
    p = module._parameters.get(pname)
    base = pname[:-len("_bias")] if pname.endswith("_bias") else pname
    role, weight = _ROLES.get(base), module._parameters.get(base)
    if p is None or role is None or weight is None or weight.ndim != 3 or p.ndim != (2 if base != pname else 3):
        return None
    concatenated = getattr(module, "is_concatenated", None)
    parts = (2 if concatenated else 1) if isinstance(concatenated, bool) else None
    parts = parts if base == "gate_up_proj" else 1
    if base != pname:  # a bias [E, out]
        return ExpertParam(1 if role == _UP else None, parts)
    out, inn = (2, 1) if _transposed(module, pname, qual, axis, config) else (1, 2)
    return ExpertParam(out if role == _UP else inn, parts)


def expert_param_placement(module: nn.Module, pname: str, style: str, axis: str, qual: str, config: Any = None
                           ) -> tuple[dict[str, str], None, int] | None:
    """The placement and packing a split style gives expert parameter ``pname`` of module ``qual``.

    Its intermediate dim, packed as the module declares (else as the style says: ``packed_*`` 2 parts);
    a hidden-side bias stays replicated. ``None`` where ``pname`` is no expert parameter or ``style``
    splits nothing inside the experts (``grouped_gemm``, ``replicate``): the parameter's plain rule applies
    (:func:`tplower.plans.hf.param_key_placement`).

    Returns:
        ``(placement, None, packed parts)``, as :func:`~tplower.plans.hf.param_key_placement`.

    Raises:
        TPLowerError: as :func:`expert_param`.

    Warns:
        UserWarning: the style's packing differs from the module's declared gate/up layout (the layout wins).
    """
    if style not in _SPLITS:
        return None
    info = expert_param(module, pname, qual, axis, config)
    if info is None:
        return None
    if info.dim is None:
        return {axis: "R"}, None, 1
    said = 2 if style.startswith("packed_") else 1
    parts = said if info.parts is None else info.parts
    if parts != said:
        what = "weight" if pname.endswith("proj") else "bias"
        how = ("concatenated [gate; up] {w} with {s!r}; sharding each half on its own (as 'packed_colwise')"
               if parts > 1 else "interleaved gate/up {w} with {s!r}; sharding it whole (as 'colwise': each gate "
               "stays beside its up)").format(w=what, s=style)
        warnings.warn(f"tplower: plan[{qual + '.' + pname!r}] shards the experts' {how}, which the experts' "
                      "forward needs", stacklevel=4)
    return {axis: f"S({info.dim})"}, None, parts


def expert_biases(module: nn.Module, entry: BoundaryEntry, form: BoundaryForm, axis: str
                  ) -> tuple[BoundaryEntry, dict[str, dict[str, str]]]:
    """``entry`` with the expert biases it leaves out placed after their weights, and the hidden-side uses.

    A gate/up bias (``gate_up_proj_bias [E, 2I]``) whose weight is split inside each expert on ``axis`` is
    split alike (dim 1, the weight's packing) where the entry does not place it. A hidden-side bias
    (``down_proj_bias``) of a module whose output is a partial sum is added by each rank's experts to their
    piece of the output, so the block's one reduction would count it ``n`` times: each rank adds its ``1/n``
    share instead (``{bias: {axis: "P(sum)"}}``, the second value; the parameter stays a whole ``R`` DTensor
    and its gradient arrives whole: :class:`tplower.runtime.params.ParamLayout`'s ``use``), unless the entry
    places it sharded on ``axis`` itself.
    """
    names = form.mesh_dim_names
    if axis not in names:
        return entry, {}
    i = names.index(axis)
    partial = any(isinstance(o.src[i], Partial) for o in form.outputs)
    params, packed, uses = dict(entry.params), dict(entry.packed), {}
    for name, p in module._parameters.items():
        info = expert_param(module, name, axis=axis) if name.endswith("_bias") else None
        if p is None or info is None:
            continue
        here = parse_spec(entry.params.get(name, {}), names, (axis,), f"params[{name!r}]")[i]
        weight = name[:-len("_bias")]
        w = parse_spec(entry.params.get(weight, {}), names, (axis,), f"params[{weight!r}]", tensor_ndim=3)[i]
        if info.dim is not None and name not in entry.params and isinstance(w, Shard) and w.dim in (1, 2):
            params[name] = {axis: "S(1)"}
            packed.update({name: entry.packed[weight]} if weight in entry.packed else {})
        elif info.dim is None and partial and isinstance(here, Replicate):
            uses[name] = {axis: "P(sum)"}
    if params == entry.params:
        return entry, uses
    return dataclasses.replace(entry, params=params, packed=packed), uses
