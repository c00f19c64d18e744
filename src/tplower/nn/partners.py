"""Layers that must be split together: an attention's or an MLP's projections and the layer that consumes them.

Megatron's split of a transformer block is a pair: the projections that
open it (query/key/value, up and gate) ``colwise``, each rank computing its
``1/n`` of the output features, and the projection that closes it (the
attention's output, the MLP's down) ``rowwise``, taking exactly those
features and reducing once. A plan edited key by key can break the pair, and
the model then fails at its first forward on shapes that name no plan key
(``mat1 and mat2 shapes cannot be multiplied``). :func:`check_partners`
refuses such a plan while it is resolved (before any parameter is placed or
any collective issued), naming the modules and the keys that fix it:

* siblings split in part: some of one attention's query/key/value
  projections (or of an MLP's up and gate) ``colwise``, others unplanned
  or placed to give whole features (``rowwise``, gathered);
* a ``colwise`` projection whose split output reaches a consumer that takes
  whole features (the output or down projection unplanned, replicated or
  ``colwise``): add the ``rowwise`` partner, or make the output whole
  (``colwise_gather_output``, torch's ``use_local_output=False``);
* a ``rowwise`` consumer whose producers all give whole features (none of
  them split): split them ``colwise``, or let the consumer split its whole
  input (``rowwise_split_input``).

The groups are found by structure and name (:data:`tplower.plans.module_facts.QKV_NAMES`,
:data:`~tplower.plans.module_facts.ATTENTION_OUTPUTS`, :data:`~tplower.plans.module_facts.MLP_PAIRS`, as
:mod:`tplower.plans.derive` finds them, and Llama-style ``wq``/``wk``/``wv``/``wo``, ``w1``/``w3``/``w2``);
only ``nn.Linear`` members (or a LoRA layer's ``base_layer``) are read, and a group with a member placed in
a way these rules do not describe (sharded on another dim), or whose module runs a ``local_compute`` of the
plan, is left to the plan. An attention whose key and value projections are replicated on purpose (one
key/value head) is the plan's choice too.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..core.support.errors import TPLowerError
from ..plans.entries import BoundaryEntry
from ..plans.module_facts import ATTENTION_OUTPUTS, MLP_PAIRS, QKV_NAMES, glob, join
from ..runtime.params import ParamLayout

__all__ = ["QKV_SIBLINGS", "check_partners"]

#: an attention's query, key and value projections (children of one module); a fused projection (``qkv``,
#: ``c_attn``, ``query_key_value``) is one module and needs no check
QKV_SIBLINGS: tuple[tuple[str, str, str], ...] = (*QKV_NAMES, ("wq", "wk", "wv"), ("to_q", "to_k", "to_v"))
_OUTPUTS = (*ATTENTION_OUTPUTS, "wo")
_MLPS: tuple[tuple[tuple[str, ...], str], ...] = (*MLP_PAIRS, (("w1", "w3"), "w2"), (("w1",), "w2"))
_GATHER = "'colwise_gather_output' (torch's use_local_output=False)"

#: ``{module qual: {parameter: layout}}`` of the planned modules
Layouts = Mapping[str, Mapping[str, ParamLayout]]
#: what a projection with no declared output gives, by its weight's placement on the axis
_BY_WEIGHT = {str(Shard(0)): "split", str(Shard(1)): "rowwise", str(Replicate()): "replicated"}


class _Plan:
    """The planned modules' parameter layouts and entries, read on one axis."""

    def __init__(self, modules: Mapping[str, nn.Module], layouts: Layouts, entries: Mapping[str, BoundaryEntry],
                 axis: str) -> None:
        self.modules, self.layouts, self.entries, self.axis = modules, layouts, entries, axis

    def _linear(self, qual: str) -> tuple[str, Placement | None] | None:
        """``(qual of the nn.Linear, its weight's placement on the axis)`` (``None`` unplanned); ``None`` when
        ``qual`` is no ``nn.Linear`` (nor a LoRA layer around one)."""
        module = self.modules.get(qual)
        if not isinstance(module, nn.Linear):
            if not isinstance(getattr(module, "base_layer", None), nn.Linear):
                return None
            qual = f"{qual}.base_layer"
        lay = self.layouts.get(qual, {}).get("weight")
        if lay is None:
            return qual, None
        names = tuple(lay.mesh.mesh_dim_names or ())
        return qual, lay.placements[names.index(self.axis)] if self.axis in names else Replicate()

    def _declared(self, qual: str, side: str) -> Placement | None:
        entry = self.entries.get(qual)
        placed: Mapping[str, Mapping[str, Placement]] = getattr(entry, side, {}) if entry is not None else {}
        key = "out" if side == "out_dst" else ("0" if "0" in placed or len(placed) != 1 else next(iter(placed)))
        return placed.get(key, {}).get(self.axis)

    def gives(self, qual: str) -> str | None:
        """What the projection at ``qual`` gives: ``"split"`` (this rank's ``1/n`` of the output features), else
        whole features: ``"gathered"`` (colwise, its output gathered), ``"rowwise"`` (reduced),
        ``"replicated"`` (its weight whole on purpose), ``"unplanned"`` (the plan does not name it); ``None``:
        not read here (no ``nn.Linear``, or split another way)."""
        found = self._linear(qual)
        if found is None:
            return None
        qual, weight = found
        if weight is None:
            return "unplanned"
        out = self._declared(qual, "out_dst")
        if out is None:  # no declared output: the local result follows the weight (local_colwise, local_rowwise)
            return _BY_WEIGHT.get(str(weight))
        if isinstance(out, Shard):
            return "split" if out.dim == -1 else None
        if isinstance(out, Replicate | Partial):  # whole features
            return "gathered" if weight == Shard(0) else _BY_WEIGHT.get(str(weight))
        return None

    def takes(self, qual: str) -> str | None:
        """What the projection at ``qual`` takes: ``"split"`` input features, ``"whole"`` ones, ``None``."""
        found = self._linear(qual)
        if found is None:
            return None
        qual, weight = found
        if weight is None:
            return "whole"
        src = self._declared(qual, "in_src")
        if src is None:  # no declared input: local_rowwise takes the split features as they come
            return "split" if weight == Shard(1) else "whole"
        if isinstance(src, Shard):
            return "split" if src.dim == -1 else None
        return "whole" if isinstance(src, Replicate) else None


