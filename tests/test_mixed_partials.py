"""A tensor Partial over several mesh axes with different reduce ops, against DTensor.

``sum`` and ``avg`` are both linear, so a tensor may be ``P(avg)`` on one axis
and ``P(sum)`` on another (DTensor accepts it: ``assert_no_mixed_partial_types``
in torch 2.13); with ``max`` or ``min`` the order of the reductions changes the
value, and both refuse. Checked three ways: tplower accepts exactly the mixes
DTensor accepts (every placement list on 3 axes); every transition from or to
a sum/avg mix on a 2x2x2 mesh gives DTensor's output and input gradient on
every rank (or, where DTensor refuses ``-> P``, the placements' meaning); and
PyTorch's own case ``P(avg),P(avg),P(sum) -> R,R,R`` gives the hand-computed value.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor._utils import assert_no_mixed_partial_types

from tplower import TPLowerError, parse_placements, plan_transition, redistribute_local
from tplower.conformance import Case, check_cases, failures, grads_for, summarize
from tplower.core.language.placements import check_reduce_ops
from tplower.testing import run_threaded

MESH = (2, 2, 2)
FULL = os.environ.get("TPLOWER_FULL_MATRIX") == "1"
OPS = ("sum", "avg", "max", "min")


def _dtensor_accepts(placements: str) -> bool:
    try:
        assert_no_mixed_partial_types(parse_placements(placements))
    except ValueError:
        return False
    return True


def test_tplower_accepts_exactly_the_mixes_dtensor_accepts() -> None:
    every = ["R", "S(0)"] + [f"P({op})" for op in OPS]
    accepted = refused = 0
    for combo in itertools.product(every, repeat=3):
        spec = ",".join(combo)
        ps = parse_placements(spec)
        want = _dtensor_accepts(spec)
        try:
            check_reduce_ops(ps, "src")
            plan_transition(ps, parse_placements("R,R,R"), (4, 4), MESH, (0, 0, 0))
            got = True
        except TPLowerError as exc:
            got = False
            assert "does not commute" in str(exc) and "only sum and avg may be mixed" in str(exc), exc
            assert f"src={spec!r} mixes Partial reduce ops" in str(exc), exc
        assert got == want, spec
        accepted, refused = accepted + got, refused + (not got)
    # 216 lists. Refused: two ops other than {sum, avg} (5 pairs x 18 lists holding both: 4^3 - 2 * 3^3 + 2^3)
    # and three ops (4 triples x 3! lists)
    assert refused == 5 * 18 + 4 * 6 == 114
    assert accepted == 216 - 114


def _mixed_cases(mesh: tuple[int, ...], shape: tuple[int, ...], grads: bool) -> list[Case]:
    """Every src from {R, S(0), S(1), P(sum), P(avg)} per axis holding both P(sum) and P(avg), to every dst whose
    axes are R, S(0), S(1) or the source's own Partial; and every R/S src to every all-Partial sum/avg mix.
    With ``grads``, each with every gradient DTensor accepts (:func:`grads_for`), else the default one."""
    basic = ("R", "S(0)", "S(1)")
    pairs = []
    for src in itertools.product(basic + ("P(sum)", "P(avg)"), repeat=len(mesh)):
        if {"P(sum)", "P(avg)"} <= set(src):
            options = [basic + ((p,) if p.startswith("P") else ()) for p in src]
            pairs += [(src, dst) for dst in itertools.product(*options)]
    mixes = [m for m in itertools.product(("P(sum)", "P(avg)"), repeat=len(mesh)) if len(set(m)) == 2]
    pairs += [(src, dst) for src in itertools.product(basic, repeat=len(mesh)) for dst in mixes]
    return [Case(mesh, shape, ",".join(src), ",".join(dst), g) for src, dst in pairs
            for g in (grads_for(list(dst)) if grads else [None])]


def _dtensor_runs(case: Case) -> bool:
    """Whether DTensor runs the case itself: it has no ``R -> P`` in forward, and in backward it keeps a Partial
    gradient Partial on a Partial source axis, so ``P(sum)`` arriving where the source is ``P(avg)`` fails there."""
    src, dst = case.src.split(","), case.dst.split(",")
    grad = case.grad.split(",") if case.grad else ["R" if p.startswith("P") else p for p in dst]
    if any(d.startswith("P") and not s.startswith("P") for s, d in zip(src, dst, strict=True)):
        return False
    return not any(g.startswith("P") and s.startswith("P") and g != s for s, g in zip(src, grad, strict=True))


def _check(mesh: tuple[int, ...], cases: list[Case], label: str, counts: dict[str, dict[str, int]]) -> None:
    world = 1
    for n in mesh:
        world *= n
    results = run_threaded(world, check_cases, cases)
    summary = summarize(results)
    counts[label] = summary
    assert not failures(results), "\n".join(failures(results)[:20])
    assert summary["cases"] == len(cases) and summary["refused"] == 0 and summary["dtensor_fallback"] == 0
    # DTensor runs each case it can (match); where it refuses (R/S -> P forward, P(sum) gradient onto a P(avg)
    # source in backward), tplower's output and gradient equal the placements' meaning (match_semantic)
    runs = sum(1 for c in cases if _dtensor_runs(c))
    assert summary["match"] == runs and summary["match_semantic"] == len(cases) - runs


def test_sum_avg_mixes_match_dtensor_2x2_every_pair_every_grad(conformance_counts: dict[str, dict[str, int]]) -> None:
    cases = _mixed_cases((2, 2), (5, 3), grads=True)
    _check((2, 2), cases, "2x2 mesh, Partial sum/avg mixed across axes", conformance_counts)


@pytest.mark.slow  # the 2x2 mesh checks every pair
def test_sum_avg_mixes_match_dtensor_2x2x2(conformance_counts: dict[str, dict[str, int]]) -> None:
    cases = _mixed_cases(MESH, (5, 3), grads=False)
    if not FULL:  # a fixed sample of the 2x2x2 matrix; TPLOWER_FULL_MATRIX=1 runs all of it
        cases = random.Random(0).sample(cases, 120)
    # PyTorch's own redistribute case, with every gradient DTensor accepts
    cases += [Case(MESH, (4, 6), "P(avg),P(avg),P(sum)", "R,R,R", g) for g in grads_for(["R", "R", "R"])]
    _check(MESH, cases, "2x2x2 mesh, Partial sum/avg mixed across axes", conformance_counts)


def _issue_case(rank: int, world: int) -> tuple[list[float], list[float]]:
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("a", "b", "c"))
    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    y = redistribute_local(x, mesh, "P(avg),P(avg),P(sum)", "R,R,R")
    (y * 2).sum().backward()
    assert x.grad is not None
    return y.flatten().tolist(), x.grad.flatten().tolist()


def test_pytorch_case_avg_avg_sum_to_replicate_hand_computed() -> None:
    # rank r = 4a + 2b + c holds r + 1: the sum over c, then the mean over b and a, is the sum of 1..8 over the
    # 4 (a, b) pairs = 36 / 4 = 9 on every rank; the gradient of a replicated output is the identity's: 2 each
    for out, grad in run_threaded(8, _issue_case):
        assert out == [9.0] * 6
        assert grad == [2.0] * 6


@pytest.mark.parametrize(("spec", "ops"), [("P(max),R,P(sum)", "['max', 'sum']"),
                                           ("P(avg),P(min),R", "['avg', 'min']"),
                                           ("P(max),P(min),P(max)", "['max', 'min']")])
def test_non_commuting_mix_is_refused_with_the_reason(spec: str, ops: str) -> None:
    with pytest.raises(TPLowerError, match=r"mixes Partial reduce ops " + ops.replace("[", r"\[")):
        plan_transition(parse_placements(spec), parse_placements("R,R,R"), (4,), MESH, (0, 0, 0))
    assert not _dtensor_accepts(spec)
