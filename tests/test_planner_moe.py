"""``tplower.plan_layout`` on a mixture-of-experts model: the traced step against the real one on 2 gloo ranks.

A fake step has no router values, so under expert parallelism the trace takes the routing as balanced (slot ``s``
of a rank's ``T * k`` to expert ``s mod E``: :func:`tplower.core.ops.dispatch.plan_dispatch`). With the real
model's routers made to route so, the prediction is checked as a dense model's is (peak within 5%, collectives and
FLOPs equal); with the routers as initialised the peak still holds to 5% and only the ``all_to_all`` bytes move
with the routing. Experts sharded inside (``experts="tp"``), FSDP2 over ``dp`` and cp do not depend on the routing
(their collectives are exact with any router).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

import tplower
from tplower.planner import measure_step, trace_step
from tplower.planner.trace import build_mesh
from tplower.testing import run_processes

STEP: dict[str, Any] = {"seq_len": 64, "micro_batch": 2, "context_mode": "ulysses"}
TOL = 0.05
#: bf16: transformers' experts run ``grouped_mm``, whose shape rule under fake tensors takes bf16 only
DTYPE = torch.bfloat16
CASES = [({"tp": 2}, {"experts": "ep"}), ({"tp": 2}, {"experts": "tp"})]
#: with TPLOWER_SLOW=1 too
MORE = [({"tp": 2}, {"experts": "ep", "checkpointing": True}), ({"dp": 2}, {})]


def _config(**kw: Any) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          **{"num_experts": 4, "num_experts_per_tok": 2, **kw})


def _route_balanced(model: torch.nn.Module) -> None:
    """Every router of ``model`` sends slot ``s`` of its ``T * k`` to expert ``s mod E`` (weights: the softmax's
    values there), the routing the trace assumes."""
    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            def forward(hidden: torch.Tensor, m: Any = m) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                hidden = hidden.reshape(-1, m.hidden_dim)
                logits = torch.nn.functional.linear(hidden, m.weight)
                index = (torch.arange(hidden.shape[0] * m.top_k, device=hidden.device) % m.num_experts)
                index = index.view(-1, m.top_k)
                weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, index)
                return logits, weights.to(logits.dtype), index
            m.forward = forward


def _real_steps(rank: int, world: int, cases: list[tuple[dict[str, int], dict[str, Any]]],
                balanced: bool) -> list[Any]:
    out = []
    for sizes, extra in cases:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(), dtype=DTYPE)
        if balanced:
            _route_balanced(model)
        out.append(measure_step(model, build_mesh(sizes), **STEP, **extra))
    return out


def test_each_moe_layout_with_balanced_routing_is_predicted_as_its_real_run_measures_it() -> None:
    cases = CASES + (MORE if os.environ.get("TPLOWER_SLOW") else [])
    predicted = [trace_step(_config(), sizes, dtype=DTYPE, **STEP, **extra) for sizes, extra in cases]
    real = run_processes(2, _real_steps, cases, True)
    for i, (sizes, extra) in enumerate(cases):
        got = predicted[i]
        for rank, steps in enumerate(real):
            want, where = steps[i], f"{sizes} {extra} rank {rank}"
            assert abs(got.peak_bytes - want.peak_bytes) <= TOL * want.peak_bytes, (where, got.peak_bytes,
                                                                                    want.peak_bytes)
            assert got.collectives == want.collectives, where
            assert got.flops == want.flops, where
            assert got.totals == want.totals, where
        if extra.get("experts") == "ep":
            assert got.collectives["tp"]["all_to_all"][0] > 0  # the tokens did travel


def test_the_routers_own_routing_moves_only_the_token_exchange() -> None:
    cases = CASES[:1]
    got = trace_step(_config(), cases[0][0], dtype=DTYPE, **STEP, **cases[0][1])
    # The router's own routing is not the balanced routing traced, and the real peak moves from run to run with
    # when the exchanges' buffers are freed: rank 0 measured 1,111,520 and 1,160,672 bytes in two runs of the same
    # code (rank 1: 1,069,720 and 1,088,160) against 1,090,620 traced, so this peak gets twice the balanced tolerance.
    for rank, (want,) in enumerate(run_processes(2, _real_steps, cases, False)):
        assert abs(got.peak_bytes - want.peak_bytes) <= 2 * TOL * want.peak_bytes, (rank, got.peak_bytes,
                                                                                    want.peak_bytes)
        assert got.flops == want.flops
        mine, theirs = dict(got.collectives["tp"]), dict(want.collectives["tp"])
        assert mine.pop("all_to_all")[0] == theirs.pop("all_to_all")[0]  # as many exchanges, other bytes
        assert mine == theirs


def test_plan_layout_searches_the_experts_over_tp_and_gives_parallelize_s_refusal() -> None:
    rows = tplower.plan_layout(_config(num_experts=3), 2, memory_per_rank="1GiB", seq_len=64, global_batch=2,
                               micro_batch=2, axes=("tp",), checkpointing=(False,))
    by = {r.experts: r for r in rows}
    assert set(by) == {"tp", "ep"}
    assert by["tp"].fits and by["tp"].peak_bytes > 0
    assert not by["ep"].fits and "3 experts do not divide over the 2 ranks" in by["ep"].reason, by["ep"].reason
    assert 'experts="tp"' in by["tp"].code().replace("'", '"')


@pytest.fixture(scope="module", autouse=True)
def _native_all_reduce(native_all_reduce: None) -> None:
    """This module counts collectives by the names the lowering gives them: gloo's small all_reduces run natively."""
