"""Context parallelism beside tensor parallelism: a (cp=2, tp=2) mesh on 4 threaded ranks, against one process.

``tplower.parallelize(model, mesh, "auto", context="cp")``: the shipped tensor-parallel plan on ``tp`` and the
sequence split over ``cp``. Tiny Llama (all-gather mode, a packed batch) and Qwen3-MoE with expert parallelism over
``tp`` (Ulysses, a padded batch): the loss on
every rank, the logits through ``gather_sequence`` and every parameter's gradient (whole) as one process's; then three
training steps (``clip_grad_norm_``, AdamW with ``foreach``) whose parameters stay one process's, the replicated ones
bit-identical on all four ranks; and the loss from vocabulary-sharded logits (``vocab_parallel_cross_entropy`` with
``context="cp"``) is one process's loss, with its gradients. On a flat cp=4 mesh, a sequence of 3 tokens leaves
rank 3 without a token, and the model still gives one process's answer; the hybrid mode runs cp=4 as 2 x 2.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from context_cases import Case, batch, matches, named, run_case, tiny
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import tplower
from tplower.testing import run_threaded

TOL = 1e-5
CASES = [(Case("llama", "allgather", "eager", 37, False, "packed"), "tp"),
         (Case("qwen3_moe", "ulysses", "sdpa", 37, True, "padded"), "ep"),
         # the loss in chunks beside tp: each chunk's logits gathered over tp by the plan's output head
         (Case("llama", "ulysses", "sdpa", 37, True, "ragged", loss_chunk=4), "tp")]
#: cp=4 over 3 tokens: rank 3 holds none (balanced: pieces 3 and 4 of 8 are empty; even: the 4th of 4)
EMPTY_RANK = [Case("llama", "ulysses", "sdpa", 3, True, "plain"),
              Case("llama", "allgather", "eager", 3, False, "padded"),
              Case("llama", "allgather", "sdpa", 3, True, "plain", loss_chunk=2)]
#: cp=4 over 8 tokens cut evenly, both rows left-padded by 4: the queries of ranks 0 and 1 (the first pair of the
#: hybrid's 2 x 2) see no key in any row (their attention output is zeros), and their q, k and v projections'
#: gradients still take part in every exchange and reduction
SHUT_RANK = [Case("llama", mode, "sdpa", 8, False, "leftpad") for mode in ("allgather", "hybrid")]

#: cp=4 as 2 x 2: Ulysses inside pairs of ranks, all-gather across the pairs (Llama's 4 query and 2 key/value heads:
#: Ulysses degree 2 repeats none); one key/value head (degree 1: all-gather across 4 single ranks); layers with a
#: dense mask (eager) run the all-gather mode over the whole axis; a sliding window under sdpa runs on the runs
HYBRID = [Case("llama", "hybrid", "sdpa", 64, True, "plain"), Case("llama", "hybrid", "sdpa", 37, True, "padded"),
          Case("llama", "hybrid", "sdpa", 37, False, "packed"),
          Case("llama", "hybrid", "sdpa", 61, True, "ragged", loss_chunk=8),
          Case("llama", "hybrid", "sdpa", 3, True, "plain"),  # rank 3 holds no token
          # the whole second pair (ranks 2 and 3) holds no token: 2 tokens (a token for ranks 0 and 1), 1 token
          # (rank 0's alone; one process's loss over no label is NaN, and ours must be NaN too)
          Case("llama", "hybrid", "sdpa", 2, True, "plain"), Case("llama", "hybrid", "sdpa", 1, True, "plain"),
          Case("llama_mqa", "hybrid", "sdpa", 37, True, "packed"),
          Case("llama", "hybrid", "eager", 37, True, "padded"), Case("mistral", "hybrid", "sdpa", 37, True, "packed")]


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(mesh: Any) -> dict[str, Any]:
    """Three steps of clip_grad_norm_ and AdamW (foreach) on tiny Llama, against the same steps in one process."""
    ref = tiny("llama", "sdpa")
    model = tplower.parallelize(copy.deepcopy(ref), mesh, "auto", context="cp")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True) for m in (ref, model)]
    norms: list[tuple[float, float]] = []
    for step in range(3):
        whole = batch("padded", 37 + step)
        losses = []
        for m, opt, part in ((ref, opts[0], {**whole, "use_cache": False}),
                             (model, opts[1], tplower.shard_sequence(whole, mesh, "cp"))):
            opt.zero_grad()
            loss = m(**part).loss
            loss.backward()
            losses.append(float(_whole(torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.5))))
            opt.step()
        norms.append((losses[0], losses[1]))
    worst = max(float((_whole(q).detach() - p.detach()).abs().max())
                for p, q in zip(ref.parameters(), model.parameters(), strict=True))
    replicated = [hashlib.sha256(q.to_local().detach().numpy().tobytes()).hexdigest() for q in model.parameters()
                  if all(pl.is_replicate() for pl in q.placements)]
    return {"params": worst, "norms": norms, "replicated": replicated}


def _vocab_loss(mesh: Any) -> dict[str, float]:
    """The loss from logits sharded on the vocabulary over tp and tokens split over cp (vocab_parallel_cross_entropy
    with ``context="cp"``), against one process's loss and gradients."""
    from tplower.plans.hf import model_tp_plan

    ref = tiny("llama", "sdpa")
    model = tplower.parallelize(copy.deepcopy(ref), mesh, {**model_tp_plan(ref), "lm_head": "colwise"}, context="cp")
    whole = batch("padded", 37)
    want = ref(**whole, use_cache=False).loss
    want.backward()
    part = tplower.shard_sequence(whole, mesh, "cp")
    logits = model(**{k: v for k, v in part.items() if k not in ("labels", "shift_labels")}).logits
    loss = tplower.vocab_parallel_cross_entropy(logits, part["labels"], mesh, axis="tp", context="cp",
                                                num_items_in_batch=part["num_items_in_batch"])
    loss.backward()
    grad = max(float((_whole(q.grad) - p.grad).abs().max())
               for p, q in zip(ref.parameters(), model.parameters(), strict=True))
    return {"loss": float((loss - want).abs()), "grad": grad}