def _says(kind: str) -> str:
    return {"unplanned": "not in the plan", "replicated": "replicated", "gathered": "colwise with its output gathered",
            "rowwise": "rowwise (its output reduced whole)"}.get(kind, kind)


def _siblings(plan: _Plan, where: str, pre: str, names: tuple[str, ...], attention: bool) -> None:
    """Refuse producers of one group split in part (see the module docstring)."""
    kinds = {n: plan.gives(pre + n) for n in names}
    done = [n for n, k in kinds.items() if k == "split"]
    if not done or None in kinds.values():
        return
    missing = [n for n, k in kinds.items() if k == "unplanned"]
    if attention and missing:
        add = ", ".join(f"'{glob(pre + k)}': 'colwise'" for k in missing)
        raise TPLowerError(
            f"plan: attention {where!r} splits {done} over axis {plan.axis!r} but not its sibling projections "
            f"{missing} (each rank would hold heads / tp queries against every head's keys and values: "
            f"mismatched shapes in the attention); add {add} to the plan, or leave {done} whole")
    # an attention's key and value replicated on purpose (one key/value head) are the plan's choice
    kept = ("split", "replicated") if attention else ("split",)
    if other := [n for n, k in kinds.items() if k not in kept]:
        what = "; ".join(f"{n} {_says(str(kinds[n]))}" for n in other)
        fix = ", ".join(f"'{glob(pre + n)}': 'colwise'" for n in other)
        raise TPLowerError(
            f"plan: {'attention' if attention else 'MLP'} {where!r} splits {done} colwise over axis {plan.axis!r} "
            f"(each rank gives 1/tp of their output features) but its sibling projections give whole features "
            f"({what}): mismatched shapes where the model combines them; give them the same split ({fix}), or "
            f"leave {done} whole")


