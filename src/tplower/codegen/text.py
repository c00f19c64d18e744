"""The comments :mod:`tplower.codegen.emit` writes above each operator call: transition, collectives, shapes, bytes.

For a move ``x: tp S(1) -> R, grad P(sum)`` on ``tp=2``::

    # x: tp S(1) -> R, grad P(sum)
    #   forward all_gather(dim=1) on tp: dim 1 s -> 2s; each rank receives 1/2 of the output
    #   backward reduce_scatter(dim=1, op=sum) on tp: dim 1 L -> L/2; each rank sends 1/2 of its input

Shapes are relative (``s`` a local size, ``L`` a full one): a forward is
written for every input shape. The share of bytes is the standard per-rank
traffic of each collective (ring ``all_reduce``: ``2(n-1)/n`` of the tensor;
``all_gather``: ``(n-1)/n`` of its output received; ``reduce_scatter`` and
``all_to_all``: ``(n-1)/n`` of the input sent), times the tensor's bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from torch.distributed.tensor.placement_types import Placement

from ..core.language.placements import format_placement, replicate_partials
from ..core.language.transitions import classify_axis
from ..plans.forms import op_text

__all__ = ["move_comment", "step_text"]


def _share(f: Fraction) -> str:
    return "all" if f == 1 else (f"{f.numerator}/{f.denominator}" if f < 1 else f"{float(f):g}x")


def step_text(src: Placement, dst: Placement, axis: str, n: int) -> str | None:
    """One axis's collective for ``src -> dst`` with its shape change and per-rank share; ``None`` if nothing moves.

    Example: ``step_text(Shard(1), Replicate(), "tp", 2)`` is
    ``all_gather(dim=1) on tp: dim 1 s -> 2s; each rank receives 1/2 of the output``.
    """
    kind, d, j, op = classify_axis(src, dst)
    if kind == "identity":
        return None
    name = f"{op_text(kind, d, j, op)} on {axis}"
    part = Fraction(n - 1, n)
    if kind == "all_gather":
        return f"{name}: dim {d} s -> {n}s; each rank receives {_share(part)} of the output"
    if kind == "all_reduce":
        return f"{name}: shape unchanged; each rank sends and receives {_share(2 * part)} of the tensor (ring)"
    if kind == "reduce_scatter":
        return f"{name}: dim {d} L -> L/{n}; each rank sends {_share(part)} of its input"
    if kind == "all_to_all":
        return f"{name}: dim {d} s -> {n}s, dim {j} L -> L/{n}; each rank sends {_share(part)} of its input"
    if kind == "chunk":
        return f"{name}: dim {d} L -> L/{n}; this rank's piece, nothing sent"
    return f"{name}: local only, nothing sent"


def move_comment(mv: Any, n: Mapping[str, int]) -> list[str]:
    """The comment lines for move ``mv`` (``name``, ``src``, ``dst``, ``grad``) on a mesh of axis sizes ``n``."""
    names = list(n)
    src: Sequence[Placement] = mv.src
    dst: Sequence[Placement] = mv.dst
    grad: Sequence[Placement] = mv.grad
    home, rep = replicate_partials(src), replicate_partials(dst)
    axes = [i for i in range(len(names)) if src[i] != dst[i] or grad[i] != rep[i]]
    head = f"{mv.name}: " + ", ".join(f"{names[i]} {format_placement(src[i])} -> {format_placement(dst[i])}"
                                      for i in axes)
    if any(grad[i] != rep[i] for i in axes):
        head += ", grad " + ", ".join(format_placement(grad[i]) for i in axes)
    lines = [head]
    fwd = [t for i in axes if (t := step_text(src[i], dst[i], names[i], n[names[i]])) is not None]
    bwd = [t for i in axes if (t := step_text(grad[i], home[i], names[i], n[names[i]])) is not None]
    lines += [f"  forward {t}" for t in fwd] or ["  forward: nothing moves"]
    lines += [f"  backward {t}" for t in bwd] or ["  backward: nothing moves"]
    return lines
