"""Plans: which placements each module of a model takes and gives.

A plan maps module names to boundary entries. Keys are exact fully
qualified names (``layers.0.mlp.down_proj``) or globs in which ``*`` is one
dotted component (``layers.*.mlp.down_proj``) and ``**`` any number of them;
an exact key wins over a glob. A value is either a style of the HF
transformers ``tp_plan`` vocabulary (``"colwise"``) or an entry mapping:

=================  =============================================================
field              meaning
=================  =============================================================
``in_src``         ``{input: placement}`` as the input arrives
``in_dst``         ``{input: placement}`` as the module's local compute needs it
``in_grad``        ``{input: placement}`` of the gradient the local compute
                   gives back (default below)
``out_src``        ``{output: placement}`` as the local compute makes it
``out_dst``        ``{output: placement}`` as the module gives it out
``out_grad``       ``{output: placement}`` of the gradient arriving there
                   (default: ``out_dst`` with ``P`` read as ``R``, DTensor's rule)
``out_names``      names of a tuple output, in order
``params``         ``{parameter: placement}``; ``*`` is every direct parameter
``param_grads``    ``{parameter: placement}`` of a parameter's local gradient
                   when it is partial (``P(sum)``: reduced in backward)
``local_attrs``    ``{attribute: "divide"}``: integer attributes divided by the
                   axis size at install (local head counts of attention)
``local_compute``  ``"package.module:function"`` run instead of ``forward`` as
                   ``function(module, *args, **kwargs)`` on local tensors
``deferred_bias``  parameter added once after the output reduction
``packed``         ``{parameter: k}``: the parameter packs ``k`` equal parts along
                   its shard dim (fused gate/up projections); each part is
                   sharded on its own, so every rank holds its piece of each
                   (DTensor ``_StridedShard(dim, split_factor=k)``)
``partial_tail``   the last ``k`` features of the output (an integer, or the name
                   of an attribute of the model's config) reach the model without
                   passing a sharded layer, so their gradient is partial: it is
                   all-reduced in backward (``R -> R`` with gradient ``P(sum)``;
                   the rotary part of multi-head latent attention's ``kv_a_proj``)
``masked_lookup``  input holding row indices into the ``weight`` rows this rank
                   holds (``S(0)``: a vocabulary-parallel embedding): indices
                   outside them look up row 0 and their output rows are zeroed,
                   so the local outputs are partial sums (Megatron's
                   ``VocabParallelEmbedding``)
``uneven``         names of inputs and outputs whose sharded dims may be uneven
                   (``torch.chunk`` pieces, e.g. a sequence of 5 on 2 ranks is
                   3 + 2): each call the ranks exchange the local sizes of the
                   dims the source placement shards (one small ``all_gather``
                   per sharding axis) to learn the global shape; a name is
                   both the input and the output of that name
``optional_inputs`` names of declared inputs a module's ``forward`` may lack:
                   for such a module they are dropped from the entry (a style
                   written for several forms of one module, e.g. experts that
                   take the routing weights or get them applied before)
``share``          names of outputs the local compute gives whole on every rank
                   inside a block whose output is reduced once by a sum (an
                   identity expert among tensor-parallel experts): each rank gives
                   ``1/n`` of it, ``n`` the axis size, so the sum counts it once;
                   the gradient is divided alike, this rank's share of a gradient
                   that the block's input reduces (transformers'
                   ``moe_identity_expert``)
``expert_dispatch`` the module attribute holding the number of experts: the
                   module is an expert-parallel experts block (its inputs
                   ``(tokens, top_k_index, top_k_weights)`` this rank's piece);
                   its compute dispatches each slot to the rank holding its
                   expert and combines the results (:mod:`tplower.runtime.experts`)
``style``          an HF style to start from; the other fields then merge
                   into it name by name
=================  =============================================================

A placement is a named mapping ``{"tp": "S(1)"}`` (a missing axis is ``R``)
or a comma list of canonical strings with one per mesh axis. An input is
named by its ``forward`` parameter name or by its position (``"0"`` is the
first argument however it is passed); an output by ``"out"`` (the output,
or its first element), a position, or a name of ``out_names``.

Default input gradient: ``P(sum)`` on every axis where the input's ``in_dst``
is ``R`` and the entry shards a parameter (a sharded weight gives each rank a
partial input gradient: Megatron's ``copy_to_tp_region``); elsewhere ``in_dst``
with ``P`` read as ``R``.
"""

from __future__ import annotations

import copy
import importlib
import json
import warnings
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

