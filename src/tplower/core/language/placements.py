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

One tensor may be ``Partial`` on several mesh axes. Its value is the
reduction over each of those axes in turn; that is one value whatever the
order only when the reductions commute, so the reduce ops may differ
between axes only within :data:`LINEAR_REDUCE_OPS` (``sum`` and ``avg``
are both linear: ``P(avg),P(sum)`` is the sum over one axis of the mean
over the other, either way round). :func:`check_reduce_ops` refuses any other
mix, as DTensor does (``assert_no_mixed_partial_types`` in torch 2.13).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..support.argcheck import check_int, check_names, check_placement_seq, describe
from ..support.errors import TPLowerError
from ..support.words import count
from .placement_text import ALLOWED as _ALLOWED
from .placement_text import PARTIAL_RE as _PARTIAL_RE
from .placement_text import REDUCE_OPS
from .placement_text import SHARD_RE as _SHARD_RE

__all__ = [
    "LINEAR_REDUCE_OPS",
    "REDUCE_OPS",
    "PlacementLike",
    "PlacementsLike",
    "check_reduce_ops",
    "format_placement",
    "format_placements",
    "parse_placement",
    "parse_placements",
    "replicate_partials",
]

#: The reduce ops that commute with each other (both linear), so one tensor may mix them across mesh axes.
LINEAR_REDUCE_OPS: tuple[str, ...] = ("sum", "avg")

PlacementLike: TypeAlias = Placement | str
PlacementsLike: TypeAlias = str | Sequence[PlacementLike] | Mapping[str, PlacementLike]



def parse_placement(text: PlacementLike, *, arg: str = "placement") -> Placement:
    """Parse one canonical placement string (``R``, ``S(d)``, ``P(op)``).

    Args:
        text: a canonical string, or a ``Shard``/``Replicate``/``Partial``,
            which is returned unchanged.
        arg: the argument name used in error messages.

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
        raise TypeError(f"{arg} must be a str or a Placement (strings: {_ALLOWED}), got {describe(text)}")
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
            raise TPLowerError(f"{arg}={text!r}: reduce op {op!r} is not one of {', '.join(REDUCE_OPS)}")
        return Partial(op)
    raise TPLowerError(f"{arg}={text!r} is not a valid placement; allowed: {_ALLOWED}")


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
    raise TypeError(f"format_placement: p must be a Shard, Replicate or Partial, got {describe(p)}")


def format_placements(placements: Sequence[Placement]) -> str:
    """Canonical comma list of a whole mesh's placements, e.g. ``S(0),R``.

    Raises:
        TypeError: ``placements`` is not a sequence of Shard/Replicate/Partial.
    """
    ps = check_placement_seq(placements, "placements", "format_placements")
    return ",".join(format_placement(p) for p in ps)


def check_reduce_ops(placements: Sequence[Placement], arg: str = "placements") -> None:
    """Refuse a tensor that is ``Partial`` with reduce ops whose order across mesh axes changes its value.

    Several axes may hold ``Partial`` with one reduce op, or with a mix of
    :data:`LINEAR_REDUCE_OPS` (``sum`` and ``avg`` commute); DTensor accepts
    exactly these mixes.

    Raises:
        TPLowerError: a mix that includes ``max`` or ``min`` (with each other
            or with ``sum``/``avg``); the message names ``arg`` and says why.
    """
    ops = sorted({p.reduce_op for p in placements if isinstance(p, Partial)})
    if len(ops) > 1 and not set(ops) <= set(LINEAR_REDUCE_OPS):
        raise TPLowerError(
            f"{arg}={format_placements(placements)!r} mixes Partial reduce ops {ops}: "
            f"{' and '.join(o for o in ops if o not in LINEAR_REDUCE_OPS)} does not commute with the other "
            "reductions, so the tensor's value would depend on the order its mesh axes are reduced in and has no "
            "single meaning; only sum and avg may be mixed across axes (both are linear), as in DTensor. "
            "Reduce the max/min axes to R first")


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
    if mesh_dim_names is not None:
        mesh_dim_names = check_names(mesh_dim_names, "mesh_dim_names", "parse_placements")
    check_int(ndim, "ndim", "parse_placements", optional=True)
    check_int(tensor_ndim, "tensor_ndim", "parse_placements", optional=True)
    if ndim is None and mesh_dim_names is not None:
        ndim = len(mesh_dim_names)
    if isinstance(spec, Mapping):
        if mesh_dim_names is None:
            raise TPLowerError(f"{arg}={dict(spec)!r}: named placements need mesh_dim_names")
        names = tuple(mesh_dim_names)
        for name in spec:
            if name not in names:
                raise TPLowerError(f"{arg}: mesh axis {name!r} is not in the mesh; the mesh's axes are {names}")
        out = tuple(parse_placement(spec[n], arg=f"{arg}[{n!r}]") if n in spec else Replicate() for n in names)
    elif isinstance(spec, str):
        out = tuple(parse_placement(part, arg=arg) for part in _split_list(spec))
    elif isinstance(spec, Sequence) and not isinstance(spec, bytes):
        out = tuple(parse_placement(p, arg=f"{arg}[{i}]") for i, p in enumerate(spec))
    else:
        raise TypeError(f"{arg} must be a str (e.g. 'S(0),R'), a sequence or a mapping of placements, "
                        f"got {describe(spec)}")
    if ndim is not None and len(out) != ndim:
        raise TPLowerError(
            f"{arg}={format_placements(out)!r} has {count(len(out), 'placement')} but the mesh has "
            f"{count(ndim, 'axis', 'axes')}"
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

    Raises:
        TypeError: ``placements`` is not a sequence of Placement objects.
    """
    placements = check_placement_seq(placements, "placements", "replicate_partials")
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
