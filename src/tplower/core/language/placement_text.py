"""Placement strings read without torch: the syntax of :func:`tplower.core.language.placements.parse_placement`.

:mod:`tplower.core.language.placements` builds PyTorch's ``Shard``/``Replicate``/``Partial``
from these same patterns, so the command line can refuse a misspelled
placement before it imports torch, with the message the full parse gives.
"""

from __future__ import annotations

import re

from ..support.errors import TPLowerError
from ..support.words import count

__all__ = ["ALLOWED", "PARTIAL_RE", "REDUCE_OPS", "SHARD_RE", "check_placement_text", "check_placements_text"]

#: Reduce ops of ``Partial`` that tplower accepts (``torch.distributed.ReduceOp`` names as DTensor spells them).
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min")
#: ``S(d)`` with an integer ``d`` (group 1)
SHARD_RE = re.compile(r"S\((-?\d+)\)")
#: ``P(op)`` with a lower-case word ``op`` (group 1; checked against :data:`REDUCE_OPS`)
PARTIAL_RE = re.compile(r"P\(([a-z]+)\)")
#: the forms of one placement, as the error messages list them
ALLOWED = "'R', 'S(d)' with an integer d, or 'P(op)' with op in sum|avg|max|min"


def check_placement_text(text: str, *, arg: str = "placement") -> str:
    """One placement string (``R``, ``S(d)``, ``P(op)``; spaces around it allowed) -> its canonical text.

    Raises:
        TPLowerError: not one of the forms, or a ``Partial`` reduce op not in :data:`REDUCE_OPS`; the message
            names ``arg`` and the allowed forms (the same words as
            :func:`~tplower.core.language.placements.parse_placement`).
    """
    s = text.strip()
    if s == "R":
        return s
    if m := SHARD_RE.fullmatch(s):
        return f"S({int(m.group(1))})"
    if m := PARTIAL_RE.fullmatch(s):
        if m.group(1) not in REDUCE_OPS:
            raise TPLowerError(f"{arg}={text!r}: reduce op {m.group(1)!r} is not one of {', '.join(REDUCE_OPS)}")
        return s
    raise TPLowerError(f"{arg}={text!r} is not a valid placement; allowed: {ALLOWED}")


def check_placements_text(text: str, *, arg: str = "placements", ndim: int | None = None) -> tuple[str, ...]:
    """A comma list of placements, one per mesh axis (``"S(0),R"``) -> their canonical texts.

    Raises:
        TPLowerError: a bad placement (as :func:`check_placement_text`), or not ``ndim`` of them (when given).
    """
    parts = [p for p in (q.strip() for q in text.split(",")) if p] if text.strip() else []
    out = tuple(check_placement_text(p, arg=arg) for p in parts)
    if ndim is not None and len(out) != ndim:
        raise TPLowerError(
            f"{arg}={','.join(out)!r} has {count(len(out), 'placement')} but the mesh has {count(ndim, 'axis', 'axes')}"
        )
    return out
