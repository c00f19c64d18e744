"""Tests for the gaps a mutation audit found: each one kills a planted bug the suite used to miss.

23 small bugs were planted one at a time; these five got through, or were caught only by a
300-second hang. Each test's docstring names the bug it kills. Pure checks and threaded ranks,
except the harness tests, which need real processes (two gloo ranks).

The reference for data is single-process: every rank's input is its ``torch.chunk`` piece of one
seeded global tensor at its *mesh coordinate* (partial values are weighted pieces that sum to it);
the expected output is the piece of the same tensor under ``dst``, the expected input gradient the
piece of the global gradient under ``src`` with ``Partial`` read as ``Replicate``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

import tplower.core.lower.collectives as C
import tplower.core.lower.redistribute as R
from tplower import (
    TPExecutionOp,
    TPLowerError,
    classify_tp_transition,
    mesh_lowerer,
    parse_placements,
    plan_transition,
    redistribute_local,
)
from tplower.conformance import Case, check_cases
from tplower.core.language.transitions import chunk_size_and_offset, local_shape
from tplower.core.lower import backends, debug_path
from tplower.core.lower.agreement import check_agreement
from tplower.testing import RankFailure, run_processes, run_threaded

from test_permuted_mesh import _body as permuted_mesh_check

Outcome = tuple[str, Any]  # ("ok", output rows) or ("error", message)
DataCase = tuple[tuple[int, ...], str, str]  # (global shape, src, dst)


def _outcome(call: Callable[[], torch.Tensor]) -> Outcome:
    try:
        return "ok", call()[:, 0].tolist()
    except TPLowerError as exc:
        return "error", str(exc)


# 1. The debug check on a sub-mesh ---------------------------------------------------------------------------------


def _sub_mesh_of_2d_body(rank: int, world: int) -> list[Outcome]:
    del world
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    x = torch.full((2, 3), float(rank))
    # Each tp group agrees with itself; the two dp rows do different things.
    agreeing = _outcome(lambda: redistribute_local(x, mesh["tp"], "S(0)" if dp == 0 else "P(sum)", "R",
                                                   check=True))
    # Only in dp row 1 do the tp ranks disagree (rank 3 replicates what rank 2 reduces).
    src = "R" if rank == 3 else "P(sum)" if dp == 1 else "S(0)"
    return [agreeing, _outcome(lambda: redistribute_local(x, mesh["tp"], src, "R", check=True))]


def test_debug_check_on_the_1d_sub_mesh_of_a_2d_mesh() -> None:
    """Planted bug: ``MeshLowerer._debug_group`` returns the default group (``None``).

    The check must compare the ranks of the sub-mesh only: the mutant compares all four ranks and
    raises "src differs" everywhere, though each tp group agrees.
    """
    results = run_threaded(4, _sub_mesh_of_2d_body)
    gathered = [0.0, 0.0, 1.0, 1.0]  # S(0) -> R on ranks 0, 1: their rows, in mesh order
    assert [r[0] for r in results] == [("ok", gathered), ("ok", gathered), ("ok", [5.0] * 2), ("ok", [5.0] * 2)]
    assert [r[1] for r in results[:2]] == [("ok", gathered)] * 2
    for kind, msg in (r[1] for r in results[2:]):
        assert kind == "error" and "src differs: 'P(sum)' on ranks [2]; 'R' on ranks [3]" in msg, msg


def _sub_mesh_of_3d_body(rank: int, world: int) -> list[Outcome]:
    del world
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp, tp = mesh.get_local_rank("pp"), mesh.get_local_rank("tp")
    sub = mesh["dp", "tp"]  # a 2-D sub-mesh: its check runs on the flattened (dp, tp) group
    x = torch.full((2, 3), float(rank))
    agreeing = _outcome(lambda: redistribute_local(x, sub, "S(0),R" if pp == 0 else "P(sum),R", "R,R",
                                                   check=True))
    src = "R,S(0)" if pp == 1 and tp == 1 else "R,R"  # pp row 1 disagrees along tp, inside its sub-mesh
    return [agreeing, _outcome(lambda: redistribute_local(x, sub, src, "R,R", check=True))]


def test_debug_check_on_the_2d_sub_mesh_of_a_3d_mesh() -> None:
    """Planted bug: ``MeshLowerer._debug_group`` returns the default group (``None``).

    A 2-D sub-mesh takes the flattened-group branch (never run before): each sub-mesh agrees with
    itself, so every rank succeeds; a disagreement along ``tp`` inside one sub-mesh raises on its four
    ranks only, naming them.
    """
    results = run_threaded(8, _sub_mesh_of_3d_body)
    # gathered along dp (ranks 0 and 2, ranks 1 and 3); summed along dp (ranks 4 and 6, ranks 5 and 7)
    assert [r[0] for r in results[:4]] == [("ok", [0.0, 0.0, 2.0, 2.0]), ("ok", [1.0, 1.0, 3.0, 3.0])] * 2
    assert [r[0] for r in results[4:]] == [("ok", [4.0 + 6.0] * 2), ("ok", [5.0 + 7.0] * 2)] * 2
    assert [r[1] for r in results[:4]] == [("ok", [float(r)] * 2) for r in range(4)]
    for kind, msg in (r[1] for r in results[4:]):
        assert kind == "error" and "src differs: 'R,R' on ranks [4, 6]; 'R,S(0)' on ranks [5, 7]" in msg, msg


# 2. TPLOWER_DEBUG=1 with an explicit check=False ------------------------------------------------------------------


def _env_debug_body(rank: int, world: int, check: bool | None) -> bool:
    del rank
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    redistribute_local(torch.ones(2, 3), mesh, "S(0)", "R", check=check)
    return mesh_lowerer(mesh).debug


@pytest.mark.parametrize(("check", "exchanges"), [(False, 0), (None, 2), (True, 2)],
                         ids=["check=False", "check=None", "check=True"])
def test_check_false_wins_over_tplower_debug(monkeypatch: pytest.MonkeyPatch, check: bool | None,
                                             exchanges: int) -> None:
    """Planted bug: ``redistribute_local`` runs the check when ``TPLOWER_DEBUG=1`` even with ``check=False``.

    The environment switch is only the default: ``check=False`` runs no agreement exchange (the
    mutant makes one per rank, 2 on world 2); ``None`` follows the switch, ``True`` checks.
    """
    calls: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> None:
        calls.append(dist.get_rank())
        check_agreement(*args, **kwargs)

    monkeypatch.setenv("TPLOWER_DEBUG", "1")  # read when each run's new mesh gets its lowerer
    monkeypatch.setattr(debug_path, "check_agreement", counting)
    assert run_threaded(2, _env_debug_body, check) == [True, True]
    assert len(calls) == exchanges


# 3. Backend tables ------------------------------------------------------------------------------------------------

_CARRIES = [  # (backend, device type, carried)
    ("gloo", "cpu", True), ("gloo", "cuda", True),
    ("nccl", "cuda", True), ("nccl", "cpu", False),
    ("ucc", "cpu", True), ("ucc", "cuda", True),
    ("mpi", "cpu", True), ("mpi", "cuda", False),
    ("cpu:gloo,cuda:nccl", "cuda", True), ("cpu:gloo,cuda:nccl", "cpu", True),
    ("cpu:gloo", "cuda", False), ("cuda:nccl", "cpu", False),
]


@pytest.mark.parametrize(("backend", "device", "carried"), _CARRIES, ids=[f"{b}-{d}" for b, d, _ in _CARRIES])
def test_backend_devices(backend: str, device: str, carried: bool) -> None:
    """Planted bug: gloo's device set reduced to ``{"cpu"}`` (a CUDA tensor on a gloo axis refused).

    Pure: what each backend carries, with no GPU needed. gloo carries CPU and CUDA tensors, NCCL
    CUDA only, UCC both, MPI CPU only; a ``cpu:gloo,cuda:nccl`` group carries what its parts do.
    """
    if carried:
        C.check_device(backend, device)
    else:
        with pytest.raises(TPLowerError, match=f"the tensor is on '{device}'"):
            C.check_device(backend, device)


_GROUP = cast(ProcessGroup, object())  # binding never calls the group

# (backend, src, dst, bound function, for avg: whether the avg is native (all_reduce's ``native``, the
# reduce-scatter's ``native_avg``) or a sum then a division; None where no avg is involved)
_BINDS = [
    ("gloo", "P(avg)", "R", "all_reduce", True),
    ("nccl", "P(avg)", "R", "all_reduce", True),
    ("ucc", "P(avg)", "R", "all_reduce", False),
    ("mpi", "P(avg)", "R", "all_reduce", False),
    ("gloo", "P(sum)", "S(0)", "reduce_scatter", None),
    ("gloo", "P(avg)", "S(0)", "reduce_scatter", True),
    ("gloo", "P(max)", "S(0)", "reduce_scatter", None),
    ("nccl", "P(avg)", "S(0)", "reduce_scatter", True),
    ("nccl", "P(min)", "S(0)", "reduce_scatter", None),
    ("ucc", "P(avg)", "S(0)", "reduce_scatter", False),  # a native sum, then / n
    ("ucc", "P(max)", "S(0)", "reduce_scatter", None),
    ("mpi", "P(sum)", "S(0)", "all_reduce_chunk", None),  # no tensor reduce_scatter
    ("mpi", "P(avg)", "S(0)", "all_reduce_chunk", False),
    ("gloo", "S(0)", "S(1)", "all_to_all", None),
    ("nccl", "S(0)", "S(1)", "all_to_all", None),
    ("ucc", "S(0)", "S(1)", "all_to_all", None),
    ("mpi", "S(0)", "S(1)", "all_to_all", None),
    ("threaded", "S(0)", "S(1)", "all_to_all", None),
    ("threaded", "P(max)", "S(0)", "all_reduce_chunk", None),  # no native max reduce_scatter, and not avg
    ("fake", "S(0)", "S(1)", "all_to_all", None),  # the benchmarks' fake group times the native call
    ("a-backend-tplower-does-not-know", "S(0)", "S(1)", "all_to_all_via_gather", None),
]


@pytest.mark.parametrize(("backend", "src", "dst", "func", "native"), _BINDS,
                         ids=[f"{b}-{s}->{d}" for b, s, d, _, _ in _BINDS])
def test_backend_binds(backend: str, src: str, dst: str, func: str, native: bool | None) -> None:
    """Planted bug: gloo's native ``avg`` all_reduce removed from its capabilities.

    The emulation (sum, then divide) gives the same values, so only the bound step shows it: gloo
    and NCCL bind the native call, UCC and MPI the emulation; which reduce-scatter and all_to_all each
    backend binds, pure, no process group.
    """
    names = ("tp",)
    plan = plan_transition(parse_placements(src, names), parse_placements(dst, names), (4, 6), (2,), (0,))
    assert len(plan.forward) == 1
    bound = R.bind_step(plan.forward[0], _GROUP, C.backend_caps(backend))
    assert isinstance(bound, functools.partial)
    assert bound.func.__name__ == func
    if native is not None:
        assert bound.keywords.get("native", bound.keywords.get("native_avg", True)) == native


# 4 and 5. all_to_all on non-square shapes; permuted meshes whose permutation is not its own inverse -----------------


def _reference_body(rank: int, world: int, ranks: list[Any], names: tuple[str, ...],
                    cases: list[DataCase]) -> tuple[tuple[tuple[int, ...] | None, ...], list[Any]]:
    """test_permuted_mesh's single-process reference check of each case; also the mesh's axis orders."""
    bad = permuted_mesh_check(rank, world, ranks, names, cases)
    return mesh_lowerer(DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=names)).orders, bad


def _all_to_all_cases(world: int) -> list[DataCase]:
    """``S(i) -> S(j)`` where dims i and j differ in size, even and uneven (``world * 3 + 1``)."""
    w = world
    shapes_2d = [(2 * w, 3 * w), (3 * w, w), (3 * w + 1, 2 * w), (w + 1, 3 * w + 2), (2, 3 * w + 1)]
    cases = [(s, a, b) for s in shapes_2d for a, b in (("S(0)", "S(1)"), ("S(1)", "S(0)"))]
    return cases + [((3 * w + 1, 2, w + 1), a, b) for a, b in (("S(0)", "S(2)"), ("S(2)", "S(1)"))]


@pytest.mark.parametrize("caps", ["native", "via_gather"])
@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_non_square_shapes(monkeypatch: pytest.MonkeyPatch, world: int, caps: str) -> None:
    """Planted bug: ``bind_step`` passes ``src_size``/``dst_size`` swapped to the all_to_all.

    On square shapes (as before) the swap changes nothing; here the two dims differ in size, with
    uneven pieces, forward and backward (an all_to_all the other way), on the native
    ``all_to_all_single`` and on the ``all_gather`` + chunk remap of a backend without one.
    """
    if caps == "via_gather":
        monkeypatch.setitem(backends._CAPS, "threaded", C.backend_caps("a-backend-without-all-to-all"))
    for _, bad in run_threaded(world, _reference_body, list(range(world)), ("tp",), _all_to_all_cases(world)):
        assert not bad, bad


def _permuted_cases() -> list[DataCase]:
    srcs = [",".join(p) for p in [("P(sum)", "R"), ("R", "P(sum)"), ("S(0)", "R"), ("R", "S(1)"), ("S(0)", "S(1)"),
                                  ("R", "R")]]
    dsts = ["R,S(0)", "S(0),R", "S(1),S(0)", "R,R", "S(0),S(1)", "R,S(1)"]
    return [(shape, s, d) for shape in [(7, 5), (6, 6)] for s in srcs for d in dsts]


# Rank tensors of 2-D meshes over six ranks: along the 3-rank axis the mesh lists its group's ranks as
# (4, 5, 3), so order = (1, 2, 0), whose inverse (2, 0, 1) differs; the 2-rank axes are swapped too.
_PERMUTED = {
    "2x3 (dp, tp), tp cycled": ([[4, 5, 3], [1, 2, 0]], 1),
    "3x2 (dp, tp), dp cycled": ([[3, 2], [5, 4], [1, 0]], 0),
}


@pytest.mark.parametrize("mesh_name", list(_PERMUTED))
def test_permuted_2d_mesh_not_its_own_inverse(mesh_name: str) -> None:
    """Planted bug: ``reduce_scatter`` reorders its blocks by ``order`` instead of its inverse.

    Before, the 2-D permuted cases swapped two ranks per axis, a permutation that is its own inverse,
    so the mutant passed them; here one axis holds three ranks in a cycle.
    """
    ranks, axis = _PERMUTED[mesh_name]
    for orders, bad in run_threaded(6, _reference_body, ranks, ("dp", "tp"), _permuted_cases()):
        order = orders[axis]
        assert order is not None and [order[c] for c in order] != list(range(3)), orders  # not an involution
        assert not bad, bad


# The multi-process harness: a failing rank ends the run within seconds -------------------------------------------


def _one_rank_fails_body(rank: int, world: int, how: str) -> None:
    del world
    if rank == 1:
        raise RuntimeError("rank 1 fails at once")
    if how == "collective":
        dist.all_reduce(torch.ones(3))  # rank 1 never joins
    else:
        time.sleep(300)  # busy outside any collective: only the harness can end it


# the harness ends both alike; the busy one with TPLOWER_SLOW=1
@pytest.mark.parametrize("how", ["collective", pytest.param("busy", marks=pytest.mark.slow)])
def test_a_failing_rank_ends_the_run_within_seconds(how: str) -> None:
    """Before, the harness waited 10 s after a failure, and a rank that never raised waited out ``timeout``.

    Rank 1 raises at once while rank 0 waits in a collective (or computes): the run ends with a
    :class:`RankFailure` naming rank 1's error long before the run's ``timeout`` and the process
    group's, and rank 0 is named too (its own error, or ended by the harness).
    """
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_processes(2, _one_rank_fails_body, how, timeout=120)
    elapsed = time.monotonic() - start
    failed = info.value.failures
    assert sorted(failed) == [0, 1] and "rank 1 fails at once" in failed[1]
    if how == "busy":
        assert "ended by the harness" in failed[0] and "after rank [1] failed" in failed[0], failed[0]
    assert elapsed < 60  # a liveness bound, far below timeout=120


def _swapped_all_to_all_body(rank: int, world: int, cases: list[Case], fail_fast: bool) -> Any:
    # Plant the swapped sizes in this rank process only (it ends with the run).
    real = R.bind_step

    def swapped(step: Any, group: Any, caps: C.BackendCaps, **kwargs: Any) -> C.BoundStep:
        bound = real(step, group, caps, **kwargs)
        if step.kind == "all_to_all" and isinstance(bound, functools.partial):
            kw = dict(bound.keywords, src_size=bound.keywords["dst_size"], dst_size=bound.keywords["src_size"])
            return functools.partial(bound.func, **kw)
        return bound

    R.bind_step = swapped
    return check_cases(rank, world, cases, fail_fast=fail_fast)


def test_a_conformance_failure_ends_the_process_run_within_seconds() -> None:
    """Planted bug: the all_to_all sizes swapped, which the conformance run caught only by a 300 s hang.

    Global (3, 2) on two ranks: with the sizes swapped, rank 0's piece (2 rows) overflows the padded
    1-row piece and its call raises, while rank 1 enters ``all_to_all_single``; rank 0 then goes on
    to the next case's collectives and both wait until the run's timeout (checked by hand: "no result
    within 60 s" on both ranks at ``timeout=60``). With ``check_cases(..., fail_fast=True)`` (what the
    process conformance tests run) rank 0 raises at the failing case, and the run ends in seconds.
    """
    cases = [Case((2,), (3, 2), "S(0)", "S(1)"), Case((2,), (4, 3), "P(sum)", "R")]
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_processes(2, _swapped_all_to_all_body, cases, True, timeout=120)
    elapsed = time.monotonic() - start
    assert any("CaseFailure" in m and "S(0)->S(1)" in m for m in info.value.failures.values()), info.value
    assert elapsed < 60  # a liveness bound, far below timeout=120


# Survivors of the cosmic-ray run (mutation/README.md) that a test can tell apart --------------------------------

_PRINTED = [  # (src, dst): the plan as it prints, forward and backward steps named by their collective
    ("S(0)", "S(1)", "S(0) -> S(1) (grad S(1)): forward [S(0)->S(1) on axis 0: all_to_all(dim=0->1)], "
                     "backward [S(1)->S(0) on axis 0: all_to_all(dim=1->0)]"),
    ("S(0)", "R", "S(0) -> R (grad R): forward [S(0)->R on axis 0: all_gather(dim=0)], "
                  "backward [R->S(0) on axis 0: chunk(dim=0)]"),
    ("P(sum)", "S(0)", "P(sum) -> S(0) (grad S(0)): forward [P(sum)->S(0) on axis 0: reduce_scatter(dim=0, op=sum)], "
                       "backward [S(0)->R on axis 0: all_gather(dim=0)]"),
    ("P(sum)", "R", "P(sum) -> R (grad R): forward [P(sum)->R on axis 0: all_reduce(op=sum)], backward [identity]"),
    ("R", "R", "R -> R (grad R): forward [identity], backward [identity]"),
]


@pytest.mark.parametrize(("src", "dst", "printed"), _PRINTED, ids=[f"{s}->{d}" for s, d, _ in _PRINTED])
def test_plans_print_their_collectives(src: str, dst: str, printed: str) -> None:
    """Survivors: ``Step.op_str`` with its ``all_to_all``/``tensor_dim`` tests flipped, ``TransitionPlan.__str__``
    with ``or "identity"`` as ``and``. What ``tplower explain`` and the debug log show must name the right
    dims and ops."""
    names = ("tp",)
    plan = plan_transition(parse_placements(src, names), parse_placements(dst, names), (4, 6), (2,), (0,))
    assert str(plan) == printed


@pytest.mark.parametrize(("coord", "logical"), [((0, 0, 0), [(7, 2), (4, 2), (2, 2)]),
                                                 ((1, 1, 1), [(7, 2), (3, 2), (1, 2)])])
def test_nested_shards_shard_from_the_shape_cut_by_every_earlier_axis(coord: tuple[int, ...],
                                                                     logical: list[tuple[int, ...]]) -> None:
    """Survivor: ``_logical_shapes`` cutting each axis's shape from the global shape (``shapes[0]``), not from the
    previous axis's (``shapes[-1]``): the same on one or two axes, wrong from the third.

    ``S(0),S(0),S(0)`` of 7 rows on a 2x2x2 mesh: axis 0 shards 7 rows, axis 1 this rank's
    ``torch.chunk`` piece of them (4 at coordinate 0, 3 at 1), axis 2 the piece of that (2, or 1):
    DTensor's logical shapes, which uneven pieces are padded and cut by.
    """
    src = parse_placements("S(0),S(0),S(0)", ("a", "b", "c"))
    steps = plan_transition(src, parse_placements("R,R,R", ("a", "b", "c")), (7, 2), (2, 2, 2), coord).forward
    assert sorted((s.axis, s.logical_shape) for s in steps) == list(enumerate(logical))


def test_shape_helpers_refuse_counts_unlike_the_mesh() -> None:
    """Survivors: ``plan_transition`` accepting more placements than mesh axes (``!=`` as ``<``), and
    ``local_shape`` cutting the shape by only the axes its shorter arguments share (``strict=False``)."""
    one_axis = parse_placements("S(0),R", ("a", "b"))
    with pytest.raises(TPLowerError, match=r"src='S\(0\),R' has 2 placements for a 1-axis mesh"):
        plan_transition(one_axis, one_axis, (4, 3), (2,), (0,))
    with pytest.raises(ValueError, match="zip"):
        local_shape((4, 3), one_axis, (2,), (0,))


def test_chunk_of_an_axis_without_ranks_is_empty() -> None:
    """Survivor: ``chunk_size_and_offset`` with ``n > 0`` as ``n >= 0`` (a division by zero for ``n = 0``)."""
    assert chunk_size_and_offset(5, 0, 0) == (0, 0)


def test_shard_dim_errors_show_the_allowed_range() -> None:
    """Survivors: the allowed range in two error messages (``-tensor_ndim`` without its sign or as
    ``~tensor_ndim``; ``len(gshape) - 1`` as ``<< 1``)."""
    with pytest.raises(TPLowerError, match=r"shard dim 2 is out of range for a 2-d tensor \(allowed -2\.\.1\)"):
        parse_placements("S(2)", ("tp",), tensor_ndim=2)
    with pytest.raises(TPLowerError, match=r"shard dim 2 is not in 0\.\.1 for global shape \(4, 3\)"):
        plan_transition(parse_placements("S(2)", ("tp",)), parse_placements("R", ("tp",)), (4, 3), (2,), (0,))


def test_send_counts_are_whole_elements_and_local_steps_send_nothing() -> None:
    """Survivors in ``_send_elems``: the ring all_reduce's ``// n`` as ``/`` (a fraction where ``n`` does not
    divide), and ``kind == "all_to_all"`` as ``>=`` (a local chunk costed as an all_to_all)."""
    names = ("tp",)
    # ring all_reduce of 4 elements on 3 ranks: 2 * (3 - 1) * 4 // 3 = 5 whole elements, not 16/3
    (ar,) = plan_transition(parse_placements("P(sum)", names), parse_placements("R", names), (4,), (3,), (0,)).forward
    assert ar.kind == "all_reduce" and ar.send_elems == 5 and isinstance(ar.send_elems, int)
    for src, dst, kind in (("R", "S(0)", "chunk"), ("R", "P(sum)", "partition"), ("S(0)", "P(sum)", "zero_fill")):
        (step,) = plan_transition(parse_placements(src, names), parse_placements(dst, names), (6, 2), (3,),
                                  (0,)).forward
        assert (step.kind, step.send_elems) == (kind, 0)


def test_plans_are_immutable() -> None:
    """Survivor: ``TransitionPlan`` made a plain (mutable) dataclass: cached programs share their plans."""
    names = ("tp",)
    plan = plan_transition(parse_placements("S(0)", names), parse_placements("R", names), (4, 6), (2,), (0,))
    for obj in (plan, plan.forward[0]):
        for field in dataclasses.fields(obj):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(obj, field.name, None)


# Survivors of the mutation run of collectives, redistribute and lowering ------------------------------------------


@pytest.mark.parametrize("dim", [3, -3, 2])
def test_execution_op_dims_out_of_range_for_the_tensor(dim: int) -> None:
    """Survivors: ``-nd <= dim < nd`` as ``~nd <= dim`` (lets ``-nd - 1`` through) or ``dim is not nd``."""
    op = TPExecutionOp(kind="all_gather", group=cast(ProcessGroup, None), group_size=2, group_rank=0,
                       tensor_dim=dim)
    with pytest.raises(ValueError, match=f"tensor_dim={dim} is out of range for a 2-d tensor"):
        op._build((4, 6), "cpu")


def test_execution_op_placements_normalise_negative_dims() -> None:
    """Survivor: ``dst_dim % ndim`` as ``dst_dim ** ndim`` (0 and 1 are fixed points, so use -2 on 3 dims)."""
    op = TPExecutionOp(kind="all_to_all", group=cast(ProcessGroup, None), group_size=2, group_rank=0,
                       tensor_dim=-1, dst_dim=-2)
    assert op.placements(3) == (Shard(2), Shard(1), Shard(1))


@pytest.mark.parametrize("rank", [3, -1])
def test_execution_op_group_rank_beyond_the_group(rank: int) -> None:
    """Survivors: ``0 <= group_rank < group_size`` as ``group_rank is not group_size`` or ``-1 <= group_rank``
    (only ``group_rank == group_size`` was tested)."""
    with pytest.raises(ValueError, match=f"group_rank={rank} is outside a group of group_size=2"):
        TPExecutionOp(kind="all_reduce", group=cast(ProcessGroup, None), group_size=2, group_rank=rank)


def test_execution_op_without_a_group_refuses_to_run() -> None:
    """Survivor: ``value is None and optional`` as ``or`` in the group check: ``execute`` went on without one."""
    op = TPExecutionOp(kind="all_reduce", group=cast(ProcessGroup, None), group_size=2, group_rank=0)
    with pytest.raises(TypeError, match="group"):
        op.execute(torch.ones(2))


def test_mesh_axis_and_process_group_with_other_ranks_is_refused() -> None:
    """Survivor: ``sorted(mesh) != sorted(group)`` as ``is`` (never true): a group of other ranks passed."""
    lowerer = cast(R.MeshLowerer, SimpleNamespace(names=("tp",)))
    with pytest.raises(TPLowerError, match=r"mesh axis 'tp' holds ranks \[0, 1\] but its process group holds "
                                           r"\[0, 2\]"):
        R.MeshLowerer._axis_order(lowerer, 0, [0, 1], [0, 2])
    with pytest.raises(TPLowerError, match="holds ranks"):  # either way round (a ``<`` in place of ``!=``)
        R.MeshLowerer._axis_order(lowerer, 0, [0, 2], [0, 1])
    assert R.MeshLowerer._axis_order(lowerer, 0, [0, 1], [0, 1]) is None
    assert R.MeshLowerer._axis_order(lowerer, 0, [1, 0], [0, 1]) == (1, 0)


def test_classify_refuses_a_move_on_an_axis_after_the_tp_axis() -> None:
    """Survivor: the other-axes check ``k != i`` as ``k < i`` (only axes before the tp axis were checked)."""
    assert classify_tp_transition("S(0),R", "R,S(0)", ("tp", "dp"), axis="tp") is None
    assert classify_tp_transition("R,S(0)", "S(0),R", ("dp", "tp"), axis="tp") is None
    assert classify_tp_transition("S(0),R", "R,R", ("tp", "dp"), axis="tp") == {"kind": "all_gather", "tensor_dim": 0}


def _lowerer_facts_body(rank: int, world: int) -> tuple[Any, ...]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    low = mesh_lowerer(mesh)
    x = torch.ones(2, 3)
    before = low.cache_info().hits
    for _ in range(2):
        redistribute_local(x, mesh, "R,S(0)", "R,R")
    hits = low.cache_info().hits - before
    refused = []
    for spec in ("P(max),P(sum)", "P(sum),P(min)"):
        for src, dst in ((spec, "R,R"), ("R,R", spec)):
            try:
                redistribute_local(x, mesh, src, dst)
                refused.append(None)
            except TPLowerError as exc:
                refused.append(str(exc))
    return low.ordered, hits, refused


def test_lowerer_order_flags_cache_hits_and_mixed_reduce_ops_refused() -> None:
    """Survivors: ``ordered`` made a plain method, the eager path reading the cache without counting a hit
    (the reads for ``torch.compile`` swapped in), the reduce-op mix check of ``src``/``dst`` skipped."""
    ordered, hits, refused = run_threaded(4, _lowerer_facts_body)[0]
    assert ordered == (True, True)
    assert hits == 1  # the second call is a hit (the first may be one too: the cache is per mesh lowerer)
    assert all(r is not None and "mixes Partial reduce ops" in r for r in refused), refused