from ..core.language.placements import parse_placement
from ..core.support.errors import TPLowerError
from .keys import glob_regex, key_hint, matching_keys, unmatched_key_message
from .styles import HF_STYLES, PARAMETER_ONLY_STYLES, entry_from_style  # re-exported: they lived here

__all__ = [
    "ENTRY_FIELDS",
    "HF_STYLES",
    "BoundaryEntry",
    "PlanValue",
    "entry_from_style",
    "load_plan",
    "match_plan",
    "matching_keys",
    "plan_name",
    "resolve_entry",
    "style_kind",
]

PlacementSpec: TypeAlias = str | Mapping[str, str]
PlanValue: TypeAlias = str | Mapping[str, Any]

_MAP_FIELDS = ("in_src", "in_dst", "in_grad", "out_src", "out_dst", "out_grad", "params", "param_grads")
#: Every field an entry mapping may have.
ENTRY_FIELDS: tuple[str, ...] = _MAP_FIELDS + ("out_names", "local_attrs", "local_compute", "deferred_bias",
                                                "packed", "partial_tail", "masked_lookup", "uneven",
                                                "optional_inputs", "share", "expert_dispatch", "style")
_LOCAL_ATTR_RULES = ("divide",)
#: plans named by a string, in any case: the model's own (``"auto"``) and one derived from its modules
PLAN_NAMES: tuple[str, ...] = ("auto", "derive")


def plan_name(plan: object) -> str | None:
    """``"auto"`` or ``"derive"`` where ``plan`` is a ``str`` naming one of them in any case (``"Auto"``,
    ``"DERIVE"``), else ``None`` (a mapping, a ``Path``, or a string that is a plan file's path)."""
    if isinstance(plan, str) and plan.lower() in PLAN_NAMES:
        return plan.lower()
    return None


@dataclass(frozen=True)
class BoundaryEntry:
    """One module's declared boundary (see the module docstring for the fields).

    Placement values are kept as written (named mappings or comma lists);
    they are checked against a mesh's axis names by
    :func:`tplower.plans.forms.classify_boundary_form`. Treat the mappings as
    read-only.
    """

    in_src: Mapping[str, PlacementSpec] = field(default_factory=dict)
    in_dst: Mapping[str, PlacementSpec] = field(default_factory=dict)
    in_grad: Mapping[str, PlacementSpec] = field(default_factory=dict)
    out_src: Mapping[str, PlacementSpec] = field(default_factory=dict)
    out_dst: Mapping[str, PlacementSpec] = field(default_factory=dict)
    out_grad: Mapping[str, PlacementSpec] = field(default_factory=dict)
    out_names: tuple[str, ...] | None = None
    params: Mapping[str, PlacementSpec] = field(default_factory=dict)
    param_grads: Mapping[str, PlacementSpec] = field(default_factory=dict)
    local_attrs: Mapping[str, str] = field(default_factory=dict)
    local_compute: str | None = None
    deferred_bias: str | None = None
    packed: Mapping[str, int] = field(default_factory=dict)
    partial_tail: int | str | None = None
    masked_lookup: str | None = None
    uneven: tuple[str, ...] = ()
    optional_inputs: tuple[str, ...] = ()
    share: tuple[str, ...] = ()
    expert_dispatch: str | None = None
    style: str | None = None

    def input_names(self) -> tuple[str, ...]:
        """Declared inputs, in order of first mention (``in_src`` then ``in_dst``, ``in_grad``)."""
        return tuple(dict.fromkeys([*self.in_src, *self.in_dst, *self.in_grad]))

    def output_names(self) -> tuple[str, ...]:
        """Declared outputs, in order of first mention (``out_src`` then ``out_dst``, ``out_grad``)."""
        return tuple(dict.fromkeys([*self.out_src, *self.out_dst, *self.out_grad]))


# ---- schema ---------------------------------------------------------------------------------------------

def _check_placement(spec: Any, where: str) -> PlacementSpec:
    if isinstance(spec, str):
        for part in (p for p in spec.split(",") if p.strip()):
            parse_placement(part)
        return spec
    if isinstance(spec, Mapping):
        for axis, value in spec.items():
            if not isinstance(axis, str) or not isinstance(value, str):
                raise TPLowerError(f"{where}: {dict(spec)!r} must map axis names to placement strings")
            parse_placement(value)
        return dict(spec)
    raise TPLowerError(f"{where}: {spec!r} is not a placement; use {{'tp': 'S(1)'}} or 'S(1),R'")


