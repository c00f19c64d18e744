"""Which tokens of a sequence each rank of a context-parallel axis holds: pure arithmetic, no process group.

A sequence of ``S`` tokens is cut over the ``n`` ranks of the axis in
``torch.chunk`` pieces, as every shard in tplower is (uneven lengths work,
down to a rank with no token):

* ``balance=False``: ``n`` pieces, rank ``r`` holds piece ``r``;
* ``balance=True`` (head-tail, as PyTorch's ``context_parallel`` and Megatron
  balance causal attention): ``2n`` pieces, rank ``r`` holds pieces ``r`` and
  ``2n - 1 - r`` in that order, so every rank's queries see about the same
  number of earlier keys.

:class:`SequenceLayout` answers the questions the batch split, the gather and
the attention exchange ask: a rank's local length, the global index of each
of its tokens, and the order of the ranks' tokens laid end to end.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch.fx.experimental.sym_node import DynamicInt

from ..core.language.transitions import chunk_size_and_offset
from ..core.support.errors import TPLowerError

__all__ = ["SequenceLayout", "merge_spans"]


def merge_spans(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The union of half-open spans ``[lo, hi)`` as disjoint spans, ascending (touching spans joined; empty ones
    dropped)."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(s for s in spans if s[1] > s[0]):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


@dataclass(frozen=True)
class SequenceLayout:
    """The cut of a ``length``-token sequence over ``size`` ranks.

    Attributes:
        length: ``S``, the tokens of the whole sequence.
        size: ``n``, the ranks of the context-parallel axis.
        balance: head-tail pieces (``2n``, rank ``r`` holds ``r`` and ``2n-1-r``) or
            one piece per rank.

    Raises:
        TPLowerError: ``length`` below 0 or ``size`` below 1.
    """

    length: int
    size: int
    balance: bool = True

    def __post_init__(self) -> None:
        if self.length < 0 or self.size < 1:
            raise TPLowerError(f"SequenceLayout: length={self.length} and size={self.size} must be >= 0 and >= 1")

    def pieces(self, rank: int) -> tuple[tuple[int, int], ...]:
        """``(start, length)`` of each piece rank ``rank`` holds, in its local order."""
        firsts: tuple[int, ...]
        if self.balance:
            m = 2 * self.size
            firsts = (rank, m - 1 - rank)
        else:
            m, firsts = self.size, (rank,)
        out = []
        for i in firsts:
            n, start = chunk_size_and_offset(self.length, m, i)
            out.append((start, n))
        return tuple(out)

    def reach(self, rank: int, window: int) -> tuple[tuple[int, int], ...]:
        """The keys ``[lo, hi)`` (global positions, disjoint, ascending) that rank ``rank``'s queries can see through
        a causal sliding window of ``window`` keys: the query at ``q`` sees at most ``[q - window + 1, q]``, so a
        piece ``[a, b)`` reaches ``[a - window + 1, b)``; whatever documents or padding hide within it."""
        return merge_spans([(max(0, start - window + 1), start + n) for start, n in self.pieces(rank) if n])

    def local_length(self, rank: int) -> int:
        """How many tokens rank ``rank`` holds."""
        return sum(n for _, n in self.pieces(rank))

    def global_index(self, rank: int) -> torch.Tensor:
        """``[local_length(rank)]`` int64: the global position of each of rank ``rank``'s tokens, in local order."""
        parts = [torch.arange(start, start + n) for start, n in self.pieces(rank)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def symbolic(self) -> SequenceLayout:
        """This layout as a compiled forward reads it: its ``length`` and :attr:`lengths` are ``DynamicInt``
        (``torch.compile`` traces them as symbols from the first call, so one graph serves every length), its
        index tensors this layout's own (made once).

        Eager code keeps the plain layout: a ``DynamicInt``'s arithmetic runs in Python, about 100 times an int's.
        """
        twin = SequenceLayout(DynamicInt(self.length), self.size, self.balance)
        twin.__dict__["lengths"] = tuple(DynamicInt(n) for n in self.lengths)
        for name in ("order", "padded_order", "padded_source"):
            twin.__dict__[name] = getattr(self, name)
        return twin

    @cached_property
    def lengths(self) -> tuple[int, ...]:
        """Every rank's local length, by rank."""
        return tuple(self.local_length(r) for r in range(self.size))

    @cached_property
    def order(self) -> torch.Tensor:
        """``[S]`` int64: the global index of each token when the ranks' tokens are laid end to end, rank by rank."""
        return torch.cat([self.global_index(r) for r in range(self.size)])

    @cached_property
    def padded_order(self) -> torch.Tensor:
        """``[S]`` int64: where each global token sits when every rank's tokens are padded to the longest, end to end.

        Entry ``g`` is ``r * max(lengths) + i`` for the ``i``-th token of rank
        ``r`` holding global token ``g``: gathering padded pieces and then
        ``index_select`` with this gives the sequence in its own order.
        """
        width = max(self.lengths) if self.lengths else 0
        where = torch.empty(self.length, dtype=torch.int64)
        for r in range(self.size):
            idx = self.global_index(r)
            where[idx] = r * width + torch.arange(idx.numel())
        return where

    @cached_property
    def padded_source(self) -> torch.Tensor:
        """``[n * max(lengths)]`` int64: the global token each slot of the padded pieces laid end to end holds, or
        ``S`` for a padding slot; the inverse of :attr:`padded_order`.

        ``index_select`` with this on a sequence in its own order with one zero row appended (when some piece is
        padded) lays it out as the padded pieces, rank by rank.
        """
        width = max(self.lengths) if self.lengths else 0
        source = torch.full((width * self.size,), self.length, dtype=torch.int64)
        source[self.padded_order] = torch.arange(self.length)
        return source
