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
or a comma list of canonical strings with one per mesh axis. A plan is read once,
first (:func:`read_plan`): every placement string into PyTorch's ``Shard``/``Replicate``/``Partial``
(:mod:`tplower.plans.schema`), every style checked; the entries and forms every later stage takes hold
those types, never text. An input is
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

from ..core.support.errors import TPLowerError
from ..core.support.words import closest
from .keys import glob_regex, key_hint, matching_keys, unmatched_key_message
from .schema import ENTRY_FIELDS, MAP_FIELDS, Placed, PlacementSpec, is_read, read_fields, read_placement_map
from .styles import HF_STYLES, PARAMETER_ONLY_STYLES, check_style, entry_from_style  # re-exported: they lived here

__all__ = [
    "ENTRY_FIELDS",
    "HF_STYLES",
    "BoundaryEntry",
    "PlacementSpec",
    "PlanValue",
    "ReadValue",
    "entry_from_style",
    "load_plan",
    "match_plan",
    "matching_keys",
    "plan_name",
    "plan_source",
    "read_plan",
    "read_value",
    "resolve_entry",
    "style_kind",
]

PlanValue: TypeAlias = str | Mapping[str, Any]

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

    Placement values are read (:data:`tplower.plans.schema.Placed`): named mappings ``{"tp": Shard(1)}`` or
    tuples with one placement per mesh axis, PyTorch's types, checked against a mesh's axis names by
    :func:`tplower.plans.forms.classify_boundary_form`. An entry built with placement text
    (``in_src={"x": {"tp": "S(1)"}}``) reads it when it is made, so every entry holds placements, never
    text; a bad one raises :class:`~tplower.TPLowerError` naming the field. Treat the mappings as read-only.
    """

    in_src: Mapping[str, Placed] = field(default_factory=dict)
    in_dst: Mapping[str, Placed] = field(default_factory=dict)
    in_grad: Mapping[str, Placed] = field(default_factory=dict)
    out_src: Mapping[str, Placed] = field(default_factory=dict)
    out_dst: Mapping[str, Placed] = field(default_factory=dict)
    out_grad: Mapping[str, Placed] = field(default_factory=dict)
    out_names: tuple[str, ...] | None = None
    params: Mapping[str, Placed] = field(default_factory=dict)
    param_grads: Mapping[str, Placed] = field(default_factory=dict)
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

    def __post_init__(self) -> None:
        for name in MAP_FIELDS:  # text given to the constructor is read here, once
            value = getattr(self, name)
            if not (isinstance(value, Mapping) and all(is_read(spec) for spec in value.values())):
                object.__setattr__(self, name, read_placement_map(value, f"BoundaryEntry.{name}"))

    def input_names(self) -> tuple[str, ...]:
        """Declared inputs, in order of first mention (``in_src`` then ``in_dst``, ``in_grad``)."""
        return tuple(dict.fromkeys([*self.in_src, *self.in_dst, *self.in_grad]))

    def output_names(self) -> tuple[str, ...]:
        """Declared outputs, in order of first mention (``out_src`` then ``out_dst``, ``out_grad``)."""
        return tuple(dict.fromkeys([*self.out_src, *self.out_dst, *self.out_grad]))


@dataclass(frozen=True)
class ReadValue:
    """One plan value read (:func:`read_value`): the first stage of every plan, after which no text is parsed.

    Attributes:
        key: the plan key, for messages.
        style: the HF style the value names or starts from (checked known), else ``None``.
        fields: the value's own entry fields, read (placements typed; ``style`` left out).
        bare: the value is the style's name alone (a string, as a key naming a parameter takes).
        given: a :class:`BoundaryEntry` given as the value, taken as it is.
    """

    key: str
    style: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)
    bare: bool = False
    given: BoundaryEntry | None = None

    def entry(self, kind: str = "linear", axis: str = "tp") -> BoundaryEntry:
        """The :class:`BoundaryEntry` for a module of ``kind`` (see :func:`entry_from_style`) on ``axis``: the
        style's fields with the value's own merged into them name by name.

        Raises:
            TPLowerError: a style with no faithful translation for this kind of module (naming the key).
        """
        if self.given is not None:
            return self.given
        if self.style is None:
            return BoundaryEntry(**self.fields)
        base = read_fields(entry_from_style(self.style, kind, axis=axis, module=self.key), self.key)
        for name, v in self.fields.items():
            base[name] = {**base.get(name, {}), **v} if name in MAP_FIELDS else v
        return BoundaryEntry(**base, style=self.style)


def read_value(value: PlanValue | BoundaryEntry, key: str = "?") -> ReadValue:
    """Read one plan value once: an HF style string, an entry mapping (optionally with ``style``) or an entry.

    Raises:
        TPLowerError: a schema error or an unknown style; the message names the key, the field and the value
            as written.
    """
    if isinstance(value, BoundaryEntry):
        return ReadValue(key, value.style, given=value)
    if isinstance(value, str):
        if value not in PARAMETER_ONLY_STYLES:  # those are checked on the parameter a key names (at install)
            check_style(value, key)
        return ReadValue(key, value, bare=True)
    if not isinstance(value, Mapping):
        raise TPLowerError(f"plan[{key!r}]: {value!r} must be a style string or a mapping of entry fields")
    fields = read_fields(value, key)
    style = fields.pop("style", None)
    if style is not None:
        check_style(style, key)
    return ReadValue(key, style, fields)


def read_plan(plan: Mapping[str, PlanValue]) -> dict[str, ReadValue]:
    """Every value of ``plan`` read once (:func:`read_value`), keyed as written.

    Raises:
        TPLowerError: as :func:`read_value`.
    """
    return {str(k): read_value(v, str(k)) for k, v in plan.items()}


def resolve_entry(value: PlanValue | BoundaryEntry, module: str = "?", *, kind: str = "linear",
                  axis: str = "tp") -> BoundaryEntry:
    """The :class:`BoundaryEntry` of one plan value: :func:`read_value` then :meth:`ReadValue.entry`.

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
    return read_value(value, module).entry(kind, axis)


