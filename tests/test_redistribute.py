"""redistribute_local's contract: plan caching, the DTensor fallback, errors, aliasing, no-grad calls."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate

import tplower.core.lower.redistribute as redistribute_mod
from tplower import TPLowerError, mesh_lowerer, redistribute_local
from tplower.testing import run_threaded


def _cache_body(rank, world, calls):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = torch.full((2, 3), float(rank))
    a = redistribute_local(x, mesh, "S(0)", "R")
    b = redistribute_local(x, mesh, {"tp": "S(0)"}, "R")  # another spelling: its own cache entry
    c = redistribute_local(x, mesh, "S(0)", "R")
    p1 = mesh_lowerer(mesh).program("S(0)", "R", x.shape, "cpu")
    p2 = mesh_lowerer(mesh).program("S(0)", "R", x.shape, "cpu")
    return calls.count(rank), p1 is p2, torch.equal(a, c) and torch.equal(a, b), a[:, 0].tolist()


def test_second_call_does_no_planning(monkeypatch):
    calls: list[int] = []
    real = redistribute_mod.plan_transition

    def counting(*args, **kwargs):
        calls.append(args[4][0])  # the rank's coordinate
        return real(*args, **kwargs)

    monkeypatch.setattr(redistribute_mod, "plan_transition", counting)
    for rank, (planned, same, equal, col) in enumerate(run_threaded(2, _cache_body, calls)):
        assert planned == 2 and same and equal  # one plan per spelling, none on the repeat
        assert col == [0.0, 0.0, 1.0, 1.0], rank


def _fallback_body(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = torch.full((3,), float(rank + 2), requires_grad=True)
    out = redistribute_local(x, mesh, [Partial("product")], [Replicate()])
    prog = mesh_lowerer(mesh).program([Partial("product")], [Replicate()], x.shape, "cpu")
    out.sum().backward()
    return out.tolist(), prog.fallback_reason, x.grad is not None


def test_unlowered_placement_falls_back_to_dtensor(caplog):
    with caplog.at_level(logging.DEBUG, logger="tplower"):
        results = run_threaded(2, _fallback_body)
    for out, reason, has_grad in results:
        assert out == [6.0, 6.0, 6.0]  # 2 * 3, the product over the two ranks
        assert reason == "Partial('product') is not lowered" and has_grad
    assert "falls back to DTensor" in caplog.text


def _errors_body(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = torch.ones(4, 3)
    messages = []
    for kwargs in ({"global_shape": (20, 3)}, {"global_shape": (8,)}):
        with pytest.raises(TPLowerError) as info:
            redistribute_local(x, mesh, "S(0)", "R", **kwargs)
        messages.append(str(info.value))
    mesh2 = init_device_mesh("cpu", (world, 1), mesh_dim_names=("a", "b"))
    with pytest.raises(TPLowerError) as info:
        redistribute_local(x, mesh2, "P(sum),P(max)", "R,R")
    messages.append(str(info.value))
    with pytest.raises(TPLowerError) as info:
        redistribute_local(x, mesh, "S(0),R", "R")
    messages.append(str(info.value))
    with pytest.raises(TPLowerError) as info:
        redistribute_local(x, mesh, "P(sum)", "P(max)")
    messages.append(str(info.value))
    with pytest.raises(TPLowerError) as info:
        redistribute_local(x, mesh, "R", "S(0)", grad="R")
    messages.append(str(info.value))
    return messages


def test_errors_name_the_argument_and_value():
    msgs = run_threaded(2, _errors_body)[0]
    assert "local tensor has shape (4, 3)" in msgs[0] and "gives (10, 3)" in msgs[0]
    assert "global_shape=(8,) has 1 dim but the local tensor has 2" in msgs[1]
    assert "mixes Partial reduce ops" in msgs[2]
    assert "cannot change its reduce op" in msgs[4]
    assert "does not fit the output" in msgs[5]
    assert "'S(0),R' has 2 placements but the mesh has 1 axis" in msgs[3]


def _alias_body(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = torch.arange(6.0).reshape(2, 3) + rank
    same = redistribute_local(x, mesh, "S(0)", "S(0)")
    y = x.clone().requires_grad_(True)
    ident = redistribute_local(y, mesh, "R", "R", grad="P(sum)")  # forward identity, backward all_reduce
    ident.backward(torch.ones_like(ident))
    no_grad = redistribute_local(x, mesh, "P(sum)", "R")
    return same is x, ident is not y, y.grad.tolist(), no_grad.grad_fn is None, no_grad.tolist()


def test_identity_aliases_only_outside_autograd_and_backward_still_runs():
    for same, new_obj, grad, no_graph, summed in run_threaded(2, _alias_body):
        assert same and new_obj and no_graph
        assert grad == [[2.0] * 3] * 2  # the all_reduce of two ones
        assert summed == [[1.0, 3.0, 5.0], [7.0, 9.0, 11.0]]


def _drop_body(rank, world):
    import gc
    import weakref

    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("tp",))
    redistribute_local(torch.ones(2, 2), mesh, "P(sum)", "R")
    lowerer = mesh_lowerer(mesh)
    ref = weakref.ref(mesh)
    del mesh
    gc.collect()
    return ref() is None, lowerer._mesh_ref() is None


def test_lowerers_do_not_keep_meshes_alive():
    # A kept mesh would also keep DTensor's weakref-keyed plans for it alive and matching new meshes.
    for dropped, lowerer_sees_it in run_threaded(2, _drop_body):
        assert dropped and lowerer_sees_it


def _double_backward_body(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = torch.ones(2, 3, requires_grad=True)
    y = redistribute_local(x, mesh, "S(0)", "R")
    (g,) = torch.autograd.grad((y * y).sum(), x)  # plain backward works
    y2 = redistribute_local(x, mesh, "S(0)", "R")
    try:
        torch.autograd.grad((y2 * y2).sum(), x, create_graph=True)
    except RuntimeError as exc:
        return g.tolist(), str(exc)
    return g.tolist(), "no error"


def test_double_backward_raises_instead_of_a_silent_wrong_answer():
    for grad, message in run_threaded(2, _double_backward_body):
        # d/dx sum(gather(x)^2) = 2 * x, chunked back to this rank's rows
        assert grad == [[2.0] * 3] * 2
        assert "differentiable once" in message
