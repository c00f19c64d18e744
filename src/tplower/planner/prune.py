"""Which of :func:`tplower.planner.plan_layout`'s candidates need tracing (:class:`Bound`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Bound", "gib"]


def gib(n: float) -> str:
    """``n`` bytes as ``"93.1 GiB"`` (or ``"5.00 MiB"`` below a tenth of a GiB)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.2f} MiB"


class Bound:
    """Which candidates of a group (one mesh, context mode and experts) need tracing: with ``on``, the leanest
    variant (checkpointing and loss chunks) first. If it does not fit, neither does a variant without checkpointing
    (those hold every layer's activations): they are left out and the other checkpointed ones traced. If it fits,
    the fastest (neither) next: if that fits too, the rest are left out (checkpointing and loss chunks add time:
    recomputation, more operator calls; none can be the pick); if it does not but is already slower than a
    candidate traced elsewhere that fits, so are the rest; else they are traced. Loss chunks do not always take
    memory away (a small vocabulary's chunks can cost more than they save), so a checkpointed variant is traced
    whenever the fastest does not fit, and the checkpointed one without chunks after a leanest that does not fit
    unless the leanest's peak exceeds the memory by more than chunks can add (``chunk_cost``).

    Args:
        rows: every :class:`~tplower.planner.search.LayoutCandidate` to trace, in order (indices below are into it).
        memory: bytes per rank.
        on: prune (else every candidate is traced: :attr:`start` is all of them).
        chunk_cost: the most bytes a row's loss chunks can add to its peak over the same row without them
            (:func:`tplower.planner.search.chunk_cost`); ``None``: any amount.

    Attributes:
        start: the candidates to trace first.
    """

    def __init__(self, rows: list[Any], memory: int, on: bool,
                 chunk_cost: Callable[[Any], float] | None = None) -> None:
        self.rows, self.memory, self.chunk_cost = rows, memory, chunk_cost
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault((tuple(r.mesh.items()), r.context_mode, r.experts), []).append(i)
        self.start: list[int] = []
        self.group: dict[int, tuple[int, int, list[int]]] = {}  # index -> (fastest, leanest, the others)
        for members in groups.values():
            fast = min(members, key=lambda i: (rows[i].checkpointing, rows[i].loss_chunk is not None))
            lean = max(members, key=lambda i: (rows[i].checkpointing, rows[i].loss_chunk is not None))
            if not on or fast == lean:
                self.start += members
                continue
            self.start.append(lean)
            self.group[fast] = self.group[lean] = (fast, lean, [i for i in members if i not in (fast, lean)])

    def best(self) -> Any:
        """The fastest candidate traced so far that fits, or ``None``."""
        fits = [r for r in self.rows if r.fits]
        return min(fits, key=lambda r: r.predicted_step_s) if fits else None

    def after(self, index: int) -> tuple[list[int], list[int]]:
        """``(to trace next, not traced)`` once candidate ``index`` is traced; the latter get their reason."""
        ends = self.group.get(index)
        if ends is None:
            return [], []
        fast, lean, others = self.rows[ends[0]], self.rows[ends[1]], ends[2]
        if index == ends[1]:  # the leanest
            rest = [ends[0], *others]
            if lean.fits:
                return [ends[0]], []  # the fastest next
            del self.group[ends[0]]  # (its outcome decides nothing more)
            if not lean.peak_bytes:  # not traced (refused, or failed): the others say why for themselves
                return rest, []
            why = f"not traced: {lean.label()} needs {gib(lean.peak_bytes)} > {gib(self.memory)}, and without " \
                  "checkpointing at least as much is held; plan_layout(prune=False) traces it"
            skip = [i for i in rest if not self.rows[i].checkpointing]
            cost = self.chunk_cost(lean) if self.chunk_cost is not None and lean.loss_chunk else None
            if cost is not None and lean.peak_bytes - cost > self.memory:  # nor the checkpointed one, chunks off
                for i in rest:
                    self.rows[i].reason = why if i in skip else \
                        f"not traced: {lean.label()} needs {gib(lean.peak_bytes)}, and without loss chunks at least " \
                        f"{gib(lean.peak_bytes - cost)} > {gib(self.memory)} is held (chunks add at most " \
                        f"{gib(cost)}); plan_layout(prune=False) traces it"
                return [], rest
        elif fast.fits:  # the fastest, traced because the leanest fits
            why = f"not traced: {fast.label()} fits ({gib(fast.peak_bytes)}) and is faster (checkpointing and " \
                  "loss chunks add time); plan_layout(prune=False) traces it"
            rest = skip = others
        elif (best := self.best()) is not None and fast.peak_bytes and fast.predicted_step_s > best.predicted_step_s:
            why = f"not traced: even {fast.label()} takes {fast.predicted_step_s:.3g} s, more than " \
                  f"{best.label()} ({best.predicted_step_s:.3g} s), which fits (checkpointing and loss chunks add " \
                  "time); plan_layout(prune=False) traces it"
            rest = skip = others
        else:
            return others, []
        for i in skip:
            self.rows[i].reason = why
        return [i for i in rest if i not in skip], skip
