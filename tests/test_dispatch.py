"""Expert-parallel dispatch and combine (tplower.core.ops.dispatch) against one process, forward and backward.

Each rank holds its own tokens and routing; the experts are ``f_e(x) = x * (e + 1) + e`` (global expert index
``e``), run on the rank that holds ``e`` after :func:`tplower.dispatch_tokens`. The one-process reference applies every
expert to every token where it is: ``out[t] = sum_j w[t, j] * f_{ids[t, j]}(x[t])``. Gradients of the tokens
and of the routing weights come from autograd on the reference. Cases: empty ranks (no tokens), a rank whose
experts receive nothing, experts that receive nothing, k = 1 and 2, uneven token counts, float32 and bfloat16,
on 2 gloo processes and 4 threaded ranks, over the native ``all_to_all`` and its ``all_gather`` equivalent.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tplower import TPLowerError, all_to_all_splits, combine_tokens, dispatch_tokens, plan_dispatch
from tplower.testing import run_processes, run_threaded

H = 3

# (name, experts, top_k, tokens per rank by rank, which experts routing may pick (None: all))
CASES = [
    ("k1_uneven", 4, 1, (5, 2, 0, 7), None),
    ("k2_uneven", 8, 2, (3, 6, 1, 4), None),
    ("k2_rank1_gets_none", 4, 2, (4, 3, 5, 2), "not_rank1"),
    ("k2_empty_experts", 8, 2, (6, 0, 5, 3), "even_only"),
    ("k2_nobody_has_tokens", 4, 2, (0, 0, 0, 0), None),
]


def _experts_allowed(how: str | None, num_experts: int, world: int) -> list[int]:
    per = num_experts // world
    if how == "not_rank1":
        return [e for e in range(num_experts) if e // per != 1]
    if how == "even_only":
        return list(range(0, num_experts, 2))
    return list(range(num_experts))


def _routing(rank: int, world: int, case: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    _, num_experts, k, tokens, how = case
    g = torch.Generator().manual_seed(100 * rank + len(case[0]))
    t = tokens[rank % len(tokens)]
    allowed = torch.tensor(_experts_allowed(how, num_experts, world))
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(t)]) \
        if t else torch.empty(0, k, dtype=torch.int64)
    x = torch.randn(t, H, generator=g).to(dtype)
    w = torch.rand(t, k, generator=g).to(dtype)
    up = torch.randn(t, H, generator=g).to(dtype)  # the gradient arriving at the output
    return ids, x, w, up


def _expert(x: torch.Tensor, e: torch.Tensor | int) -> torch.Tensor:
    e = torch.as_tensor(e, dtype=x.dtype).reshape(-1, *([1] * (x.dim() - 1))) if isinstance(e, torch.Tensor) \
        else torch.tensor(float(e), dtype=x.dtype)
    return x * (e + 1) + e


def _reference(ids: torch.Tensor, x: torch.Tensor, w: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = torch.zeros_like(x)
    for j in range(ids.shape[1]):
        out = out + w[:, j:j + 1] * _expert(x, ids[:, j])
    (out * up).sum().backward()
    assert x.grad is not None and w.grad is not None
    return out.detach(), x.grad, w.grad


def _body(rank: int, world: int, case: tuple, dtype: torch.dtype, native: bool | None) -> dict[str, float]:
    group = dist.group.WORLD
    ids, x0, w0, up = _routing(rank, world, case, dtype)
    want, want_dx, want_dw = _reference(ids, x0, w0, up)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    plan = plan_dispatch(ids, case[1], group)
    if native is not None:
        plan = type(plan)(**{**plan.__dict__, "native": native})
    rows = dispatch_tokens(x, plan)
    assert rows.shape == (int(plan.tokens_per_expert.sum()), H)
    global_expert = plan.local_experts + rank * plan.experts_per_rank
    out = combine_tokens(_expert(rows, global_expert), plan, w)
    (out * up).sum().backward()
    assert x.grad is not None and w.grad is not None
    out = out.detach()
    return {"out": float((out - want).abs().max()) if out.numel() else 0.0,
            "dx": float((x.grad - want_dx).abs().max()) if x.numel() else 0.0,
            "dw": float((w.grad - want_dw).abs().max()) if w.numel() else 0.0,
            "rows": float(rows.shape[0]), "expected_rows": float(_rows_for(rank, world, case, dtype))}


def _rows_for(rank: int, world: int, case: tuple, dtype: torch.dtype) -> int:
    """Rows rank ``rank`` must receive: every rank's slots routed to its experts (recomputed from the routing)."""
    per = case[1] // world
    return sum(int(((_routing(r, world, case, dtype)[0] // per) == rank).sum()) for r in range(world))


def _check(results: list[dict[str, float]], dtype: torch.dtype) -> None:
    tol = 1e-6 if dtype == torch.float32 else 5e-2
    for r, res in enumerate(results):
        assert res["rows"] == res["expected_rows"], (r, res)
        assert res["out"] <= tol and res["dx"] <= tol and res["dw"] <= tol, (r, res)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dispatch_combine_threaded_world4(case: tuple) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        _check(run_threaded(4, _body, case, dtype, None), dtype)


def _gloo_cases(rank: int, world: int) -> list[list[dict[str, float]]]:
    out = []
    for case in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            # all_to_all_single, and (float32) the all_gather equivalent a backend without it gets
            for native in (True, False) if dtype == torch.float32 else (True,):
                res = _body(rank, world, case, dtype, native)
                out.append([res, {"dtype": 0.0 if dtype == torch.float32 else 1.0}])
    return out


@pytest.mark.slow  # the threaded world-4 cases run in CI, and tests/test_moe_tp.py dispatches over gloo ranks
def test_dispatch_combine_gloo_world2() -> None:
    per_rank = run_processes(2, _gloo_cases)
    for i in range(len(per_rank[0])):
        dtype = torch.float32 if per_rank[0][i][1]["dtype"] == 0.0 else torch.bfloat16
        _check([per_rank[r][i][0] for r in range(2)], dtype)


def _errors(rank: int, world: int) -> list[str]:
    group = dist.group.WORLD
    found = []
    for bad in (torch.zeros(3, 2), torch.tensor([0, 1]), torch.tensor([[0, 7]])):
        try:
            plan_dispatch(bad, 4, group)
        except TPLowerError as exc:
            found.append(str(exc))
    try:
        plan_dispatch(torch.zeros(2, 1, dtype=torch.int64), 3, group)
    except TPLowerError as exc:
        found.append(str(exc))
    plan = plan_dispatch(torch.zeros(2, 1, dtype=torch.int64), 4, group)
    for call in (lambda: dispatch_tokens(torch.zeros(3, H), plan), lambda: combine_tokens(torch.zeros(5, H), plan),
                 lambda: all_to_all_splits(torch.zeros(1, H), group=group, matrix=plan.matrix, rank=rank)):
        try:
            call()
        except TPLowerError as exc:
            found.append(str(exc))
    return found


def test_bad_routing_is_named_before_any_exchange() -> None:
    found = run_threaded(2, _errors)[0]
    assert len(found) == 7, found
    assert "integer tensor [tokens, top_k]" in found[0] and "1-D" in found[1]
    assert "outside 0 .. 3" in found[2]
    assert "num_experts=3 does not divide over the 2 ranks" in found[3]
    assert "routes 2 tokens" in found[4] and "but the plan gave this rank" in found[5]
    assert "sends 2" in found[6]
