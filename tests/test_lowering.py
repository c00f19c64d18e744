"""The seed-compatible surface: classification table, execution ops, remaps, gradient conventions.

Distributed checks compare with DTensor (``from_local -> redistribute ->
to_local(grad_placements)``) or, where DTensor cannot run on the test
backend, with a single-process reference built from every rank's seeded input.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from tplower import TPCollectiveLowerer, TPExecutionOp, classify_tp_transition, create_tp_collective_lowerer
from tplower.testing import run_processes, run_threaded

CLASSIFY = [
    (("S(0)", "S(0)", ("tp",)), {"kind": "identity"}),
    (("R,R", "R,R", ("dp", "pp")), {"kind": "identity"}),
    (("S(1)", "R", ("tp",)), {"kind": "all_gather", "tensor_dim": 1}),
    (("P(sum)", "R", ("tp",)), {"kind": "all_reduce", "reduce_op": "sum"}),
    (("P(sum)", "S(0)", ("tp",)), {"kind": "reduce_scatter", "tensor_dim": 0, "reduce_op": "sum"}),
    (({"tp": "S(2)", "dp": "S(0)"}, {"dp": "S(0)"}, ("dp", "tp")), {"kind": "all_gather", "tensor_dim": 2}),
    (("R", "S(0)", ("tp",)), None),
    (("S(0)", "S(1)", ("tp",)), None),
    (("P(avg)", "R", ("tp",)), None),
    (("P(sum)", "P(max)", ("tp",)), None),
    (("S(0),R", "R,R", ("dp", "pp")), None),
    (("S(0),S(0)", "R,R", ("dp", "tp")), None),
]


@pytest.mark.parametrize(("args", "want"), CLASSIFY, ids=[f"{a[0]}->{a[1]}@{a[2]}" for a, _ in CLASSIFY])
def test_classify_tp_transition_table(args, want):
    assert classify_tp_transition(*args) == want


def test_classify_other_axis_name():
    assert classify_tp_transition("R,S(0)", "R,R", ("dp", "sp"), axis="sp") == {"kind": "all_gather", "tensor_dim": 0}
    assert classify_tp_transition("R,S(0)", "R,R", ("dp", "sp")) is None


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"kind": "broadcast"}, "kind='broadcast' is not a TP execution kind"),
    ({"kind": "all_reduce", "reduce_op": "prod"}, "reduce_op='prod'"),
    ({"kind": "all_gather"}, "needs tensor_dim"),
    ({"kind": "all_to_all", "tensor_dim": 0}, "needs dst_dim"),
    ({"kind": "all_reduce", "replicated_grad": "full"}, "replicated_grad='full'"),
    ({"kind": "all_reduce", "group_rank": 2}, "group_rank=2 is outside"),
])
def test_execution_op_rejects_bad_arguments(kwargs, match):
    args = {"group": None, "group_size": 2, "group_rank": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        TPExecutionOp(**args)


def test_lowerer_rejects_bad_convention():
    with pytest.raises(ValueError, match="replicated_grad"):
        TPCollectiveLowerer(("tp",), None, 2, 0, "gloo", replicated_grad="x")  # type: ignore[arg-type]


@pytest.mark.parametrize(("backend", "op", "kind"), [
    ("gloo", "sum", "reduce_scatter"),
    ("nccl", "max", "reduce_scatter"),
    ("mpi", "sum", "all_reduce_shard"),
    ("threaded", "max", "all_reduce_shard"),
    ("someother", "sum", "all_reduce_shard"),
    ("cpu:gloo,cuda:nccl", "sum", "reduce_scatter"),
])
def test_execution_op_remaps_by_backend(backend, op, kind):
    lowerer = TPCollectiveLowerer(("tp",), None, 2, 0, backend)  # type: ignore[arg-type]
    assert lowerer.execution_op("reduce_scatter", 0, op).kind == kind
    assert lowerer("P(sum)", "R").kind == "all_reduce"  # type: ignore[union-attr]
    assert lowerer("R", "R") is None and lowerer("R", "S(0)") is None


def _seeded(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _dtensor(mesh, x, src, dst, grad, g):
    x = x.clone().requires_grad_(True)
    out = DTensor.from_local(x, mesh, (src,), run_check=False).redistribute(mesh, (dst,)).to_local(
        grad_placements=(grad,))
    out.backward(g)
    return out.detach(), x.grad


# kind, tensor_dim, src, dst, input shape (per rank, world w)
OPS = [
    ("all_gather", 1, Shard(1), Replicate(), lambda w: (3, 2)),
    ("all_gather", -1, Shard(1), Replicate(), lambda w: (3, 2)),
    ("all_reduce", None, Partial("sum"), Replicate(), lambda w: (3, 5)),
    ("reduce_scatter", 0, Partial("sum"), Shard(0), lambda w: (2 * w, 3)),
    ("reduce_scatter", 0, Partial("sum"), Shard(0), lambda w: (2 * w + 1, 3)),  # uneven: torch.chunk pieces
    ("all_reduce_shard", 1, Partial("sum"), Shard(1), lambda w: (3, 2 * w)),
    ("all_to_all", 0, Shard(0), Shard(1), lambda w: (2, 2 * w)),
]


def _ops_body(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    results = []
    for convention in ("partial", "replicate"):
        lowerer = create_tp_collective_lowerer(mesh, ("tp",), replicated_grad=convention)
        assert lowerer is not None and lowerer.group_rank == rank and lowerer.group_size == world
        for kind, dim, src, dst, shape in OPS:
            op = lowerer.execution_op(kind, dim, dst_dim=1 if kind == "all_to_all" else None)
            grad = Partial("sum") if convention == "partial" and isinstance(dst, Replicate) else dst
            x = _seeded(shape(world), 10 + rank)  # a shard or a partial value: distinct per rank
            y = x.clone().requires_grad_(True)
            out = op.execute(y)
            g = _seeded(out.shape, 100 + rank)
            out.backward(g)
            want_out, want_grad = _dtensor(mesh, x, src, dst, grad, g)
            ok = torch.allclose(out, want_out, atol=1e-6) and torch.allclose(y.grad, want_grad, atol=1e-6)
            results.append((convention, kind, dim, ok, torch.equal(x, y.detach())))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_execution_ops_match_dtensor_threaded(world):
    for rank_results in run_threaded(world, _ops_body):
        assert len(rank_results) == 2 * len(OPS)
        bad = [r for r in rank_results if not (r[3] and r[4])]
        assert not bad, bad


@pytest.mark.slow  # the threaded test checks the same ops; gloo semantics run in test_conformance
def test_execution_ops_match_dtensor_gloo():
    for rank_results in run_processes(2, _ops_body):
        assert all(r[3] and r[4] for r in rank_results), rank_results


def _remap_body(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    lowerer = create_tp_collective_lowerer(mesh, ("tp",))
    assert lowerer is not None and lowerer.backend == "threaded"
    out = {}
    for op_name, reduce in (("max", lambda t: t.max(0).values), ("min", lambda t: t.min(0).values),
                            ("avg", lambda t: t.mean(0)), ("sum", lambda t: t.sum(0))):
        op = lowerer.execution_op("reduce_scatter", 0, op_name)
        x = _seeded((2 * world + 1, 3), 50 + rank)
        got = op.execute(x)
        every = torch.stack([_seeded((2 * world + 1, 3), 50 + r) for r in range(world)])
        want = torch.chunk(reduce(every), world, dim=0)
        want_r = want[rank] if rank < len(want) else want[0][:0]
        fn = op._programs[(x.shape, "cpu")].forward[0]
        out[op_name] = (op.kind, fn.func.__name__, torch.allclose(got, want_r, atol=1e-6))
    return out


def test_threaded_backend_remaps_max_min_reduce_scatter():
    # The threaded test group reduce-scatters only sum/avg: max/min run as all_reduce + local chunk.
    for res in run_threaded(4, _remap_body):
        assert res["max"] == ("all_reduce_shard", "all_reduce_chunk", True)
        assert res["min"] == ("all_reduce_shard", "all_reduce_chunk", True)
        assert res["avg"] == ("reduce_scatter", "reduce_scatter", True)
        assert res["sum"] == ("reduce_scatter", "reduce_scatter", True)


def _create_body(rank, world):
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    tp2 = create_tp_collective_lowerer(mesh2, ("dp", "tp"))
    none = create_tp_collective_lowerer(mesh2, ("dp", "pp"))
    permuted = DeviceMesh("cpu", torch.arange(world).flip(0), mesh_dim_names=("tp",))
    perm = create_tp_collective_lowerer(permuted, ("tp",))
    named = create_tp_collective_lowerer(mesh2, ("dp", "tp"), collective_backend="mpi")
    assert tp2 is not None and named is not None
    return (tp2.group_size, tp2.group_rank, tp2.backend, none, perm, named.backend,
            named.execution_op("reduce_scatter", 0).kind)


def test_create_lowerer_sub_mesh_missing_axis_and_permuted(caplog):
    with caplog.at_level(logging.WARNING, logger="tplower"):
        results = run_threaded(4, _create_body)
    for rank, (size, grank, backend, none, perm, named, kind) in enumerate(results):
        assert (size, grank, backend) == (2, rank % 2, "threaded")
        assert none is None and perm is None
        assert (named, kind) == ("mpi", "all_reduce_shard")
    assert "orders ranks" in caplog.text


def _minimal_backend_body(rank, world):
    # A backend name tplower does not know gets the safe minimum: no native reduce_scatter,
    # all_to_all or avg. Every op must still equal DTensor (run on the real threaded group).
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plain = create_tp_collective_lowerer(mesh, ("tp",), replicated_grad="replicate")
    assert plain is not None
    lowerer = TPCollectiveLowerer(("tp",), plain.group, world, rank, "someother", "replicate")
    out = []
    for kind, dim, op, src, dst, shape in [
        ("reduce_scatter", 0, "avg", Partial("avg"), Shard(0), (2 * world + 1, 3)),
        ("all_reduce", None, "avg", Partial("avg"), Replicate(), (3, 2)),
        ("all_to_all", 0, "sum", Shard(0), Shard(1), (2, 2 * world)),
    ]:
        top = lowerer.execution_op(kind, dim, op, dst_dim=1 if kind == "all_to_all" else None)
        x = _seeded(shape, 70 + rank)
        y = x.clone().requires_grad_(True)
        got = top.execute(y)
        again = top.execute(y)  # second call: the cached program
        g = _seeded(got.shape, 90 + rank)
        got.backward(g)
        want, want_grad = _dtensor(mesh, x, src, dst, dst, g)
        fn = top._programs[(x.shape, "cpu")].forward[0]
        out.append((top.kind, fn.func.__name__, torch.allclose(got, want, atol=1e-6),
                    torch.allclose(y.grad, want_grad, atol=1e-6), torch.equal(got, again)))
    try:
        lowerer.execution_op("all_gather", 2).execute(torch.ones(3, 3))
    except ValueError as exc:
        out.append(str(exc))
    return out


def test_unknown_backend_gets_correct_remaps():
    for res in run_threaded(4, _minimal_backend_body):
        assert res[0] == ("all_reduce_shard", "all_reduce_chunk", True, True, True)
        assert res[1] == ("all_reduce", "all_reduce", True, True, True)
        assert res[2] == ("all_to_all", "all_to_all_via_gather", True, True, True)
        assert "tensor_dim=2 is out of range for a 2-d tensor" in res[3]
