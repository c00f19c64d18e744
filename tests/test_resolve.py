"""Resolve, the first stage of ``parallelize``: a plan described per module, the model untouched.

For tiny Llama (``"auto"``), Qwen3-MoE (``"auto"`` with ``experts="ep"``) and BERT (``"derive"``) on 2 threaded
ranks, :func:`tplower.nn.resolve.resolve_plan` must describe what transformers' plans say (a hand table below:
q/k/v/gate/up colwise = weight ``S(0)`` and an input ``R -> R`` whose gradient is all-reduced, o/down rowwise =
weight ``S(1)`` and an output ``P(sum) -> R``; experts by index under ``ep``), and leave the model exactly as it
was: every parameter the same object with the same bytes and no DTensor, no instance ``forward``, no hook, no
collective issued (counted at the dispatcher). A refused plan is refused by resolve alike, before anything
changes.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tplower import TPLowerError
from tplower.core.language.placements import format_placements
from tplower.core.lower.traffic import CollectiveTraffic
from tplower.nn.resolve import ResolvedPlan, resolve_plan
from tplower.run.hf_table import architectures, tiny_model
from tplower.testing import run_threaded


def _state(model: nn.Module) -> dict[str, Any]:
    """Everything resolve must not change: parameter objects and bytes, instance forwards, hooks."""
    return {
        "params": [(n, id(p), type(p).__name__, hashlib.sha256(p.detach().numpy().tobytes()).hexdigest())
                   for n, p in model.named_parameters()],
        "forwards": [q for q, m in model.named_modules() if "forward" in m.__dict__],
        "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
                     for m in model.modules()),
        "attrs": [(q, sorted(k for k in m.__dict__ if k.startswith("_tplower"))) for q, m in model.named_modules()],
    }


def _summary(resolved: ResolvedPlan, quals: list[str]) -> dict[str, Any]:
    out = {}
    for qual in quals:
        mp = resolved[qual]
        out[qual] = {"form": mp.form.form, "params": {n: format_placements(lay.placements) for n, lay in mp.layouts},
                     "ins": [f"{format_placements(m.src)}->{format_placements(m.dst)} grad {format_placements(m.grad)}"
                             for m in mp.ins],
                     "outs": [f"{format_placements(m.src)}->{format_placements(m.dst)}" for m in mp.outs],
                     "experts": mp.num_experts, "local_attrs": dict(mp.local_attrs)}
    return out


def _bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=64, max_position_embeddings=32))


CASES: dict[str, tuple[Any, dict[str, Any], list[str]]] = {
    "llama": (lambda: tiny_model(architectures(["llama"])[0]), {"plan": "auto"},
              ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.up_proj",
               "model.layers.1.mlp.down_proj"]),
    "qwen3_moe_ep": (lambda: tiny_model(architectures(["qwen3_moe"])[0]), {"plan": "auto", "experts": "ep"},
                     ["model.layers.0.mlp.experts", "model.layers.0.self_attn.k_proj"]),
    "bert_derive": (_bert, {"plan": "derive"}, ["encoder.layer.0.attention.self.query",
                                                "encoder.layer.0.attention.output.dense",
                                                "encoder.layer.0.intermediate.dense"]),
}
# the plan names in any case: the same hand tables
CASES["llama_Auto"] = (CASES["llama"][0], {"plan": "Auto"}, CASES["llama"][2])
CASES["bert_DERIVE"] = (_bert, {"plan": "DERIVE"}, CASES["bert_derive"][2])

COLWISE = {"form": "tp_collective", "params": {"weight": "S(0)"}, "ins": ["R->R grad P(sum)"], "outs": [],
           "experts": None, "local_attrs": {}}
ROWWISE = {"form": "tp_collective", "params": {"weight": "S(1)"}, "ins": [], "outs": ["P(sum)->R"], "experts": None,
           "local_attrs": {}}
WANT = {
    "llama": {"model.layers.0.self_attn.q_proj": COLWISE, "model.layers.0.self_attn.o_proj": ROWWISE,
              "model.layers.0.mlp.up_proj": COLWISE, "model.layers.1.mlp.down_proj": ROWWISE},
    "qwen3_moe_ep": {
        # the experts sharded by index (S(0) of [experts, ...]), the tokens chunked in and gathered out
        "model.layers.0.mlp.experts": {"form": "tp_collective", "params": {"gate_up_proj": "S(0)",
                                                                          "down_proj": "S(0)"},
                                       "ins": ["R->S(0) grad S(0)", "R->S(0) grad S(0)", "R->S(0) grad S(0)"],
                                       "outs": ["S(0)->R"], "experts": 4, "local_attrs": {"num_experts": 2}},
        "model.layers.0.self_attn.k_proj": COLWISE},
    "bert_derive": {"encoder.layer.0.attention.self.query": {**COLWISE, "params": {"weight": "S(0)", "bias": "S(0)"}},
                    # the bias of a row-parallel layer stays whole, added once after the reduction
                    "encoder.layer.0.attention.output.dense": {**ROWWISE, "params": {"weight": "S(1)", "bias": "R"}},
                    "encoder.layer.0.intermediate.dense": {**COLWISE, "params": {"weight": "S(0)", "bias": "S(0)"}}},
}
WANT["llama_Auto"], WANT["bert_DERIVE"] = WANT["llama"], WANT["bert_derive"]


def _body(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for name, (make, kw, quals) in CASES.items():
        model = make()
        before = _state(model)
        with warnings.catch_warnings(), CollectiveTraffic() as traffic:
            warnings.simplefilter("ignore")
            resolved = resolve_plan(model, mesh, **kw)
        out[name] = {"summary": _summary(resolved, quals), "unchanged": _state(model) == before,
                     "collectives": dict(traffic.counts), "lines": len(resolved.lines()),
                     "dtensors": sum(isinstance(p, DTensor) for p in model.parameters())}
    return out


def test_resolve_describes_the_plan_and_leaves_the_model_untouched() -> None:
    for per_rank in run_threaded(2, _body):
        for name, got in per_rank.items():
            assert got["unchanged"] and got["dtensors"] == 0, name
            assert got["collectives"] == {}, (name, got["collectives"])
            assert got["lines"] > 0, name
            assert got["summary"] == WANT[name], (name, got["summary"])


def _refused(rank: int, world: int) -> tuple[str, bool]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    before = _state(model)
    with pytest.raises(TPLowerError) as exc:
        resolve_plan(model, mesh, {"0": "colwise", "1": {"style": "rowwise", "uneven": ["x"]}})
    return str(exc.value), _state(model) == before


def test_a_refused_plan_is_refused_before_anything_changes() -> None:
    for msg, unchanged in run_threaded(2, _refused):
        assert msg.startswith("plan['1'].uneven: ['x'] name no declared input or output") and unchanged
