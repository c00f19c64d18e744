"""Which of :func:`tplower.planner.plan_layout`'s candidates need tracing (:class:`Bound`)."""

from __future__ import annotations

from typing import Any

__all__ = ["Bound", "gib"]


def gib(n: float) -> str:
    """``n`` bytes as ``"93.1 GiB"`` (or ``"5.00 MiB"`` below a tenth of a GiB)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.2f} MiB"


class Bound:
    """Which candidates of a group (one mesh, context mode and experts) need tracing: with ``on``, the fastest
    variant (no checkpointing, no loss chunks) and the leanest (both) first, then the others unless the fastest
    fits (checkpointing and loss chunks add time: recomputation, more operator calls; none can be the pick) or,
    for those without checkpointing, the leanest does not (they hold every layer's activations). Loss chunks do
    not always take memory away (a small vocabulary's chunks can cost more than they save), so a checkpointed
    variant is traced whenever the fastest does not fit.

    Args:
        rows: every :class:`~tplower.planner.search.LayoutCandidate` to trace, in order (indices below are into it).
        memory: bytes per rank.
        on: prune (else every candidate is traced: :attr:`start` is all of them).

    Attributes:
        start: the candidates to trace first.
    """

    def __init__(self, rows: list[Any], memory: int, on: bool) -> None:
        self.rows, self.memory = rows, memory
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault((tuple(r.mesh.items()), r.context_mode, r.experts), []).append(i)
        self.start: list[int] = []
        self.group: dict[int, tuple[int, int, list[int]]] = {}  # index -> (fastest, leanest, the others)
        for members in groups.values():
            if not on or len(members) < 3:
                self.start += members
                continue
            fast = min(members, key=lambda i: (rows[i].checkpointing, rows[i].loss_chunk is not None))
            lean = max(members, key=lambda i: (rows[i].checkpointing, rows[i].loss_chunk is not None))
            ends = (fast, lean, [i for i in members if i not in (fast, lean)])
            self.start += [fast, lean]
            self.group[fast] = self.group[lean] = ends
        self.seen: set[int] = set()

    def after(self, index: int) -> tuple[list[int], list[int]]:
        """``(to trace next, not traced)`` once candidate ``index`` is traced; the latter get their reason."""
        self.seen.add(index)
        ends = self.group.get(index)
        if ends is None or not {ends[0], ends[1]} <= self.seen:
            return [], []
        fast, lean, others = self.rows[ends[0]], self.rows[ends[1]], ends[2]
        if fast.fits:
            why = f"not traced: {fast.label()} fits ({gib(fast.peak_bytes)}) and is faster (checkpointing and " \
                  "loss chunks add time); plan_layout(prune=False) traces it"
        elif lean.peak_bytes and not lean.fits:  # those without checkpointing hold every layer's activations
            why = f"not traced: {lean.label()} needs {gib(lean.peak_bytes)} > {gib(self.memory)}, and without " \
                  "checkpointing more is held; plan_layout(prune=False) traces it"
            skip = [i for i in others if not self.rows[i].checkpointing]
            for i in skip:
                self.rows[i].reason = why
            return [i for i in others if i not in skip], skip
        else:
            return others, []
        for i in others:
            self.rows[i].reason = why
        return [], others