def _verify(mesh: Any) -> dict[str, Any]:
    """``tplower.verify(..., context="cp")`` on the shipped plan (every row within tolerance) and on a model whose
    gradients are left for FSDP2 to average (``context_grads="mean"``) but never averaged: its attention outputs
    match one process, the gradients arriving there are twice one process's and the report says so."""
    from tplower.verification.context import verify_context

    base = tiny("llama", "sdpa")
    dist.barrier()  # every rank's seeded builds are done: verify seeds the shared generator itself
    ok = tplower.verify(lambda: copy.deepcopy(base), "auto", mesh, batch("padded", 37), context="cp")
    wrong = verify_context(lambda: copy.deepcopy(base), None, mesh, batch("padded", 37), context_grads="mean",
                           context_mode="allgather")
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))  # the hybrid's 2 x 2, as tplower verify runs it
    hybrid = tplower.verify(lambda: copy.deepcopy(base), None, flat, batch("padded", 37), context="cp",
                            context_mode="hybrid")
    first = wrong.first_divergence
    return {"ok": ok.ok, "rows": [b.module for b in ok.boundaries], "wrong_ok": wrong.ok, "hybrid": hybrid.ok,
            "hybrid_forms": {b.form for b in hybrid.boundaries},
            "wrong_forward": [b.forward_max_diff for b in wrong.boundaries],
            "first": (first.module, first.phase) if first else None}


def _hybrid_layout(flat: Any) -> dict[str, Any]:
    """The axes the hybrid mode split cp=4 into for each model (its Ulysses degree chosen from the heads), and the
    refusals of a degree that does not fit."""
    from tplower.context.attention import ATTR
    from tplower.core.support.errors import TPLowerError

    out: dict[str, Any] = {}
    for kind in ("llama", "llama_mqa"):
        model = tplower.parallelize(tiny(kind, "sdpa"), flat, None, context="cp", context_mode="hybrid")
        sub = model.model.layers[0].self_attn.__dict__[ATTR].sub_mesh
        out[kind] = (tuple(sub.mesh_dim_names), tuple(sub.shape))
    for name, kind, kw in (("three", "llama", {"context_ulysses": 3}), ("heads", "llama_h3", {"context_ulysses": 2}),
                           ("mode", "llama", {"context_mode": "ulysses", "context_ulysses": 2})):
        try:
            tplower.parallelize(tiny(kind, "sdpa"), flat, None, context="cp", **{"context_mode": "hybrid", **kw})
            out[name] = "no error"
        except TPLowerError as e:
            out[name] = str(e)
    return out


