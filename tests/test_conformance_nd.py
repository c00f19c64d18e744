"""Conformance on 2-D and 3-D meshes, and random transitions (hypothesis), against DTensor.

The matrix: every src/dst pair from {R, S(0), S(1), P(sum), P(avg)} on each
axis of 2x2, 1x4, 4x1, 2x4 and 2x2x2 meshes (the other axes held at a fixed
placement), even and uneven shapes and dims smaller than the mesh, every
gradient DTensor accepts. CI runs the shapes and other-axis placements below,
and every other case of the 2x2 and 2x2x2 matrices; ``TPLOWER_FULL_MATRIX=1``
runs all of them and more of each.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tplower.conformance import Case, check_cases, failures, grads_for, one_axis_cases, summarize
from tplower.testing import run_threaded

PLACEMENTS = ("R", "S(0)", "S(1)", "P(sum)", "P(avg)")
FULL = os.environ.get("TPLOWER_FULL_MATRIX") == "1"

MESHES = {
    # mesh: (shapes, placements held on the other axes)
    # the even shapes of 2x2, 1x4, 4x1 and 2x4 run on 1-D meshes (test_conformance.py) in CI
    (2, 2): ([(4, 4, 2), (5, 3, 2), (1, 3, 1)] if FULL else [(5, 3, 2), (1, 3, 1)], ("R", "S(0)", "P(sum)")),
    (1, 4): ([(8, 4, 2), (9, 3, 2)] if FULL else [(9, 3, 2)], ("R", "S(0)")),
    (4, 1): ([(8, 4, 2), (3, 5, 1)] if FULL else [(3, 5, 1)], ("R", "S(1)")),
    (2, 4): ([(8, 8, 2), (9, 3, 1)] if FULL else [(9, 3, 1)], ("R", "S(0)") if FULL else ("R",)),
    (2, 2, 2): ([(4, 4, 2), (5, 3, 1)] if FULL else [(5, 3, 1)], ("R", "S(1)") if FULL else ("R",)),
}


def _world(mesh):
    size = 1
    for s in mesh:
        size *= s
    return size


@pytest.mark.parametrize("mesh", [m if m == (2, 2) else pytest.param(m, marks=pytest.mark.slow) for m in MESHES],
                         ids=["x".join(map(str, m)) for m in MESHES])  # 2x2 in CI; 1x4, 4x1, 2x4, 3-D: TPLOWER_SLOW=1
def test_each_axis_every_pair(mesh, conformance_counts):
    shapes, others = MESHES[mesh]
    cases = [c for axis in range(len(mesh)) for c in one_axis_cases(mesh, axis, PLACEMENTS, shapes, others)]
    if mesh == (2, 2):  # bfloat16 and strided inputs on an uneven shape
        cases += [Case(c.mesh_shape, c.global_shape, c.src, c.dst, c.grad, "bfloat16") for c in cases
                  if c.global_shape == (5, 3, 2) and c.grad is None]
        cases += [Case(c.mesh_shape, c.global_shape, c.src, c.dst, c.grad, contiguous=False) for c in cases
                  if c.global_shape == (5, 3, 2) and c.grad is None and c.dtype == "float32"]
    if not FULL and mesh in ((2, 2), (2, 2, 2)):  # every other case in CI; all of them with FULL
        cases = cases[::2]
    results = run_threaded(_world(mesh), check_cases, cases)
    summary = summarize(results)
    conformance_counts[f"{'x'.join(map(str, mesh))} mesh, each axis"] = summary
    assert not failures(results), "\n".join(failures(results)[:20])
    assert summary["cases"] == len(cases)


PLACEMENT_CHOICES = ["R", "S(0)", "S(1)", "S(-1)", "P"]


@st.composite
def random_cases(draw, mesh):
    cases = []
    for _ in range(12):
        ndim = draw(st.integers(2, 3))
        shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
        # One reduce op per tensor (sum/avg mixes: test_mixed_partials.py); sometimes another op for dst, where
        # P(x) -> P(y) on one axis is refused by both.
        ops = [draw(st.sampled_from(["sum", "avg", "max", "min"]))] * 2
        if draw(st.integers(0, 9)) == 0:
            ops[1] = draw(st.sampled_from(["sum", "avg", "max", "min"]))
        src = [p if p != "P" else f"P({ops[0]})" for p in (draw(st.sampled_from(PLACEMENT_CHOICES)) for _ in mesh)]
        dst = [p if p != "P" else f"P({ops[1]})" for p in (draw(st.sampled_from(PLACEMENT_CHOICES)) for _ in mesh)]
        grad = draw(st.sampled_from(grads_for(dst)))
        dtype = draw(st.sampled_from(["float32", "float64"]))
        cases.append(Case(mesh, shape, ",".join(src), ",".join(dst), grad, dtype))
    return cases


@pytest.mark.parametrize("mesh", [(2, 2), (4,), (2, 1, 2)], ids=["2x2", "4", "2x1x2"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_transitions_match_or_raise_documented_error(mesh, data, conformance_counts):
    cases = data.draw(random_cases(mesh))
    results = run_threaded(_world(mesh), check_cases, cases)
    assert not failures(results), "\n".join(failures(results)[:20])
    for r in results[0]:
        if r.status == "both_raise":  # tplower's refusal is its documented error
            assert "/ TPLowerError" in r.detail, r.detail
    label = f"random, mesh {'x'.join(map(str, mesh))}"
    prev = conformance_counts.get(label, {})
    conformance_counts[label] = {k: prev.get(k, 0) + v for k, v in summarize(results).items()}
