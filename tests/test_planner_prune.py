"""Which of ``plan_layout``'s candidates are traced (:class:`tplower.planner.prune.Bound`): whatever the peaks and
times, the pruned search picks what tracing every candidate would pick.

The candidates' outcomes are drawn (hypothesis) within what holds for real steps: in a group (one mesh, context
mode and experts choice) checkpointing and loss chunks add time, a variant without checkpointing holds more than
the leanest (checkpointing and loss chunks), and loss chunks add at most ``COST`` to a peak. The search is driven
as ``plan_layout`` drives it, tasks first in first out, and compared with the best of the whole table.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tplower.planner.prune import Bound
from tplower.planner.search import LayoutCandidate

MEMORY = 100
#: the most a group's loss chunks add to its peak (``plan_layout``'s is :func:`tplower.planner.search.chunk_cost`)
COST = 20
#: the four variants of a group: (checkpointing, loss chunks)
VARIANTS = [(False, None), (False, 64), (True, None), (True, 64)]


@st.composite
def _groups(draw: Any) -> list[tuple[LayoutCandidate, int, float]]:
    """Rows of 1-5 groups, of 2 variants (checkpointing or not) or 4 (and loss chunks or not), each row with its
    true (peak, seconds); peak 0: the whole group refused."""
    out = []
    for g in range(draw(st.integers(1, 5))):
        variants = VARIANTS if draw(st.booleans()) else [VARIANTS[0], VARIANTS[2]]
        refused = draw(st.integers(0, 9)) == 0
        lean = draw(st.integers(1, 200))  # (the last variant: checkpointing, and chunks where there are any)
        # chunks can save memory, or cost up to COST
        ck_only = draw(st.integers(max(1, lean - COST), 300)) if len(variants) == 4 else lean
        fast_s = draw(st.floats(1, 10))
        peaks = {(True, 64): lean, (True, None): ck_only}
        peaks[(False, 64)] = lean + draw(st.integers(0, 100))  # without checkpointing more is held
        peaks[(False, None)] = max(lean, ck_only) + draw(st.integers(0, 100))
        for ck, chunk in variants:
            row = LayoutCandidate({"dp": 2, "cp": g + 1}, ck, "ulysses", chunk, 1, 1)
            seconds = fast_s + (0 if (ck, chunk) == (False, None) else draw(st.floats(0, 5)))  # they add time
            out.append((row, 0 if refused else peaks[(ck, chunk)], seconds))
    return out


def _trace(row: LayoutCandidate, peak: int, seconds: float) -> None:
    """What ``plan_layout`` records of a traced candidate (``peak`` 0: refused)."""
    if not peak:
        row.reason = "refused"
        return
    row.peak_bytes, row.predicted_step_s, row.fits = peak, seconds, peak <= MEMORY


def _best(rows: list[LayoutCandidate]) -> float | None:
    """The pick's time (candidates as fast as the pick are equally good picks)."""
    fits = [r.predicted_step_s for r in rows if r.fits]
    return min(fits) if fits else None


@settings(max_examples=150, deadline=None)
@given(_groups())
def test_the_pruned_search_picks_what_tracing_everything_picks(table: list[tuple[LayoutCandidate, int, float]]) -> None:
    every = [LayoutCandidate(dict(r.mesh), r.checkpointing, r.context_mode, r.loss_chunk, 1, 1) for r, _, _ in table]
    for row, (_, peak, seconds) in zip(every, table, strict=True):
        _trace(row, peak, seconds)
    rows = [r for r, _, _ in table]
    bound = Bound(rows, MEMORY, True, lambda row: COST)
    waiting, traced = deque(bound.start), set()
    while waiting:
        i = waiting.popleft()
        assert i not in traced
        traced.add(i)
        _trace(rows[i], *table[i][1:])
        more, skipped = bound.after(i)
        assert not set(more) & traced and not set(skipped) & traced
        for j in skipped:
            assert rows[j].reason.startswith("not traced: ") and not rows[j].fits
        waiting.extend(more)
    assert _best(rows) == _best(every)
    # every candidate is traced or says why not
    assert all(i in traced or rows[i].reason.startswith("not traced: ") for i in range(len(rows)))


def test_a_group_slower_than_a_traced_fitting_candidate_is_left_out() -> None:
    """Hand-made: group B's leanest fits but its fastest does not, and the fastest is already slower than group
    A's fitting fastest; B's two other variants are not traced."""
    rows, truth = [], {}
    for cp, (lean_peak, fast_peak, fast_s) in ((1, (50, 60, 1.0)), (2, (50, 150, 3.0))):
        for ck, chunk in VARIANTS:
            row = LayoutCandidate({"cp": cp + 1}, ck, "ulysses", chunk, 1, 1)
            lean, fast = ck and chunk is not None, not ck and chunk is None
            truth[len(rows)] = (lean_peak if lean else fast_peak if fast else 120, fast_s + (0 if fast else 1))
            rows.append(row)
    bound = Bound(rows, MEMORY, True)
    waiting, traced = deque(bound.start), []
    while waiting:
        i = waiting.popleft()
        traced.append(i)
        _trace(rows[i], *truth[i])
        more, _ = bound.after(i)
        waiting.extend(more)
    # A: leanest (3), fastest (0) fits: done; B: leanest (7), fastest (4) does not fit, 3.0 s > A's 1.0 s: done
    assert traced == [3, 7, 0, 4]
    assert rows[5].reason.startswith("not traced: even cp3, ulysses takes 3 s, more than cp2, ulysses (1 s)")
