"""Parameters and attributes of one module as :func:`tplower.parallelize` installs a plan entry on it.

Which parameters the entry places and how (:func:`_param_layouts`, with the
gradient placements of ``param_grads``), sharding them into DTensor
parameters once (:func:`_shard_params`, tied parameters shared),
``local_attrs`` divided (:func:`_localize_attrs`), and which bias is added
once after a partial output is reduced (:func:`_deferred_bias`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import Partial, Shard

from ..core.errors import TPLowerError
from ..core.placements import replicate_partials
from ..core.redistribute import MeshLowerer
from . import packed_checkpoint
from .boundaries import BoundaryForm, parse_spec
from .params import ParamLayout, check_plain_parameter, param_layout, shard_parameter
from .plans import BoundaryEntry

__all__: list[str] = []


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


def _param_layouts(module: nn.Module, entry: BoundaryEntry, grads: Mapping[str, Any], lowerer: MeshLowerer,
                   axis: str, qual: str, uses: Mapping[str, Any] | None = None) -> dict[str, ParamLayout]:
    """Each placed parameter's layout; a parameter named only in ``grads`` or ``uses`` is replicated.

    ``uses``: ``{parameter: placement}`` the forward uses a replicated parameter's local value at (``P(sum)``: a
    hidden-side expert bias inside a block whose output is a partial sum,
    :func:`tplower.nn.expert_layout.expert_biases`).
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
        out[name] = param_layout(lowerer.mesh, ps, g, axis, packed, use)
    return out


def _shard_params(module: nn.Module, layouts: Mapping[str, ParamLayout], qual: str,
                  seen: dict[int, tuple[ParamLayout, nn.Parameter, nn.Parameter]]) -> None:
    for name, layout in layouts.items():
        p = module._parameters[name]
        assert p is not None
        where = f"plan[{qual!r}].params[{name!r}]"
        if id(p) in seen:  # a shared (tied) parameter met again
            first, new, _ = seen[id(p)]
            if (first.mesh, first.placements) != (layout.mesh, layout.placements):
                raise TPLowerError(f"{where}: a shared parameter gets two placements")
            module._parameters[name] = new
        else:
            check_plain_parameter(p, f"module {qual!r}: parameter {name!r}")
            new = shard_parameter(p, layout, where)
            module._parameters[name] = new
            seen[id(p)] = (layout, new, p)  # the old object stays referenced, so its id is not reused
        if layout.packed > 1:  # DCP reads and writes it as one box per part
            packed_checkpoint.register(module, name)


def _localize_attrs(module: nn.Module, entry: BoundaryEntry, lowerer: MeshLowerer, axis: str, qual: str) -> None:
    n = lowerer.shape[lowerer.names.index(axis)] if axis in lowerer.names else 1
    for attr in entry.local_attrs:  # the only rule is "divide"
        value = getattr(module, attr, None)
        if not isinstance(value, int) or value % n:
            raise TPLowerError(f"plan[{qual!r}].local_attrs[{attr!r}]: {value!r} is not an integer that divides "
                               f"over {n} ranks of axis {axis!r}")
        setattr(module, attr, value // n)


def _deferred_bias(module: nn.Module, entry: BoundaryEntry, form: BoundaryForm, qual: str) -> str | None:
    name = entry.deferred_bias
    partial_out = [o for o in form.outputs if any(isinstance(p, Partial) for p in o.src)]
    if name is None and partial_out and module._parameters.get("bias") is not None:
        if any(isinstance(p, Partial) for o in partial_out for p in o.dst):
            raise TPLowerError(f"module {qual!r}: its output stays Partial, so its bias would be added on every "
                               "rank; use a style that reduces the output (rowwise) or a module without bias")
        name = "bias"
    return name if name is not None and module._parameters.get(name) is not None else None
