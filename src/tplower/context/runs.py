"""Which keys each query of a batch sees, as runs of causal or full attention: no whole-sequence mask.

transformers' masks for the batches people train on have a structure that
needs no ``[S, S]`` tensor. Per row of the batch, with ``attention_mask`` and
``position_ids`` as one process reads them
(``transformers.masking_utils.create_causal_mask`` without a cache):

* no ``attention_mask``: the documents are the runs of position ids that go up
  by one (a new document wherever they do not: ``find_packed_sequence_indices``);
  each token sees the tokens of its own document up to itself;
* an ``attention_mask`` whose ones are one contiguous span ``[v0, v1)`` (left
  padding, right padding or both): the tokens of the span see the span up to
  themselves; a padding token before the span sees no key (its row is fully
  masked: ``sdpa`` gives zeros, as one process's kernel does); a padding token
  after it sees the whole span.

Each such rule is a :class:`Run` of query positions ``[start, stop)`` with
keys from ``key_start``: ``causal`` (each query sees the keys up to its own
position) or full (every key of ``[key_start, key_stop)``). The kernel then
runs once per run with no mask, ``is_causal`` or not: the flash path of
``sdpa`` at ``O(S)`` memory. A mask of any other shape (ones with holes) has
no runs here (:func:`batch_runs` returns ``None``) and keeps the dense mask.
Rows with the same runs share one kernel call.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

__all__ = ["Run", "batch_runs", "clip", "windowed"]


@dataclass(frozen=True)
class Run:
    """Queries ``[start, stop)`` of the batch rows ``rows`` and the keys they see (global positions).

    Attributes:
        rows: the batch rows this run holds for, ascending.
        start, stop: the query positions.
        key_start, key_stop: the keys: ``causal`` runs see ``[key_start, q]`` for the query at ``q``
            (``key_stop == stop``); full runs see all of ``[key_start, key_stop)``.
        causal: whether each query sees only the keys up to its own position.
        window: a sliding window of this many keys (``None``: none): the query at ``q`` sees only keys after
            ``q - window``, itself included (transformers' causal sliding mask, ``q - k < window``).
    """

    rows: tuple[int, ...]
    start: int
    stop: int
    key_start: int
    key_stop: int
    causal: bool
    window: int | None = None


_Span = tuple[int, int, int, int, bool]


def _documents(positions: torch.Tensor) -> list[_Span]:
    """One causal span per document of a row: the runs of position ids that go up by one."""
    s = positions.shape[0]
    cuts = (torch.nonzero(positions[1:] - positions[:-1] != 1).view(-1) + 1).tolist()
    bounds = [0, *cuts, s]
    return [(a, b, a, b, True) for a, b in itertools.pairwise(bounds) if b > a]


def _padding(valid: torch.Tensor) -> list[_Span] | None:
    """The spans of a row whose attended tokens are ``valid``; ``None`` when they are not one contiguous span."""
    where = torch.nonzero(valid).view(-1)
    if not where.numel():
        return []  # every query's row is fully masked
    v0, v1 = int(where[0]), int(where[-1]) + 1
    if v1 - v0 != where.numel():
        return None
    spans: list[_Span] = [(v0, v1, v0, v1, True)]
    if v1 < valid.shape[0]:
        spans.append((v1, valid.shape[0], v0, v1, False))  # padding after the span sees all of it
    return spans


def batch_runs(position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[Run, ...] | None:
    """The runs of a causal batch, rows with the same span merged; ``None`` when a row's mask has no runs.

    Args:
        position_ids: ``[B, S]`` every token's position (as :func:`tplower.shard_sequence` keeps them whole).
        attention_mask: ``[B, S]`` the padding mask (nonzero: attended), or ``None``.

    Returns:
        The runs, ordered by their first row and start; queries no run covers see no key.
    """
    rows: dict[_Span, list[int]] = {}
    for b in range(position_ids.shape[0]):
        spans = _documents(position_ids[b].cpu()) if attention_mask is None else \
            _padding(attention_mask[b].cpu() != 0)
        if spans is None:
            return None
        for span in spans:
            rows.setdefault(span, []).append(b)
    runs = [Run(tuple(r), *span) for span, r in rows.items()]
    return tuple(sorted(runs, key=lambda r: (r.rows[0], r.start)))


def clip(runs: tuple[Run, ...], lo: int, hi: int) -> list[Run]:
    """The runs restricted to queries ``[lo, hi)`` (keys unchanged but for a causal run's end), empty ones dropped."""
    out = []
    for r in runs:
        start, stop = max(r.start, lo), min(r.stop, hi)
        if stop > start:
            out.append(Run(r.rows, start, stop, r.key_start, stop if r.causal else r.key_stop, r.causal, r.window))
    return out


def windowed(runs: tuple[Run, ...], window: int) -> tuple[Run, ...]:
    """``runs`` seen through a sliding window of ``window`` keys (:attr:`Run.window`)."""
    return tuple(Run(r.rows, r.start, r.stop, r.key_start, r.key_stop, r.causal, window) for r in runs)