def _check_map(value: Any, where: str) -> dict[str, PlacementSpec]:
    if not isinstance(value, Mapping):
        raise TPLowerError(f"{where}: {value!r} must be a mapping of names to placements")
    out = {}
    for name, spec in value.items():
        key = str(name)
        try:
            out[key] = _check_placement(spec, f"{where}[{key!r}]")
        except TPLowerError as exc:
            msg = str(exc)
            raise TPLowerError(msg if msg.startswith(where) else f"{where}[{key!r}]: {msg}") from None
    return out


def _check_fields(value: Mapping[str, Any], module: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, v in value.items():
        where = f"plan[{module!r}].{key}"
        if key in _MAP_FIELDS:
            out[key] = _check_map(v, where)
        elif key == "out_names":
            if isinstance(v, str) or not isinstance(v, Iterable) or not all(isinstance(n, str) for n in v):
                raise TPLowerError(f"{where}: {v!r} must be a list of output names")
            out[key] = tuple(v)
        elif key in ("uneven", "optional_inputs", "share"):  # YAML may write a position as a number
            if isinstance(v, str | bytes | Mapping) or not isinstance(v, Iterable) or not all(
                    isinstance(n, str) or (isinstance(n, int) and not isinstance(n, bool) and n >= 0) for n in v):
                raise TPLowerError(f"{where}: {v!r} must be a list of input and output names (or positions)")
            out[key] = tuple(str(n) for n in v)
        elif key == "local_attrs":
            if not isinstance(v, Mapping) or any(r not in _LOCAL_ATTR_RULES for r in v.values()):
                raise TPLowerError(f"{where}: {v!r} must map attribute names to one of {_LOCAL_ATTR_RULES}")
            out[key] = dict(v)
        elif key == "packed":
            if not isinstance(v, Mapping) or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 2
                                                     for k in v.values()):
                raise TPLowerError(f"{where}: {v!r} must map parameter names to a part count (an integer >= 2)")
            out[key] = {str(n): k for n, k in v.items()}
        elif key == "partial_tail":
            if not (isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool) and v > 0)):
                raise TPLowerError(f"{where}: {v!r} must be a positive integer or a config attribute name")
            out[key] = v
        elif key in ("local_compute", "deferred_bias", "masked_lookup", "expert_dispatch", "style"):
            if not isinstance(v, str):
                raise TPLowerError(f"{where}: {v!r} must be a string")
            out[key] = v
        else:
            raise TPLowerError(f"plan[{module!r}]: unknown field {key!r}; allowed: {', '.join(ENTRY_FIELDS)}")
    return out


def resolve_entry(value: PlanValue | BoundaryEntry, module: str = "?", *, kind: str = "linear",
                  axis: str = "tp") -> BoundaryEntry:
    """The :class:`BoundaryEntry` of one plan value.

    Args:
        value: an HF style string, an entry mapping (optionally with
            ``style``, whose fields the others merge into name by name), or
            an entry (returned as is).
        module: the module name, for messages.
        kind: the module kind an HF style is translated for (see :func:`entry_from_style`).
        axis: the mesh axis HF styles shard on.

    Raises:
        TPLowerError: a schema error; the message names the module, the
            field and the bad value.
    """
    if isinstance(value, BoundaryEntry):
        return value
    if isinstance(value, str):
        value = {"style": value}
    if not isinstance(value, Mapping):
        raise TPLowerError(f"plan[{module!r}]: {value!r} must be a style string or a mapping of entry fields")
    fields = _check_fields(value, module)
    style = fields.get("style")
    if style is not None:
        base = _check_fields(entry_from_style(style, kind, axis=axis, module=module), module)
        for key, v in fields.items():
            base[key] = {**base.get(key, {}), **v} if key in _MAP_FIELDS else v
        fields = base
    return BoundaryEntry(**fields)


