"""The pure planner: the single-axis table, step order on nested shards, bytes per rank."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from tplower import TPLowerError, classify_axis, plan_steps, plan_transition
from tplower.core.language.transitions import KINDS, chunk_size_and_offset, global_shape_from_local, local_shape

R, P = Replicate(), Partial("sum")

# (src, dst) -> (kind, tensor_dim, dst_dim, reduce_op), written from the collective semantics.
TABLE = [
    (Shard(0), Shard(0), ("identity", None, None, None)),
    (Shard(1), R, ("all_gather", 1, None, None)),
    (P, R, ("all_reduce", None, None, "sum")),
    (Partial("max"), R, ("all_reduce", None, None, "max")),
    (P, Shard(2), ("reduce_scatter", 2, None, "sum")),
    (R, Shard(0), ("chunk", 0, None, None)),
    (Shard(0), Shard(1), ("all_to_all", 0, 1, None)),
    (R, Partial("avg"), ("partition", None, None, "avg")),
    (Shard(1), P, ("zero_fill", 1, None, "sum")),
]


@pytest.mark.parametrize(("src", "dst", "want"), TABLE, ids=[f"{s}->{d}" for s, d, _ in TABLE])
def test_single_axis_table(src, dst, want):
    assert classify_axis(src, dst) == want


def test_partial_cannot_change_reduce_op():
    with pytest.raises(TPLowerError, match="cannot change its reduce op"):
        classify_axis(Partial("sum"), Partial("max"))
    with pytest.raises(TPLowerError, match="not lowerable"):
        classify_axis(Partial("product"), R)


@pytest.mark.parametrize(("size", "n", "want"), [
    (8, 4, [(2, 0), (2, 2), (2, 4), (2, 6)]),
    (5, 4, [(2, 0), (2, 2), (1, 4), (0, 5)]),  # torch.chunk(5, 4) gives 3 pieces
    (1, 3, [(1, 0), (0, 1), (0, 1)]),
    (0, 2, [(0, 0), (0, 0)]),
])
def test_chunk_sizes_follow_torch_chunk(size, n, want):
    assert [chunk_size_and_offset(size, n, r) for r in range(n)] == want


def test_local_and_global_shapes_nested():
    # S(0) on both axes of a 2x2 mesh: axis 0 cuts 5 into 3|2, axis 1 cuts the 3 into 2|1.
    assert local_shape((5, 4), (Shard(0), Shard(0)), (2, 2), (0, 1)) == (1, 4)
    assert local_shape((5, 4), (Shard(0), Shard(1)), (2, 2), (1, 0)) == (2, 2)
    assert global_shape_from_local((2, 3), (Shard(1), Shard(0)), (2, 4)) == (8, 6)


def test_nested_shards_are_undone_inner_first():
    steps = plan_steps((Shard(0), Shard(0)), (R, R), (8, 4), (2, 2), (0, 0))
    assert [(s.axis, s.kind) for s in steps] == [(1, "all_gather"), (0, "all_gather")]
    assert steps[0].logical_shape == (4, 4) and steps[1].logical_shape == (8, 4)


def test_misaligned_nesting_replicates_then_reshards():
    # (S(0), S(0)) -> (R, S(0)): axis 1's S(0) is nested under axis 0's, so it is gathered first.
    steps = plan_steps((Shard(0), Shard(0)), (R, Shard(0)), (8, 4), (2, 2), (1, 1))
    assert [(s.axis, s.kind) for s in steps] == [(1, "all_gather"), (0, "all_gather"), (1, "chunk")]


def test_size_one_axis_needs_nothing():
    assert plan_steps((Shard(0), P), (R, R), (4, 4), (1, 2), (0, 1))[0].axis == 1
    assert len(plan_steps((Shard(0), P), (R, R), (4, 4), (1, 2), (0, 1))) == 1


def test_bytes_per_rank_hand_computed():
    # all_gather of a (8, 6) tensor sharded 4 ways on dim 0: each rank sends its 2x6 piece to 3 peers.
    (ag,) = plan_steps((Shard(0),), (R,), (8, 6), (4,), (0,))
    assert ag.send_elems == 3 * 12
    # ring all_reduce of 48 elements on 4 ranks: 2 * 3/4 * 48.
    (ar,) = plan_steps((P,), (R,), (8, 6), (4,), (0,))
    assert ar.send_elems == 72
    # reduce_scatter of 7 rows on 2 ranks pads to 8: one padded 4x6 piece to the peer.
    (rs,) = plan_steps((P,), (Shard(0),), (7, 6), (2,), (1,))
    assert rs.send_elems == 24
    (a2a,) = plan_steps((Shard(0),), (Shard(1),), (8, 8), (4,), (0,))
    assert a2a.send_elems == 3 * 16 // 4


def test_backward_is_the_transition_from_grad_to_src():
    plan = plan_transition((Shard(0),), (R,), (8, 6), (2,), (0,), grad=(P,))
    assert [s.kind for s in plan.forward] == ["all_gather"]
    assert [s.kind for s in plan.backward] == ["reduce_scatter"]
    plan = plan_transition((Shard(0),), (R,), (8, 6), (2,), (0,))
    assert [s.kind for s in plan.backward] == ["chunk"]
    plan = plan_transition((P,), (R,), (8, 6), (2,), (0,), grad=(P,))
    assert [s.kind for s in plan.backward] == ["all_reduce"]
    assert "all_reduce" in str(plan)


def test_grad_must_fit_output():
    with pytest.raises(TPLowerError, match="does not fit the output"):
        plan_transition((R,), (Shard(0),), (8, 6), (2,), (0,), grad=(R,))


def test_backend_for_device_splits_multi_device_backends():
    from tplower.core.lower.collectives import backend_caps, backend_for_device

    assert backend_for_device("cpu:gloo,cuda:nccl", "cuda") == "nccl"
    assert backend_for_device("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert backend_for_device("cpu:gloo,cuda:nccl", "xpu") == "gloo"
    assert backend_for_device("nccl", "cuda") == "nccl"
    assert "max" in backend_caps("NCCL").reduce_scatter_ops
    assert backend_caps("newthing").reduce_scatter_ops == frozenset()


def test_partial_axes_are_reduced_before_gathers():
    # DTensor's greedy order would gather axis 1 first and all_reduce the full tensor.
    steps = plan_steps((P, Shard(0)), (R, R), (8, 6), (2, 2), (0, 0))
    assert [(s.axis, s.kind) for s in steps] == [(0, "all_reduce"), (1, "all_gather")]
    assert steps[0].in_shape == (4, 6) and steps[0].send_elems == 2 * 1 * 24 // 2


def test_local_chunks_run_before_collectives_on_other_dims():
    # grad (R, S(1)) -> (S(0), R): chunk dim 0 on axis 0 first, so the gather on axis 1 moves half the data.
    steps = plan_steps((R, Shard(1)), (Shard(0), R), (8, 8), (2, 4), (0, 0))
    assert [(s.axis, s.kind) for s in steps] == [(0, "chunk"), (1, "all_gather")]
    assert steps[1].in_shape == (4, 2)
    # the same tensor dim: nesting decides, nothing moves
    steps = plan_steps((R, Shard(0)), (Shard(0), R), (8, 8), (2, 4), (0, 0))
    assert [(s.axis, s.kind) for s in steps] == [(1, "all_gather"), (0, "chunk")]


_ANY_PLACEMENT = st.one_of(st.just(R), st.integers(-4, 4).map(Shard),
                           st.sampled_from(["sum", "avg", "max", "min", "product"]).map(Partial))


@given(st.integers(1, 3).flatmap(lambda k: st.tuples(
    st.lists(_ANY_PLACEMENT, min_size=k, max_size=k), st.lists(_ANY_PLACEMENT, min_size=k, max_size=k),
    st.lists(st.integers(1, 4), min_size=k, max_size=k))), st.lists(st.integers(0, 7), min_size=1, max_size=3))
def test_planner_plans_or_raises_documented_error(placements, shape):
    src, dst, mesh_shape = placements
    try:
        plan = plan_transition(src, dst, shape, mesh_shape, [0] * len(mesh_shape))
    except TPLowerError:
        return
    assert plan.out_shape == local_shape(shape, dst, mesh_shape, [0] * len(mesh_shape))
    for step in plan.forward + plan.backward:
        assert step.kind in KINDS and step.send_elems >= 0


@pytest.mark.parametrize(("backend", "device", "ok"), [
    ("gloo", "cpu", True), ("nccl", "cuda", True), ("nccl", "cpu", False), ("mpi", "cuda", False),
    ("cpu:gloo,cuda:nccl", "cuda", True), ("cpu:gloo,cuda:nccl", "xpu", False), ("threaded", "meta", True),
    ("someother", "xpu", True),  # unknown backends are not second-guessed
])
def test_device_must_be_carried_by_the_backend(backend, device, ok):
    from tplower.core.lower.collectives import check_device

    if ok:
        check_device(backend, device)
    else:
        with pytest.raises(TPLowerError, match=f"the tensor is on '{device}'"):
            check_device(backend, device)