def load_plan(source: Mapping[str, PlanValue] | str | Path) -> dict[str, PlanValue]:
    """Load and check a plan from a mapping or a ``.yaml``/``.yml``/``.json`` file.

    Every value is checked by reading it (:func:`read_plan`: the schema, each placement, the style known); the
    values are returned as written, the plain mapping a user edits (a style translates per module kind at
    install).

    Returns:
        ``{module name or glob: value}`` in the source's order.

    Raises:
        TPLowerError: an unreadable file, a top level that is not a mapping,
            a schema error (naming the module, the field and the value), or
            a plan name (``"auto"``, ``"derive"``, in any case) instead of a file.
        TypeError: ``source`` is neither a mapping nor a path.
    """
    plan = plan_source(source)
    read_plan(plan)
    return plan


def plan_source(source: Mapping[str, PlanValue] | str | Path) -> dict[str, PlanValue]:
    """A plan's mapping as written, from a mapping or a YAML/JSON file, not yet read (keys as strings, values
    copied): :func:`load_plan` without the check, for a caller that reads the values itself (:func:`read_plan`).

    Raises:
        TPLowerError, TypeError: as :func:`load_plan`, less the schema errors.
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
            near = closest(str(source), PLAN_NAMES) if isinstance(source, str) and not path.suffix else ""
            raise TPLowerError(f"plan file {str(path)!r} cannot be read: {exc}{near}") from None
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
    return {str(k): copy.deepcopy(v) for k, v in source.items()}


def style_kind(value: Any) -> str:
    """The module kind a plan value is read as without its module: ``"linear"`` where its style is defined
    for ``nn.Linear`` (or any module), else the first kind it is defined for (``conv1d_colwise``: ``"other"``)."""
    style = value if isinstance(value, str) else value.get("style") if isinstance(value, Mapping) else None
    if not isinstance(style, str) or style not in HF_STYLES:
        return "linear"
    kinds = [k for k, v in HF_STYLES[style].items() if not isinstance(v, str)]
    return "linear" if "linear" in kinds or "*" in kinds or not kinds else kinds[0]


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
