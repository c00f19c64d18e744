"""The keys a sliding window reaches under context parallelism (:mod:`tplower.context.window`), in one process.

Each rank's reach must be the keys some query of its tokens sees under a causal window (every pair of query and
key tried), and the plan of the all-gather mode's exchange, its sends routed by hand from holder to holder, must
leave each holder exactly those keys in global order: for the all-gather mode's ranks and the hybrid's groups (pieces
padded to the longest), group ranks in mesh order and reversed. The exchange against one process's gradients, and
its bytes, are in ``tests/test_context.py``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tplower.context.layout import SequenceLayout
from tplower.context.window import holder_keys, plan_window_keys

LAYOUTS = [(64, 2, True), (37, 2, False), (37, 3, True), (50, 4, True), (5, 2, True)]
WINDOWS = [1, 4, 9, 24, 100]


def _seen(layout: SequenceLayout, rank: int, window: int) -> set[int]:
    """Every key some query of ``rank`` sees: ``q - window < k <= q``, tried pair by pair."""
    queries = layout.global_index(rank).tolist()
    return {k for q in queries for k in range(layout.length) if q - window < k <= q}


@pytest.mark.parametrize("length,n,balance", LAYOUTS)
@pytest.mark.parametrize("window", WINDOWS)
def test_reach_is_every_key_a_query_of_the_rank_sees(length: int, n: int, balance: bool, window: int) -> None:
    layout = SequenceLayout(length, n, balance)
    for r in range(n):
        spans = layout.reach(r, window)
        assert all(a[1] < b[0] for a, b in itertools.pairwise(spans))  # disjoint, apart, ascending
        assert {k for lo, hi in spans for k in range(lo, hi)} == _seen(layout, r, window)


def _route(slots: list[torch.Tensor], plans: list, ranks: list[int], me: int) -> torch.Tensor:
    """What holder ``me`` ends with: its slots' positions, then each other holder's rows sent to it, by group rank."""
    order = sorted(range(len(slots)), key=lambda h: ranks[h])
    got = []
    for s in (h for h in order if h != me):
        at = 0
        for d in (h for h in order if h != s):
            rows = plans[s].matrix[ranks[s]][ranks[d]]
            if d == me:
                got.append(slots[s][plans[s].send[at:at + rows]])
            at += rows
    return torch.cat([slots[me], *got])


@pytest.mark.parametrize("length,n,balance", LAYOUTS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("holders,reverse", [(None, False), (None, True), (1, False)], ids=["ranks", "reversed",
                                                                                          "groups"])
def test_routed_sends_leave_each_holder_its_reach_in_order(length: int, n: int, balance: bool, window: int,
                                                           holders: int | None, reverse: bool) -> None:
    layout = SequenceLayout(length, n, balance)
    u = n // 2 if holders == 1 and n % 2 == 0 and n > 2 else 1  # groups of u ranks (the hybrid), else ranks
    count = n // u
    slots, needs = holder_keys(layout, window, count, padded=u > 1)
    ranks = list(range(count))[::-1] if reverse else list(range(count))
    plans = [plan_window_keys(slots, needs, h, length, ranks) for h in range(count)]
    if plans[0] is None:  # the windows reach every key, or a holder has none: all or none plan
        assert all(p is None for p in plans)
        every = set(range(length))
        assert any(not (s >= 0).any() for s in slots) or all(
            {k for lo, hi in needs[h] for k in range(lo, hi)} | set(slots[h].tolist()) >= every for h in range(count))
        return
    for h, plan in enumerate(plans):
        assert plan is not None
        reached = [k for lo, hi in needs[h] for k in range(lo, hi)]
        assert _route(slots, plans, ranks, h)[plan.take].tolist() == reached
        assert [plan.key_at(lo) + at for lo, _, at in plan.segments] == [lo for lo, _, _ in plan.segments]
        assert sum(plan.matrix[ranks[h]]) == plan.send.numel()
    moved = sum(map(sum, plans[0].matrix))  # fewer keys than the all-gather's: each holder every key it lacks
    assert moved < sum(length - int((s >= 0).sum()) for s in slots)