def _body(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    out = {c.name: named(run_case, c, mesh, plan="auto", experts=e) for c, e in CASES}
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    out.update({c.name: named(run_case, c, flat) for c in EMPTY_RANK + HYBRID + SHUT_RANK})
    out["hybrid_layout"] = _hybrid_layout(flat)
    out["train"] = _train(mesh)
    out["vocab"] = _vocab_loss(mesh)
    out["verify"] = _verify(mesh)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_threaded(4, _body, timeout=600)


@pytest.mark.parametrize("case", [c.name for c, _ in CASES])
def test_cp_and_tp_match_one_process(ranks: list[dict[str, Any]], case: str) -> None:
    c = next(c for c, _ in CASES if c.name == case)
    for r in ranks:
        matches(c, r[case], TOL)


@pytest.mark.parametrize("case", [c.name for c in EMPTY_RANK])
def test_a_rank_with_no_token_runs_and_matches_one_process(ranks: list[dict[str, Any]], case: str) -> None:
    from tplower.context.layout import SequenceLayout

    c = next(c for c in EMPTY_RANK if c.name == case)
    assert SequenceLayout(c.seq, 4, c.balance).lengths[3] == 0  # the case is what it claims
    for r in ranks:
        matches(c, r[case], TOL)


@pytest.mark.parametrize("case", SHUT_RANK, ids=lambda c: c.name)
def test_a_rank_whose_queries_see_no_key_matches_one_process(ranks: list[dict[str, Any]], case: Case) -> None:
    for r in ranks:
        matches(case, r[case.name], TOL)


@pytest.mark.parametrize("case", HYBRID, ids=lambda c: c.name)
def test_hybrid_at_cp_4_as_2_by_2_matches_one_process(ranks: list[dict[str, Any]], case: Case) -> None:
    for r in ranks:
        matches(case, r[case.name], TOL)


def test_hybrid_splits_cp_by_the_heads_and_refuses_a_degree_that_does_not_fit(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        got = r["hybrid_layout"]
        assert got["llama"] == (("cp_allgather", "cp_ulysses"), (2, 2))  # 4 query, 2 key/value heads
        assert got["llama_mqa"] == (("cp_allgather", "cp_ulysses"), (4, 1))  # one key/value head: none repeated
        # parallelize's own argument names (context_ulysses, context_mode), not install_context's
        assert "parallelize: context_ulysses=3 must be a divisor of the 4 ranks of axis 'cp'" in got["three"], got
        assert "context_mode='hybrid' splits the heads over the 2 ranks" in got["heads"], got["heads"]
        assert "3 query heads" in got["heads"], got["heads"]
        assert ("parallelize: context_ulysses=2 is the hybrid mode's Ulysses degree; context_mode='ulysses' takes none "
                "(drop it, or use context_mode='hybrid')") in got["mode"], got["mode"]


def test_three_training_steps_match_one_process_and_replicas_stay_identical(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        # after 3 steps of lr 1e-3 (Adam rescales tiny gradients' noise; tp alone gives the same size here)
        assert r["train"]["params"] <= 1e-4, r["train"]["params"]
        for one, ours in r["train"]["norms"]:
            assert abs(one - ours) <= 1e-5 * max(1.0, one), r["train"]["norms"]
    assert all(r["train"]["replicated"] == ranks[0]["train"]["replicated"] for r in ranks)


def test_vocab_parallel_loss_over_cp_and_tp_is_one_process_loss(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["vocab"]["loss"] <= 1e-5 and r["vocab"]["grad"] <= 1e-5, r["vocab"]


def test_verify_with_context_checks_each_attention_exchange(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        got = r["verify"]
        assert got["ok"] and got["rows"] == ["model.layers.0.self_attn", "model.layers.1.self_attn"], got
        assert got["hybrid"] and got["hybrid_forms"] == {"context hybrid"}, got
        # the exchanges are right, the gradient reaching the first attention is not: found there, backward
        assert not got["wrong_ok"] and max(got["wrong_forward"]) <= 1e-5, got
        assert got["first"] == ("model.layers.0.self_attn", "backward"), got