def _consumer(plan: _Plan, where: str, producers: list[str], consumer: str) -> None:
    """Refuse a consumer that takes what its producers do not give (see the module docstring)."""
    kinds = {p: plan.gives(p) for p in producers}
    takes = plan.takes(consumer)
    if None in kinds.values() or takes is None:
        return
    split = [repr(glob(p)) for p, k in kinds.items() if k == "split"]
    if split and takes == "whole":
        now = "is not in the plan" if plan.gives(consumer) == "unplanned" else "takes whole input features as placed"
        raise TPLowerError(
            f"plan: {', '.join(split)} {'is' if len(split) == 1 else 'are'} colwise over axis {plan.axis!r}: each "
            f"rank gives 1/tp of the output features, and that split output reaches {glob(consumer)!r}, which {now} "
            f"(mismatched shapes at its first forward); add '{glob(consumer)}': 'rowwise' (the colwise layer's "
            f"rowwise partner), or make the colwise output whole: {_GATHER} for {', '.join(split)}")
    if not split and takes == "split":
        what = "; ".join(f"{glob(p)} {_says(str(k))}" for p, k in kinds.items())
        fix = ", ".join(f"'{glob(p)}': 'colwise'" for p in producers)
        raise TPLowerError(
            f"plan: {glob(consumer)!r} in {where!r} is rowwise over axis {plan.axis!r}: it takes 1/tp of its input "
            f"features, but its producers give whole features ({what}); split them ({fix}), or let "
            f"{glob(consumer)!r} split its whole input: 'rowwise_split_input'")


def _attention(plan: _Plan, qual: str, kids: Mapping[str, nn.Module]) -> None:
    pre, where = f"{qual}." if qual else "", glob(qual) or "(root)"
    triple = next((t for t in QKV_SIBLINGS if all(k in kids for k in t)), None)
    if triple is None:
        return
    _siblings(plan, where, pre, triple, attention=True)
    out = next((pre + n for n in _OUTPUTS if n in kids), None)
    parent = qual.rpartition(".")[0]
    if out is None and join(parent, "output.dense") in plan.modules:  # BERT, ViT: the attention's output.dense
        out = join(parent, "output.dense")
    if out is not None:
        _consumer(plan, where, [pre + n for n in triple], out)


def _mlp(plan: _Plan, qual: str, kids: Mapping[str, nn.Module]) -> None:
    pre, where = f"{qual}." if qual else "", glob(qual) or "(root)"
    pair = next(((ups, down) for ups, down in _MLPS if all(n in kids for n in (*ups, down))), None)
    if pair is None and "intermediate" in kids and "output" in kids:  # BERT, ViT layers
        pair = ("intermediate.dense",), "output.dense"
    if pair is not None:
        _siblings(plan, where, pre, pair[0], attention=False)
        _consumer(plan, where, [pre + n for n in pair[0]], pre + pair[1])


def check_partners(model: nn.Module, layouts: Layouts, entries: Mapping[str, BoundaryEntry], axis: str) -> None:
    """Refuse a plan that breaks a colwise/rowwise pair of an attention or an MLP (see the module docstring).

    Args:
        model: the model, unchanged.
        layouts: ``{module qual: {parameter: layout}}`` of every planned module.
        entries: ``{module qual: entry}`` of every planned module, as resolved.
        axis: the tensor-parallel axis.

    Raises:
        TPLowerError: naming the group, the modules split and those that do not fit, and the plan keys (globs
            over layer indices) that fix it.
    """
    modules = dict(model.named_modules())
    plan = _Plan(modules, layouts, entries, axis)
    for qual, module in modules.items():
        entry = entries.get(qual)
        if entry is not None and entry.local_compute:  # its own forward runs: what it feeds where is its own
            continue
        kids = dict(module.named_children())
        _attention(plan, qual, kids)
        _mlp(plan, qual, kids)
