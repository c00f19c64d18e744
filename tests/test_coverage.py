"""Every parameter covered: a learnable parameter between a colwise and a rowwise layer, as Apertus' xIELU has.

The plan names only ``up`` (colwise) and ``down`` (rowwise); the activation between them has its own
learnable ``alpha`` (a scalar computed through ``softplus``, as ``alpha_p``) and ``scale`` (per feature would
be sharded; here a whole vector over the hidden dim used after the reduction, which must stay whole). On 2
threaded ranks against one process: by default the first forward finds ``alpha`` used on the sharded
activation and all-reduces its gradient (3 AdamW steps equal one process); ``cover="refuse"`` and
``replicate_rest=False`` refuse before any backward, naming the parameter, its module and the plan entry;
that entry makes it right with nothing left to cover; a parameter used on sharded and whole activations
alike is refused.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import tplower
from tplower import TPLowerError
from tplower.testing import run_threaded

PLAN: dict[str, Any] = {"up": "colwise", "down": "rowwise"}


class _Act(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor([0.3]))
        self.register_buffer("beta", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = nn.functional.softplus(self.alpha)
        return torch.where(x > 0, a * x * x + self.beta * x, torch.expm1(x.clamp(max=0)) * a)


class _Model(nn.Module):
    def __init__(self, mixed: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.act = _Act()
        self.down = nn.Linear(16, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.mixed = mixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        y = self.down(self.act(self.up(h)))
        if self.mixed:  # alpha also scales the whole residual: no one reduction is right
            y = y + self.act.alpha * h
        return (h + y) * self.scale


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}


def _train(ref: nn.Module, tp: nn.Module, x: torch.Tensor) -> dict[str, float]:
    one = copy.deepcopy(ref)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) for m in (one, tp)]
    worst = {"out": 0.0, "grad": 0.0}
    for _ in range(3):
        outs = []
        for m, opt in zip((one, tp), opts, strict=True):
            opt.zero_grad()
            out = m(x)
            outs.append(out)
            out.square().mean().backward()
        g1, g2 = _grads(one), _grads(tp)
        worst["out"] = max(worst["out"], float((outs[0] - outs[1]).abs().max()))
        worst["grad"] = max(worst["grad"], *(float((g2[n] - g1[n]).abs().max()) for n in g1))
        for opt in opts:
            opt.step()
    worst["params"] = max(float(((q.full_tensor() if isinstance(q, DTensor) else q) - p).abs().max())
                          for p, q in zip(one.parameters(), tp.parameters(), strict=True))
    return worst


def _refusal(ref: nn.Module, mesh: Any, x: torch.Tensor, **kw: Any) -> dict[str, Any]:
    tp = tplower.parallelize(copy.deepcopy(ref), mesh, PLAN, **kw)
    try:
        tp(x)
    except TPLowerError as exc:
        return {"msg": str(exc), "grads": [n for n, p in tp.named_parameters() if p.grad is not None]}
    return {"msg": None}


def _body(rank: int, world: int, ref: nn.Module, mixed: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    tp = tplower.parallelize(copy.deepcopy(ref), mesh, PLAN)
    out["reduce"] = _train(ref, tp, x)
    out["reduced"] = tp.__dict__["_tplower_coverage"].reduced  # each named in a warning too
    tp = tplower.parallelize(copy.deepcopy(ref), mesh, {**PLAN, "act": "replicated_with_grad_allreduce"})
    out["entry"] = _train(ref, tp, x)
    out["entry_reduced"] = tp.__dict__["_tplower_coverage"].reduced
    try:
        tplower.parallelize(copy.deepcopy(ref), mesh, PLAN, cover="sometimes")
    except ValueError as exc:
        out["bad_cover"] = str(exc)
    out["refuse"] = _refusal(ref, mesh, x, cover="refuse")
    out["plain"] = _refusal(ref, mesh, x, replicate_rest=False)
    out["mixed"] = _refusal(mixed, mesh, x)
    # a first forward without gradients probes nothing; the next one with gradients does
    tp = tplower.parallelize(copy.deepcopy(ref), mesh, PLAN, cover="refuse")
    hooks = [len(tp.up._forward_hooks) + len(tp.down._forward_hooks)]
    with torch.no_grad():
        tp(x)
    hooks.append(len(tp.up._forward_hooks) + len(tp.down._forward_hooks))
    out["no_grad_then"] = _refusal_after(tp, x)
    hooks.append(len(tp.up._forward_hooks) + len(tp.down._forward_hooks))
    out["boundary_hooks"] = hooks
    return out


def _refusal_after(tp: nn.Module, x: torch.Tensor) -> str | None:
    try:
        tp(x)
    except TPLowerError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    torch.manual_seed(0)
    ref, mixed = _Model(), _Model(mixed=True)
    mixed.load_state_dict(ref.state_dict())
    return run_threaded(2, _body, ref, mixed, torch.randn(2, 5, 8))


def test_parameter_between_colwise_and_rowwise_gets_its_gradient_reduced(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["reduce"]["out"] <= 1e-5 and r["reduce"]["grad"] <= 1e-5 and r["reduce"]["params"] <= 1e-5, r
        assert r["reduced"] == ["act.alpha"]  # found by placements: norm, scale and the linears are not named


def test_the_plan_entry_covers_it_without_a_warning(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["entry"]["grad"] <= 1e-5 and r["entry"]["params"] <= 1e-5, r
        assert r["entry_reduced"] == []  # the plan places it: nothing left to cover, no warning


@pytest.mark.parametrize("case", ["refuse", "plain"])
def test_refused_before_any_backward_naming_the_fix(results: list[dict[str, Any]], case: str) -> None:
    for r in results:
        msg = r[case]["msg"]
        assert msg is not None and "parameter 'alpha' of module 'act'" in msg, msg
        assert "{'act': 'replicated_with_grad_allreduce'}" in msg
        assert r[case]["grads"] == []


def test_sharded_and_whole_uses_are_refused(results: list[dict[str, Any]]) -> None:
    for r in results:
        msg = r["mixed"]["msg"]
        assert msg is not None and "'alpha' of module 'act'" in msg and "both" in msg, msg


def test_a_no_grad_forward_leaves_the_probe_armed(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["no_grad_then"] is not None and "'alpha'" in r["no_grad_then"]


def test_boundaries_carry_no_hook_between_calls(results: list[dict[str, Any]]) -> None:
    # the probe hooks the boundaries only while it runs, so a compiled model (never probed) traces none
    for r in results:
        assert r["boundary_hooks"] == [0, 0, 0], r["boundary_hooks"]


def test_cover_mode_is_checked(results: list[dict[str, Any]]) -> None:
    assert "cover='sometimes'" in results[0]["bad_cover"] and "'refuse'" in results[0]["bad_cover"]
