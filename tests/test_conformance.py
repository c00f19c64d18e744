"""Conformance against DTensor: every enumerated transition, forward output and input gradient, every rank.

Enumerated, not hand-picked: every src/dst pair from {R, S(0), S(1), S(-1),
P(sum)} on a 1-D mesh, every gradient placement DTensor accepts for the
output, on even shapes, uneven shapes and shapes with a dim smaller than
the mesh (some ranks hold nothing); 2-D meshes where one axis changes. The
counts are printed at the end of the run.
"""

from __future__ import annotations

import functools
import os

import pytest

import tplower.core.lower.collectives as C
from tplower.conformance import Case, check_cases, failures, one_axis_cases, summarize
from tplower.core.lower import backends
from tplower.testing import run_processes, run_threaded

FULL = os.environ.get("TPLOWER_FULL_MATRIX") == "1"
PLACEMENTS_1D = ("R", "S(0)", "S(1)", "S(-1)", "P(sum)")
# On real processes the first failing case raises on its rank, and the harness ends the others within
# seconds (they may be waiting in a collective the failing rank never entered).
CHECK_CASES_FAIL_FAST = functools.partial(check_cases, fail_fast=True)


def shapes_for(world: int) -> list[tuple[int, ...]]:
    """Even, uneven (world*3+1) and smaller-than-mesh global shapes, 3-d so S(-1) is its own dim."""
    return [(2 * world, world, 2 * world), (3 * world + 1, 2 * world - 1, world + 1), (world - 1, 3, 1)]


def cases_1d(world: int) -> list[Case]:
    return list(one_axis_cases((world,), 0, PLACEMENTS_1D, shapes_for(world)))


def extra_dtype_cases(world: int) -> list[Case]:
    """bfloat16, float16, float64 and strided (non-contiguous) inputs on uneven shapes."""
    base = [c for c in cases_1d(world) if c.global_shape == shapes_for(world)[1] and c.grad is None]
    out = [Case(c.mesh_shape, c.global_shape, c.src, c.dst, c.grad, dtype) for c in base
           for dtype in ("bfloat16", "float16", "float64")]
    return out + [Case(c.mesh_shape, c.global_shape, c.src, c.dst, c.grad, contiguous=False) for c in base]


def check(results, counts, label):
    bad = failures(results)
    summary = summarize(results)
    counts[label] = summary
    assert not bad, "\n".join(bad[:20])
    return summary


def test_world2_gloo_processes(conformance_counts):
    cases = cases_1d(2) + extra_dtype_cases(2)
    results = run_processes(2, CHECK_CASES_FAIL_FAST, cases)
    summary = check(results, conformance_counts, "1-D world 2, gloo processes")
    assert summary["cases"] == len(cases) and summary["dtensor_fallback"] == 0


def test_world4_threaded(conformance_counts):
    cases = cases_1d(4) + extra_dtype_cases(4)
    summary = check(run_threaded(4, check_cases, cases), conformance_counts, "1-D world 4, threaded group")
    assert summary["cases"] == len(cases) and summary["dtensor_fallback"] == 0


@pytest.mark.slow  # world 4 runs threaded in the fast suite
def test_world4_gloo_processes_few(conformance_counts):
    cases = [Case((4,), (13, 3), s, d, g) for s, d, g in [
        ("S(0)", "R", None), ("S(0)", "R", "P(sum)"), ("P(sum)", "S(0)", None), ("S(0)", "S(1)", None),
        ("P(sum)", "R", None), ("R", "S(1)", None)]]
    check(run_processes(4, CHECK_CASES_FAIL_FAST, cases), conformance_counts, "1-D world 4, gloo processes")


@pytest.mark.parametrize("mesh", [(2, 2)], ids=["2x2"])
def test_2d_mesh_only_tp_changes(mesh, conformance_counts):
    # S(-1) on the tp axis of a 2-D mesh (every other pair: test_conformance_nd.py); all shapes with FULL
    shapes = [(4, 4, 2), (5, 3, 2), (1, 3, 1)] if FULL else [(5, 3, 2)]
    cases = list(one_axis_cases(mesh, 1, PLACEMENTS_1D, shapes, others=("R", "S(0)", "P(sum)")))
    summary = check(run_threaded(4, check_cases, cases), conformance_counts, f"{mesh} mesh, tp axis changes")
    assert summary["cases"] == len(cases)


_REAL_ALL_GATHER = C.all_gather


def _corrupt_all_gather(x, **kw):
    return _REAL_ALL_GATHER(x, **kw) + 1e-3


def test_oracle_catches_a_wrong_collective(monkeypatch):
    # Steps are bound when a mesh's program is first built, so patching before the run reaches them.
    monkeypatch.setattr(C, "all_gather", _corrupt_all_gather)
    cases = [Case((2,), (4, 3), "S(0)", "R"), Case((2,), (4, 3), "R", "S(0)")]
    results = run_threaded(2, check_cases, cases)
    statuses = [[r.status for r in per_rank] for per_rank in results]
    # forward of S(0)->R and backward of R->S(0) both run all_gather
    assert statuses == [["mismatch", "mismatch"], ["mismatch", "mismatch"]]


def test_minimal_backend_remaps_on_redistribute_path(monkeypatch, conformance_counts):
    # Pretend the threaded group has only all_reduce(sum/max/min) and all_gather natively:
    # reduce_scatter, all_to_all and avg take their remaps, and must still equal DTensor.
    monkeypatch.setitem(backends._CAPS, "threaded", C.backend_caps("a-backend-without-extras"))
    placements = ("R", "S(0)", "S(1)", "P(avg)", "P(max)", "P(min)")
    cases = list(one_axis_cases((4,), 0, placements, [(9, 3, 2)]))
    summary = check(run_threaded(4, check_cases, cases), conformance_counts, "1-D world 4, remapped collectives")
    assert summary["cases"] == len(cases)
