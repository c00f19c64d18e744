"""An entry's fields read once: the schema checked and every placement turned from text into PyTorch's types.

A plan is written as text (``{"tp": "S(1)"}``, ``"S(0),R"``); it is read here, once, into the values every
later stage takes (:data:`Placed`: ``{"tp": Shard(1)}`` or ``(Shard(0), Replicate())``), so no stage after
reading parses a placement string again. A reading error names the plan key, the field and the text as written
(``plan['layers.*.mlp.up'].in_src['0']: placement='S(x)' is not a valid placement; ...``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeAlias

from torch.distributed.tensor.placement_types import Placement

from ..core.language.placements import parse_placement
from ..core.support.errors import TPLowerError

__all__ = ["ENTRY_FIELDS", "MAP_FIELDS", "Placed", "PlacementSpec", "is_read", "placements_of", "read_fields",
           "read_placement", "read_placement_map"]

#: a placement as a plan writes it: a comma list with one per mesh axis, or ``{axis name: placement}``
PlacementSpec: TypeAlias = str | Mapping[str, str]
#: a placement read: one per mesh axis in order, or ``{axis name: placement}`` (a missing axis is ``R``)
Placed: TypeAlias = tuple[Placement, ...] | Mapping[str, Placement]

#: the fields that map input, output or parameter names to placements
MAP_FIELDS: tuple[str, ...] = ("in_src", "in_dst", "in_grad", "out_src", "out_dst", "out_grad", "params",
                               "param_grads")
#: Every field an entry mapping may have.
ENTRY_FIELDS: tuple[str, ...] = MAP_FIELDS + ("out_names", "local_attrs", "local_compute", "deferred_bias",
                                              "packed", "partial_tail", "masked_lookup", "uneven",
                                              "optional_inputs", "share", "expert_dispatch", "style")
_LOCAL_ATTR_RULES = ("divide",)


def is_read(spec: object) -> bool:
    """``spec`` is a read placement (:data:`Placed`): a tuple of placements, or a mapping of axis names to them."""
    if isinstance(spec, tuple):
        return all(isinstance(p, Placement) for p in spec)
    return isinstance(spec, Mapping) and all(isinstance(a, str) and isinstance(p, Placement) for a, p in spec.items())


def placements_of(spec: Placed) -> tuple[Placement, ...]:
    """The placements a read spec holds, on whichever axes (a named one's values, in the order written)."""
    return tuple(spec.values()) if isinstance(spec, Mapping) else spec


def read_placement(spec: Any, where: str) -> Placed:
    """One placement of an entry read: a comma list (``"S(0),R"``) into a tuple, ``{axis: text}`` into
    ``{axis: Placement}``; a value already read is returned as a fresh tuple or dict of the same placements.

    Raises:
        TPLowerError: a bad placement (the message gives the text; :func:`read_placement_map` puts ``where``
            before it), or a value that is no placement, naming ``where``.
    """
    if isinstance(spec, str):
        return tuple(parse_placement(part) for part in spec.split(",") if part.strip())
    if isinstance(spec, Mapping):
        out: dict[str, Placement] = {}
        for axis, value in spec.items():
            if not isinstance(axis, str) or not isinstance(value, str | Placement):
                raise TPLowerError(f"{where}: {dict(spec)!r} must map axis names to placement strings")
            out[axis] = value if isinstance(value, Placement) else parse_placement(value)
        return out
    if isinstance(spec, Sequence) and not isinstance(spec, bytes) and all(isinstance(p, Placement) for p in spec):
        return tuple(spec)
    raise TPLowerError(f"{where}: {spec!r} is not a placement; use {{'tp': 'S(1)'}} or 'S(1),R'")


def read_placement_map(value: Any, where: str) -> dict[str, Placed]:
    """A field mapping names to placements read (:func:`read_placement`), keys as strings.

    Raises:
        TPLowerError: not a mapping, or a bad placement: ``where[name]: ...`` and the text as written.
    """
    if not isinstance(value, Mapping):
        raise TPLowerError(f"{where}: {value!r} must be a mapping of names to placements")
    out = {}
    for name, spec in value.items():
        key = str(name)
        try:
            out[key] = read_placement(spec, f"{where}[{key!r}]")
        except TPLowerError as exc:
            msg = str(exc)
            raise TPLowerError(msg if msg.startswith(where) else f"{where}[{key!r}]: {msg}") from None
    return out


def _names(v: Any, where: str) -> tuple[str, ...]:
    # YAML may write a position as a number
    if isinstance(v, str | bytes | Mapping) or not isinstance(v, Iterable) or not all(
            isinstance(n, str) or (isinstance(n, int) and not isinstance(n, bool) and n >= 0) for n in v):
        raise TPLowerError(f"{where}: {v!r} must be a list of input and output names (or positions)")
    return tuple(str(n) for n in v)


def _read_field(key: str, v: Any, where: str) -> Any:
    if key in MAP_FIELDS:
        return read_placement_map(v, where)
    if key == "out_names":
        if isinstance(v, str) or not isinstance(v, Iterable) or not all(isinstance(n, str) for n in v):
            raise TPLowerError(f"{where}: {v!r} must be a list of output names")
        return tuple(v)
    if key in ("uneven", "optional_inputs", "share"):
        return _names(v, where)
    if key == "local_attrs":
        if not isinstance(v, Mapping) or any(r not in _LOCAL_ATTR_RULES for r in v.values()):
            raise TPLowerError(f"{where}: {v!r} must map attribute names to one of {_LOCAL_ATTR_RULES}")
        return dict(v)
    if key == "packed":
        if not isinstance(v, Mapping) or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 2
                                                 for k in v.values()):
            raise TPLowerError(f"{where}: {v!r} must map parameter names to a part count (an integer >= 2)")
        return {str(n): k for n, k in v.items()}
    if key == "partial_tail":
        if not (isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool) and v > 0)):
            raise TPLowerError(f"{where}: {v!r} must be a positive integer or a config attribute name")
        return v
    if not isinstance(v, str):  # local_compute, deferred_bias, masked_lookup, expert_dispatch, style
        raise TPLowerError(f"{where}: {v!r} must be a string")
    return v


def read_fields(value: Mapping[str, Any], module: str) -> dict[str, Any]:
    """An entry mapping's fields checked against the schema and read (placements typed), in the order written.

    Raises:
        TPLowerError: an unknown field, or a field's value off the schema; the message names the plan key
            (``module``), the field and the value as written.
    """
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key not in ENTRY_FIELDS:
            raise TPLowerError(f"plan[{module!r}]: unknown field {key!r}; allowed: {', '.join(ENTRY_FIELDS)}")
        out[key] = _read_field(key, v, f"plan[{module!r}].{key}")
    return out
