"""Siblings that read one tensor share its move (tplower.runtime.fanout), against one process, eager and compiled.

A pre-norm block whose attention feeds one tensor to ``q``, ``k``, ``v``
and whose MLP feeds one to ``gate`` and ``up``, column-parallel, with ``o``
and ``down`` row-parallel. Each sibling declares the same input move, so
the shared move saves collectives; counted by hand:

* plain plan: forward all-reduces ``o`` and ``down`` (2); backward
  all-reduces the attention input's gradient once and the MLP input's once
  (2, not 3 + 2 = 5). Total 4 all_reduces instead of 7.
* sequence parallelism: forward all-gathers the two inputs once each (each
  after a small all-gather of the ranks' sequence lengths, which no plan
  knows) and reduce-scatters ``o`` and ``down`` (2 + 2 + 2); backward
  all-gathers the two outputs' gradients and reduce-scatters the two
  inputs' (2 + 2). Without sharing, 5 all-gathers forward (and 5 length
  exchanges) and 5 reduce-scatters backward.

With ``parallelize(..., overlap=True)`` the eager siblings are fused nodes
that each all-reduce their own input gradient (7); the sharing is checked
with the default ``overlap=False``.

Values and every gradient (input included) equal one process; the user's
tensor carries nothing afterwards; a tensor changed in place between two
siblings is moved again; under ``torch.inference_mode`` (no version
counters) the identity moves are shared and the sequence-parallel gathers
each made (5, and 5 length exchanges); under ``torch.compile`` the backward graph holds one
all_reduce per shared input.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import tplower
from tplower.bench.graphs import GraphCapture
from tplower.core.lower.traffic import CollectiveTraffic
from tplower.runtime.boundary import FANOUT
from tplower.testing import run_processes

D, H = 8, 16


class Attn(nn.Module):
    def __init__(self, mutate: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(D, H), nn.Linear(D, H), nn.Linear(D, H), nn.Linear(H, D)
        self.mutate = mutate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        if self.mutate:  # k and v must see the changed tensor, not q's move of it
            x.mul_(2)
        return self.o(torch.tanh(q) * self.k(x) + self.v(x))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(D, H), nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Net(nn.Module):
    def __init__(self, mutate: bool = False) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(D), Attn(mutate), nn.LayerNorm(D), Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm1(x))
        return h + self.mlp(self.norm2(h))


PLAIN = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
         "mlp.gate": "colwise", "mlp.up": "colwise", "mlp.down": "rowwise"}
_SEQ_IN = {"style": "colwise", "in_src": {"0": {"tp": "S(1)"}}}
_SEQ_OUT = {"style": "rowwise", "out_dst": {"out": {"tp": "S(1)"}}}
SP = {"norm1": "sequence_parallel", "norm2": "sequence_parallel", "attn.q": _SEQ_IN, "attn.k": _SEQ_IN,
      "attn.v": _SEQ_IN, "attn.o": _SEQ_OUT, "mlp.gate": _SEQ_IN, "mlp.up": _SEQ_IN, "mlp.down": _SEQ_OUT}


def _net(mutate: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(mutate)


def _x() -> torch.Tensor:
    return torch.randn(2, 6, D, generator=torch.Generator().manual_seed(1))


def _worst_grad(ours: nn.Module, ref: nn.Module) -> float:
    theirs = dict(ref.named_parameters())
    worst = 0.0
    for name, p in ours.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        worst = max(worst, (g - theirs[name].grad).abs().max().item())
    return worst


def _eager(mesh: Any, rank: int, world: int, sp: bool, overlap: bool = False) -> dict[str, Any]:
    ref = _net()
    model = tplower.parallelize(copy.deepcopy(ref), mesh, SP if sp else PLAIN, overlap=overlap)
    x_ref = _x().requires_grad_()
    ref(x_ref).square().sum().backward()
    x = _x()
    if sp:  # this rank's sequence rows in, its rows out
        x = x.chunk(world, 1)[rank]
    x = x.detach().requires_grad_()
    with CollectiveTraffic() as traffic:
        y = model(x)
        y.square().sum().backward()
    want = ref(_x()).detach()
    if sp:
        want = want.chunk(world, 1)[rank]
    want_xgrad = x_ref.grad.chunk(world, 1)[rank] if sp else x_ref.grad
    return {"out": (y - want).abs().max().item(), "grads": _worst_grad(model, ref),
            "input_grad": (x.grad - want_xgrad).abs().max().item(), "counts": dict(traffic.counts),
            "user_tensor_marked": hasattr(x, FANOUT)}


def _mutating(mesh: Any, rank: int, world: int) -> float:
    """Sequence parallelism, no grad: ``x.mul_(2)`` between ``q`` and ``k`` is seen by ``k`` and ``v``."""
    ref = _net(mutate=True)
    model = tplower.parallelize(copy.deepcopy(ref), mesh, SP)
    with torch.no_grad():
        want = ref(_x()).chunk(world, 1)[rank]
        got = model(_x().chunk(world, 1)[rank].clone())
    return (got - want).abs().max().item()


def _inference(mesh: Any, rank: int, world: int) -> dict[str, Any]:
    """``torch.inference_mode`` (no version counters): identity moves shared, the SP gathers each made."""
    ref = _net()
    out = {}
    for name, plan in (("plain", PLAIN), ("sp", SP)):
        model = tplower.parallelize(copy.deepcopy(ref), mesh, plan)
        x = _x() if name == "plain" else _x().chunk(world, 1)[rank]
        with torch.inference_mode(), CollectiveTraffic() as traffic:
            got = model(x)
        want = ref(_x()).detach()
        want = want if name == "plain" else want.chunk(world, 1)[rank]
        out[name] = ((got - want).abs().max().item(), dict(traffic.counts))
    return out


def _alone(mesh: Any, rank: int, world: int) -> dict[str, int]:
    """A sibling called on its own, twice on one tensor: no parent call, nothing shared."""
    model = tplower.parallelize(_net(), mesh, SP)
    x = _x().chunk(world, 1)[rank]
    with torch.no_grad(), CollectiveTraffic() as traffic:
        model.attn.q(x)
        model.attn.k(x)
    return dict(traffic.counts)


def _compiled(mesh: Any) -> dict[str, Any]:
    ref = _net()
    model = tplower.parallelize(copy.deepcopy(ref), mesh, PLAIN)
    cap = GraphCapture()
    x_ref = _x().requires_grad_()
    ref(x_ref).square().sum().backward()
    x = _x().requires_grad_()
    torch.compile(model, backend=cap, fullgraph=True)(x).square().sum().backward()

    def count(g: Any, name: str) -> int:
        return sum(1 for n in g.graph.nodes if n.op == "call_function" and name in str(n.target))

    # the root's own hooks (the replicated norms' swaps) trace as a frame of their own, with no collective
    return {"grads": _worst_grad(model, ref), "input_grad": (x.grad - x_ref.grad).abs().max().item(),
            "forward_all_reduce": sum(count(g, "all_reduce") for g in cap.forward),
            "backward_all_reduce": sum(count(g, "all_reduce") for g in cap.backward)}


def _body(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return {"plain": _eager(mesh, rank, world, False), "sp": _eager(mesh, rank, world, True),
            "overlapped": _eager(mesh, rank, world, False, overlap=True),
            "mutating": _mutating(mesh, rank, world), "alone": _alone(mesh, rank, world),
            "inference": _inference(mesh, rank, world),
            "compiled": _compiled(mesh)}


def test_siblings_share_one_move_eager_and_compiled_as_one_process() -> None:
    for res in run_processes(2, _body, timeout=300):
        plain, sp, comp, over = res["plain"], res["sp"], res["compiled"], res["overlapped"]
        for r in (plain, sp, over):
            assert r["out"] < 1e-5 and r["grads"] < 1e-5 and r["input_grad"] < 1e-5, r
            assert not r["user_tensor_marked"]
        assert plain["counts"].get("all_reduce") == 4, plain["counts"]  # 7 without sharing
        # overlap=True: each colwise sibling all-reduces its own input gradient, overlapped (tplower.runtime.overlap)
        assert over["counts"].get("all_reduce") == 7, over["counts"]
        # sequence parallelism: 2 forward gathers of the sequence (shared by q, k, v; mlp.up), each after one
        # exchange of its local length (a sequence is never assumed to divide), 2 forward reduce_scatters (o, down)
        # and each one's dual in backward
        assert sp["counts"].get("all_gather") == 6 and sp["counts"].get("reduce_scatter") == 4, sp["counts"]
        assert res["mutating"] < 1e-5
        assert res["alone"].get("all_gather") == 4, res["alone"]  # q's and k's own gathers, each with its exchange
        (plain_diff, plain_counts), (sp_diff, sp_counts) = res["inference"]["plain"], res["inference"]["sp"]
        assert plain_diff < 1e-5 and sp_diff < 1e-5, res["inference"]
        # inference mode: each of the 5 sequence gathers made (q, k, v, gate, up), each with its exchange
        assert plain_counts.get("all_reduce") == 2 and sp_counts.get("all_gather") == 10, res["inference"]
        assert comp["grads"] < 1e-5 and comp["input_grad"] < 1e-5, comp
        assert (comp["forward_all_reduce"], comp["backward_all_reduce"]) == (2, 2), comp


@pytest.fixture(scope="module", autouse=True)
def _native_all_reduce(native_all_reduce: None) -> None:
    """This module counts collectives by the names the lowering gives them: gloo's small all_reduces run natively."""
