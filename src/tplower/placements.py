"""Placements: PyTorch's own ``Shard``/``Replicate``/``Partial``, as strings.

Canonical strings (the form :func:`format_placement` writes and
:func:`parse_placement` reads back exactly):

==========  =========================================================
``R``       ``Replicate()``
``S(d)``    ``Shard(d)``; ``d`` may be negative until a tensor rank is
            known, then it is normalised to ``d + ndim`` (as DTensor does)
``P(op)``   ``Partial(op)`` with ``op`` one of ``sum``, ``avg``, ``max``,
            ``min``
==========  =========================================================

A whole mesh is a comma list (``"S(0),R"``), a sequence of placements or
strings, or a mapping from mesh axis name to placement
(``{"tp": "S(1)", "dp": "R"}``) in which a missing axis means ``R``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TypeAlias

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .errors import TPLowerError

__all__ = [
    "REDUCE_OPS",
    "PlacementLike",
    "PlacementsLike",
    "format_placement",
    "format_placements",
    "parse_placement",
    "parse_placements",
    "replicate_partials",
]

#: Reduce ops of ``Partial`` that tplower accepts (``torch.distributed.ReduceOp``
#: names as DTensor spells them).
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min")

PlacementLike: TypeAlias = Placement | str
PlacementsLike: TypeAlias = str | Sequence[PlacementLike] | Mapping[str, PlacementLike]

_SHARD_RE = re.compile(r"S\((-?\d+)\)")
_PARTIAL_RE = re.compile(r"P\(([a-z]+)\)")
_ALLOWED = "'R', 'S(d)' with an integer d, or 'P(op)' with op in sum|avg|max|min"


def parse_placement(text: PlacementLike) -> Placement:
    """Parse one canonical placement string (``R``, ``S(d)``, ``P(op)``).

    Args:
        text: a canonical string, or a ``Shard``/``Replicate``/``Partial``,
            which is returned unchanged.

    Returns:
        The PyTorch placement object.

    Raises:
        TPLowerError: the string is not one of the canonical forms, or the
            ``Partial`` reduce op is not in :data:`REDUCE_OPS`.
        TypeError: ``text`` is neither a string nor a placement.
    """
    if isinstance(text, Placement):
        return text
    if not isinstance(text, str):
        raise TypeError(f"placement must be a str or a Placement, got {type(text).__name__}: {text!r}")
    s = text.strip()
    if s == "R":
        return Replicate()
    m = _SHARD_RE.fullmatch(s)
    if m:
        return Shard(int(m.group(1)))
    m = _PARTIAL_RE.fullmatch(s)
    if m:
        op = m.group(1)
        if op not in REDUCE_OPS:
            raise TPLowerError(f"placement {text!r}: reduce op {op!r} is not one of {', '.join(REDUCE_OPS)}")
        return Partial(op)
    raise TPLowerError(f"placement {text!r} is not valid; allowed: {_ALLOWED}")


def format_placement(p: Placement) -> str:
    """Canonical string of one placement: ``R``, ``S(d)`` or ``P(op)``.

    Raises:
        TypeError: ``p`` is not a ``Shard``, ``Replicate`` or ``Partial``.
    """
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    raise TypeError(f"placement must be Shard, Replicate or Partial, got {p!r}")


def format_placements(placements: Sequence[Placement]) -> str:
    """Canonical comma list of a whole mesh's placements, e.g. ``S(0),R``."""
    return ",".join(format_placement(p) for p in placements)


def _split_list(text: str) -> list[str]:
    # A comma list; commas never occur inside a canonical placement.
    return [part for part in (p.strip() for p in text.split(",")) if part] if text.strip() else []


def parse_placements(
    spec: PlacementsLike,
    mesh_dim_names: Sequence[str] | None = None,
    *,
    ndim: int | None = None,
    tensor_ndim: int | None = None,
    arg: str = "placements",
) -> tuple[Placement, ...]:
    """Parse a whole mesh's placements into a tuple, one entry per mesh axis.

    Args:
        spec: a comma list (``"S(0),R"``), a sequence of placements or
            strings, or a mapping ``{axis name: placement}`` (missing axis
            means ``R``).
        mesh_dim_names: the mesh's axis names; needed for the mapping form.
        ndim: the mesh's number of axes; defaults to ``len(mesh_dim_names)``
            when names are given. The result must have this many entries.
        tensor_ndim: the tensor rank; when given, negative shard dims are
            normalised (``S(-1)`` on a 3-d tensor is ``S(2)``) and a dim out
            of ``[-tensor_ndim, tensor_ndim)`` raises.
        arg: the argument name used in error messages.

    Returns:
        ``tuple[Placement, ...]`` of length ``ndim`` (or of the spec's own
        length when neither ``ndim`` nor names are known).

    Raises:
        TPLowerError: a bad placement, an axis name not in the mesh, a
            mapping without mesh names, a wrong number of placements, or a
            shard dim out of range.
        TypeError: ``spec`` is of an unsupported type.
    """
    if ndim is None and mesh_dim_names is not None:
        ndim = len(mesh_dim_names)
    if isinstance(spec, Mapping):
        if mesh_dim_names is None:
            raise TPLowerError(f"{arg}={dict(spec)!r}: named placements need mesh_dim_names")
        names = tuple(mesh_dim_names)
        for name in spec:
            if name not in names:
                raise TPLowerError(f"{arg}: mesh axis {name!r} is not in the mesh; the mesh's axes are {names}")
        out = tuple(parse_placement(spec[n]) if n in spec else Replicate() for n in names)
    elif isinstance(spec, str):
        out = tuple(parse_placement(part) for part in _split_list(spec))
    elif isinstance(spec, Sequence):
        out = tuple(parse_placement(p) for p in spec)
    else:
        raise TypeError(f"{arg} must be a str, a sequence or a mapping of placements, got {type(spec).__name__}")
    if ndim is not None and len(out) != ndim:
        raise TPLowerError(
            f"{arg}={format_placements(out)!r} has {len(out)} placement(s) but the mesh has {ndim} axis(es)"
        )
    if tensor_ndim is not None:
        out = tuple(_normalize_dim(p, tensor_ndim, arg) for p in out)
    return out


def _normalize_dim(p: Placement, tensor_ndim: int, arg: str) -> Placement:
    if not isinstance(p, Shard):
        return p
    d = p.dim
    if not -tensor_ndim <= d < tensor_ndim:
        raise TPLowerError(
            f"{arg}: shard dim {d} is out of range for a {tensor_ndim}-d tensor "
            f"(allowed {-tensor_ndim}..{tensor_ndim - 1})"
        )
    return Shard(d + tensor_ndim) if d < 0 else p


def replicate_partials(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """Every ``Partial`` read as ``Replicate``; other placements unchanged.

    This is both the default gradient placement of an output (the gradient
    of a partial sum is the full gradient on every rank; DTensor's
    ``to_local`` default in torch 2.13) and the placement a gradient is
    moved back to in backward (DTensor's ``Redistribute.backward`` rule).
    """
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
