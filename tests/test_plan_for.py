"""``tplower.plan_for``: the plan ``"auto"`` or ``"derive"`` installs, as a plain mapping a user edits and passes back.

On tiny Llama and 2 threaded ranks: the mapping passed back to ``parallelize`` places every parameter and gives
every output and gradient as the plan's name does; the model's own plan with one change (embeddings whole) gives
one process's logits and gradients with the embedding replicated; bad arguments are refused naming them.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import tplower
from tplower import TPLowerError
from tplower.run.hf_configs import architectures, tiny_model
from tplower.testing import run_threaded

ATOL, RTOL = 1e-5, 1e-4
EMBED = "model.embed_tokens"


def _placed(model: nn.Module) -> dict[str, str]:
    return {n: tplower.format_placements(p.placements) for n, p in model.named_parameters()}


def _step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The logits and every parameter's whole gradient of one forward and backward."""
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach()
             for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def _round_trips(rank: int, world: int, ref: nn.Module) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    untouched = copy.deepcopy(ref)
    plans = {"auto": tplower.plan_for(untouched, "auto"), "derive": tplower.plan_for(untouched, "Derive", tp=world)}
    pairs = zip(untouched.parameters(), ref.parameters(), strict=True)
    out: dict[str, Any] = {"plans": plans, "unchanged": all(torch.equal(a, b) and type(a) is type(b) for a, b in pairs)}
    for name, plan in plans.items():
        by_name = tplower.parallelize(copy.deepcopy(ref), mesh, name)
        by_map = tplower.parallelize(copy.deepcopy(ref), mesh, copy.deepcopy(plan))
        out[name] = (_placed(by_name), _placed(by_map), _step(by_name, ids), _step(by_map, ids))
    changed = {**plans["auto"], EMBED: "replicate"}  # the model's own plan with one change: embeddings whole
    one = tplower.parallelize(copy.deepcopy(ref), mesh, changed)
    out["changed"] = (_placed(one), _step(one, ids), _step(copy.deepcopy(ref), ids))
    return out


def test_plan_for_gives_back_what_the_plan_name_installs() -> None:
    ref = tiny_model(architectures(["llama"])[0])
    for got in run_threaded(2, _round_trips, ref):
        assert got["unchanged"]
        auto = got["plans"]["auto"]
        assert type(auto) is dict and all(isinstance(v, str) for v in auto.values())
        assert auto[EMBED] == "embedding_rowwise" and auto["model.layers.*.mlp.down_proj"] == "rowwise"
        for name in ("auto", "derive"):
            placed_name, placed_map, (logits_name, grads_name), (logits_map, grads_map) = got[name]
            assert placed_map == placed_name and "S(0)" in placed_name.values()
            torch.testing.assert_close(logits_map, logits_name, atol=0, rtol=0)
            assert grads_map.keys() == grads_name.keys()
            for n in grads_name:
                torch.testing.assert_close(grads_map[n], grads_name[n], atol=0, rtol=0)
        placed, (logits, grads), (want_logits, want_grads) = got["changed"]
        assert placed[f"{EMBED}.weight"] == "R" and placed["model.layers.0.mlp.up_proj.weight"] == "S(0)"
        torch.testing.assert_close(logits, want_logits, atol=ATOL, rtol=RTOL)  # one process's answer
        for n, want in want_grads.items():
            torch.testing.assert_close(grads[n], want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(("args", "kwargs", "error", "said"), [
    (("auto",), {}, TypeError, "plan_for: model must be a torch.nn.Module, got str"),
    ((nn.Linear(2, 2), "mine.yaml"), {}, TPLowerError, "plan_for: plan='mine.yaml'; allowed: 'auto'"),
    ((nn.Linear(2, 2), {"up": "colwise"}), {}, TPLowerError, "a mapping or a YAML/JSON file is a plan already"),
    ((nn.Linear(2, 2), "auto"), {"experts": "dp"}, ValueError, "plan_for: experts='dp'; allowed: 'tp'"),
    ((nn.Linear(2, 2), "derive"), {"tp": 0}, TPLowerError, "plan_for: tp=0; the axis' size is at least 1"),
    ((nn.Linear(2, 2), "derive"), {"tp": 2.0}, TypeError, "tp"),
    ((nn.Linear(2, 2), "auto"), {}, TPLowerError, "Linear"),
], ids=["model", "file", "mapping", "experts", "tp", "tp type", "no plan"])
def test_plan_for_refuses_naming_the_argument(args: tuple[Any, ...], kwargs: dict[str, Any], error: type,
                                               said: str) -> None:
    with pytest.raises(error) as refused:
        tplower.plan_for(*args, **kwargs)
    assert said in str(refused.value), str(refused.value)
