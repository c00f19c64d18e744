"""Parameters a plan leaves whole: ``Replicate`` DTensors by default, usable wherever the model reads them.

A small model whose plan names only its MLP: a norm the plan does not name, a convolution whose parent reads
its weight directly (as Mamba mixers read ``self.conv1d.weight``) and a parameter tied between two unplanned
modules. Against one process: output, every
gradient, ``clip_grad_norm_`` and three ``AdamW(foreach=True)`` steps (2 threaded ranks); and
``replicate_rest=False`` keeps the old plain tensors.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

import tplower
from tplower.testing import run_threaded

PLAN = {"up": "colwise", "down": "rowwise"}


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1, groups=8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, 8, bias=False)
        self.tail = nn.Linear(8, 8, bias=False)
        self.tail.weight = self.head.weight  # tied, neither planned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.conv1d(x.transpose(1, 2), self.conv.weight, self.conv.bias, padding=1, groups=8)
        h = self.norm(h.transpose(1, 2))
        h = h + self.down(torch.relu(self.up(h)))
        return self.tail(self.head(h))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}


def _body(rank: int, world: int, ref: nn.Module, x: torch.Tensor, rest: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    one, tp = copy.deepcopy(ref), tplower.parallelize(copy.deepcopy(ref), mesh, PLAN, replicate_rest=rest)
    out: dict[str, Any] = {"kinds": {n: (type(p.data).__name__, tuple(p.placements) if isinstance(p, DTensor)
                                         else None) for n, p in tp.named_parameters()}}
    if not rest:
        return out
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (one, tp)]
    worst, norms = 0.0, []
    for _ in range(3):
        for m, opt in zip((one, tp), opts, strict=True):
            opt.zero_grad()
            m(x).square().mean().backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5).full_tensor()
                               if m is tp else torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)))
        g1, g2 = _grads(one), _grads(tp)
        worst = max(worst, *(float((g2[n] - g1[n]).abs().max()) for n in g1))
        for opt in opts:
            opt.step()
    out["grad"] = worst
    out["norms"] = norms
    out["params"] = max(float(((q.full_tensor() if isinstance(q, DTensor) else q) - p).abs().max())
                        for p, q in zip(one.parameters(), tp.parameters(), strict=True))
    out["tied"] = tp.head.weight is tp.tail.weight
    return out


def _setup() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _Model(), torch.randn(2, 5, 8)


def test_every_parameter_is_a_dtensor_and_trains_as_one_process() -> None:
    ref, x = _setup()
    for r in run_threaded(2, _body, ref, x, True):
        assert all(kind == "DTensor" or placements is not None for kind, placements in r["kinds"].values())
        assert r["kinds"]["norm.weight"][1] == (Replicate(),) and r["kinds"]["conv.weight"][1] == (Replicate(),)
        assert r["grad"] <= 1e-5 and r["params"] <= 1e-5, r
        norms = r["norms"]
        assert all(abs(a - b) <= 1e-5 * a for a, b in zip(norms[::2], norms[1::2], strict=True)), norms
        assert r["tied"]


def test_replicate_rest_false_keeps_plain_tensors() -> None:
    ref, x = _setup()
    kinds = run_threaded(2, _body, ref, x, False)[0]["kinds"]
    assert kinds["norm.weight"][1] is None and kinds["conv.weight"][1] is None and kinds["head.weight"][1] is None
    assert kinds["up.weight"][1] is not None  # the plan's own placements are kept


def _copy_body(rank: int, world: int, ref: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    import gc

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    tp = tplower.parallelize(copy.deepcopy(ref), mesh, PLAN)
    twin = copy.deepcopy(tp)
    own = {id(hook.stack) for m in (tp, twin) for m2 in m.modules() for hook in m2._forward_hooks.values()
           if hasattr(hook, "stack")}
    del tp
    gc.collect()  # the original and its stack are gone: the copy swaps through a stack of its own
    one = copy.deepcopy(ref)
    outs = [m(x) for m in (one, twin)]
    for out in outs:
        out.square().mean().backward()
    g1, g2 = _grads(one), _grads(twin)
    return {"stacks": len(own), "out": float((outs[0] - outs[1]).abs().max()),
            "grad": max(float((g2[n] - g1[n]).abs().max()) for n in g1),
            "dtensors": all(isinstance(p, DTensor) for p in twin.parameters())}


def test_a_deep_copy_swaps_on_its_own_after_the_original_is_gone() -> None:
    ref, x = _setup()
    for r in run_threaded(2, _copy_body, ref, x):
        assert r["stacks"] == 2 and r["dtensors"], r  # one stack per model; every parameter put back after the call
        assert r["out"] <= 1e-5 and r["grad"] <= 1e-5, r
