"""The layouts of one module's parameters under its entry, and the bias added once after a reduced output.

Which parameters an entry places and how (:func:`param_layouts`, with the
gradient placements of ``param_grads`` and the placement a replicated
parameter is used at), and which bias is added after a partial output is
reduced (:func:`deferred_bias`). Read at resolve time; nothing is changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import Partial, Shard

from ..core.language.placements import replicate_partials
from ..core.lower.redistribute import MeshLowerer
from ..core.support.errors import TPLowerError
from ..plans.entries import BoundaryEntry
from ..plans.forms import BoundaryForm, parse_spec
from ..runtime.params import ParamLayout, param_layout

__all__ = ["deferred_bias", "param_layouts"]


def _param_specs(module: nn.Module, specs: Mapping[str, Any], field: str, qual: str) -> dict[str, Any]:
    own = dict(module.named_parameters(recurse=False))
    out: dict[str, Any] = {}
    for name, spec in specs.items():
        if name == "*":
            out.update({n: spec for n in own if n not in specs})
        elif name in own:
            out[name] = spec
        elif name not in module._parameters:  # a declared but absent bias (None) is fine
            raise TPLowerError(f"plan[{qual!r}].{field}: module has no parameter {name!r}; it has {list(own)}")
    return out


def param_layouts(module: nn.Module, entry: BoundaryEntry, grads: Mapping[str, Any], lowerer: MeshLowerer,
                   axis: str, qual: str, uses: Mapping[str, Any] | None = None,
                   summed: tuple[str, ...] = ()) -> dict[str, ParamLayout]:
    """Each placed parameter's layout; a parameter named only in ``grads`` or ``uses`` is replicated.

    ``summed``: axes each gradient is summed over (context parallelism; :func:`tplower.runtime.params.param_layout`).
    ``uses``: ``{parameter: placement}`` the forward uses a replicated parameter's local value at (``P(sum)``: a
    hidden-side expert bias inside a block whose output is a partial sum,
    :func:`tplower.plans.expert_layout.expert_biases`).
    """
    places = _param_specs(module, entry.params, "params", qual)
    grad_specs = _param_specs(module, grads, "param_grads", qual)
    use_specs = dict(uses or {})
    out: dict[str, ParamLayout] = {}
    for name in dict.fromkeys([*places, *grad_specs, *use_specs]):
        p = module._parameters[name]
        assert p is not None
        where = f"plan[{qual!r}].params[{name!r}]"
        ps = parse_spec(places.get(name, {}), lowerer.names, (axis,), where, tensor_ndim=p.ndim)
        if any(isinstance(q, Partial) for q in ps):
            raise TPLowerError(f"{where}: a parameter cannot be Partial; use R or S(d)")
        g = None
        if name in grad_specs:
            g = parse_spec(grad_specs[name], lowerer.names, (axis,), f"plan[{qual!r}].param_grads[{name!r}]",
                           tensor_ndim=p.ndim)
            g = None if g == replicate_partials(g) else g
        packed = entry.packed.get(name, 1)
        if packed > 1 and not any(isinstance(q, Shard) for q in ps):
            raise TPLowerError(f"plan[{qual!r}].packed[{name!r}]: a packed parameter must be sharded (S(d))")
        use = None
        if name in use_specs:
            use = parse_spec(use_specs[name], lowerer.names, (axis,), f"plan[{qual!r}].params[{name!r}] use",
                             tensor_ndim=p.ndim)
        out[name] = param_layout(lowerer.mesh, ps, g, axis, packed, use, summed)
    return out


def deferred_bias(module: nn.Module, entry: BoundaryEntry, form: BoundaryForm, qual: str) -> str | None:
    """The bias a partial output adds once after its reduction (``bias`` by default), or ``None``.

    Raises:
        TPLowerError: an output that stays ``Partial`` while the module has a bias (added on every rank).
    """
    name = entry.deferred_bias
    partial_out = [o for o in form.outputs if any(isinstance(p, Partial) for p in o.src)]
    if name is None and partial_out and module._parameters.get("bias") is not None:
        if any(isinstance(p, Partial) for o in partial_out for p in o.dst):
            raise TPLowerError(f"module {qual!r}: its output stays Partial, so its bias would be added on every "
                               "rank; use a style that reduces the output (rowwise) or a module without bias")
        name = "bias"
    return name if name is not None and module._parameters.get(name) is not None else None