def load_plan(source: Mapping[str, PlanValue] | str | Path) -> dict[str, PlanValue]:
    """Load and check a plan from a mapping or a ``.yaml``/``.yml``/``.json`` file.

    Every value is checked (an HF style as for a module kind it is defined
    for, ``nn.Linear`` where it is); the values are
    returned as written, since a style translates per module kind at install.

    Returns:
        ``{module name or glob: value}`` in the source's order.

    Raises:
        TPLowerError: an unreadable file, a top level that is not a mapping,
            a schema error (naming the module, the field and the value), or
            a plan name (``"auto"``, ``"derive"``, in any case) instead of a file.
        TypeError: ``source`` is neither a mapping nor a path.
    """
    if (name := plan_name(source)) is not None:
        raise TPLowerError(f"load_plan: {source!r} is the plan name {name!r}, built from a model ('auto': its own "
                           "tp_plan, 'derive': derived from its modules), not a file; parallelize, verify and "
                           "codegen.emit take it, load_plan reads a mapping or a YAML/JSON file")
    if isinstance(source, str | Path):
        path = Path(source)
        try:
            text = path.read_text()
        except OSError as exc:
            raise TPLowerError(f"plan file {str(path)!r} cannot be read: {exc}") from None
        try:
            if path.suffix.lower() == ".json":
                data = json.loads(text)
            else:
                yaml: Any = importlib.import_module("yaml")
                data = yaml.safe_load(text)
        except Exception as exc:  # json.JSONDecodeError / yaml.YAMLError: say which file
            kind = "JSON" if path.suffix.lower() == ".json" else "YAML"  # any other suffix is read as YAML
            raise TPLowerError(f"plan file {str(path)!r} is not valid {kind}: {exc}") from None
        if not isinstance(data, Mapping):
            raise TPLowerError(f"plan file {str(path)!r}: the top level must map module names to entries")
        source = data
    if not isinstance(source, Mapping):
        raise TypeError(f"plan must be a mapping or a path to a YAML/JSON file, got {type(source).__name__}")
    plan = {str(k): copy.deepcopy(v) for k, v in source.items()}
    for key, value in plan.items():
        _check_value(value, key)
    return plan


def style_kind(value: Any) -> str:
    """The module kind a plan value is read as without its module: ``"linear"`` where its style is defined
    for ``nn.Linear`` (or any module), else the first kind it is defined for (``conv1d_colwise``: ``"other"``)."""
    style = value if isinstance(value, str) else value.get("style") if isinstance(value, Mapping) else None
    if not isinstance(style, str) or style not in HF_STYLES:
        return "linear"
    kinds = [k for k, v in HF_STYLES[style].items() if not isinstance(v, str)]
    return "linear" if "linear" in kinds or "*" in kinds or not kinds else kinds[0]


def _check_value(value: Any, key: str) -> None:
    """Check a plan value without knowing its module's kind: the schema, and that a style is known."""
    if isinstance(value, str) and value in PARAMETER_ONLY_STYLES:
        return  # checked at install, on the parameter its key names (a module key is refused there)
    resolve_entry(value, key, kind=style_kind(value))


def match_plan(plan: Mapping[str, PlanValue], names: Iterable[str], *, strict: bool = False,
               owner: str = "the model", may_miss: Collection[str] = ()) -> dict[str, str]:
    """Which plan key governs each module name: ``{module name: plan key}``, in ``names`` order.

    An exact key wins over globs; a name matched by two globs and no exact
    key is an error. A key matching no name is an error with ``strict``, else
    a warning; both say what the model has there
    (:func:`tplower.plans.keys.unmatched_key_message`).

    Args:
        plan: ``{key: value}``.
        names: the qualified names keys may name (modules, and parameters).
        strict: a key naming nothing raises (default: warns).
        owner: the model's class name, for the message.
        may_miss: keys that may name nothing, silently (those a transformers
            model's own plan ships for layers its config may lack).

    Raises:
        TPLowerError: a name matched by several globs, a plan matching no name at all, or, with ``strict``, a
            key matching no name.
    """
    names = list(names)
    globs = {k: glob_regex(k) for k in plan if "*" in k}
    out: dict[str, str] = {}
    used: set[str] = set()
    for name in names:
        if name in plan and "*" not in name:
            out[name] = name
        else:
            hits = [k for k, rx in globs.items() if rx.fullmatch(name)]
            if len(hits) > 1:
                raise TPLowerError(f"module {name!r} matches plan keys {hits}; add an exact key for it")
            if not hits:
                continue
            out[name] = hits[0]
        used.add(out[name])
    if plan and not out:
        head = f"none of the plan's {len(plan)} keys {list(plan)[:5]} names a module of {owner}; " if len(plan) > 1 \
            else ""
        raise TPLowerError(head + unmatched_key_message(next(iter(plan)), names, owner))
    missed = [k for k in plan if k not in used and k not in may_miss]
    if missed and strict:
        more = f" (and {len(missed) - 1} more: {missed[1:6]})" if len(missed) > 1 else ""
        raise TPLowerError(f"{unmatched_key_message(missed[0], names, owner)}{more}; or pass strict=False to "
                           "leave keys that name nothing out with a warning")
    for key in missed:
        warnings.warn(f"tplower: plan key {key!r} matches no module; {key_hint(key, names)}", stacklevel=3)
    return out
