"""Refusals a plan meets on a model, before anything is changed: each names the module, the value and the fix.

Every check here reads the model, its entries and the mesh's names and sizes (the pairs of colwise and
rowwise layers: :mod:`tplower.nn.partners`);
:func:`tplower.nn.resolve.resolve_plan` runs them all before a parameter is
sharded or a hook installed, so a refused plan leaves the model as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import Partial, Shard

from ..core.lower.redistribute import MeshLowerer
from ..core.support.errors import TPLowerError
from ..plans.entries import BoundaryEntry
from ..plans.forms import BoundaryForm
from ..plans.heads import config_head_counts
from ..plans.schema import placements_of
from ..runtime.params import ParamLayout

__all__ = ["check_heads", "check_partial_input_grads", "check_uneven_names", "global_experts", "local_attr_values",
           "tail_size"]


def check_heads(model: nn.Module, entries: Mapping[str, BoundaryEntry], lowerer: MeshLowerer, axis: str) -> None:
    """Refuse a plan that splits attention projections over a tp that does not divide the model config's head
    counts (each rank must own whole query and key/value heads)."""
    counts = config_head_counts(model)
    if not counts or axis not in lowerer.names:
        return
    n = lowerer.shape[lowerer.names.index(axis)]
    bad = {k: v for k, v in counts.items() if v % n}
    if not bad:
        return
    split = [q for q, e in entries.items() if (".attn" in q or "attention" in q or "self_attn" in q) and any(
        isinstance(p, Shard) for spec in e.params.values() for p in placements_of(spec))]
    if not split:
        return
    ok = [d for d in range(1, max(counts.values()) + 1) if all(v % d == 0 for v in counts.values())]
    what = ", ".join(f"{k}={v}" for k, v in bad.items())
    raise TPLowerError(f"plan[{split[0]!r}]: the plan splits attention heads over {n} ranks of axis {axis!r}, but "
                       f"the model's {what} does not divide over {n}: each rank must own whole query and key/value "
                       f"heads; use a tp size among {ok}, or a plan that leaves attention replicated")


def check_uneven_names(entry: BoundaryEntry, form: BoundaryForm, qual: str) -> None:
    """Refuse ``uneven`` names that no declared input or output has."""
    declared = [op.name for op in form.inputs + form.outputs]
    if unknown := [n for n in entry.uneven if n not in declared]:
        raise TPLowerError(f"plan[{qual!r}].uneven: {unknown} name no declared input or output; the entry "
                           f"declares {declared}")


def global_experts(module: nn.Module, entry: BoundaryEntry, lowerer: MeshLowerer, axis: str, qual: str
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


def check_partial_input_grads(entry: BoundaryEntry, form: BoundaryForm, layouts: Mapping[str, ParamLayout],
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


def local_attr_values(module: nn.Module, entry: BoundaryEntry, lowerer: MeshLowerer, axis: str, qual: str
                      ) -> tuple[tuple[str, int], ...]:
    """Each ``local_attrs`` attribute with its value on one rank (the only rule is ``divide``).

    Raises:
        TPLowerError: a value that is not an integer dividing over the axis.
    """
    n = lowerer.shape[lowerer.names.index(axis)] if axis in lowerer.names else 1
    out = []
    for attr in entry.local_attrs:
        value = getattr(module, attr, None)
        if not isinstance(value, int) or value % n:
            raise TPLowerError(f"plan[{qual!r}].local_attrs[{attr!r}]: {value!r} is not an integer that divides "
                               f"over {n} ranks of axis {axis!r}")
        out.append((attr, value // n))
    return tuple(out)


def tail_size(value: int | str, config: Any, qual: str) -> int:
    """A ``partial_tail`` size: the integer, or the named positive integer of the model's (text) config."""
    if isinstance(value, int):
        return value
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, value, None)
    if not isinstance(size, int) or size <= 0:
        raise TPLowerError(f"plan[{qual!r}].partial_tail: the model's config has no positive integer {value!r}")
    return size
