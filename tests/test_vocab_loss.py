"""``vocab_parallel_cross_entropy`` against ``F.cross_entropy`` on the whole logits, value and gradient.

Vocabularies that do not divide (257 at tp=2, 3 and 4; 5 at tp=4, so a rank may hold a piece without a target,
and 2 at tp=3, where the last rank holds none), every option (ignore_index with an ignored row, label smoothing,
reduction mean/sum/none), float32 and bfloat16; 2 gloo ranks and 3 and 4 threaded ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from tplower import TPLowerError, vocab_parallel_cross_entropy
from tplower.testing import run_processes, run_threaded

OPTIONS = [{}, {"reduction": "sum"}, {"reduction": "none"}, {"label_smoothing": 0.1},
           {"ignore_index": 3}, {"ignore_index": 3, "label_smoothing": 0.2, "reduction": "sum"}]


def _data(vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(2, 6, vocab, generator=g) * 3).to(dtype)
    target = torch.randint(0, vocab, (2, 6), generator=g)
    target[0, 0] = 3 % vocab  # ignored under ignore_index=3 (a real id otherwise)
    return logits, target


def _body(rank: int, world: int, vocab: int, dtype: torch.dtype) -> list[tuple[float, float]]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    logits, target = _data(vocab, dtype)
    out = []
    for opts in OPTIONS:
        full = logits.float().clone().requires_grad_()
        want = F.cross_entropy(full.transpose(1, 2), target, **opts)  # [batch, vocab, seq] as F takes it
        want.sum().backward()
        mine = logits.chunk(world, -1)[rank] if rank < len(logits.chunk(world, -1)) else logits[..., :0]
        mine = mine.clone().requires_grad_()
        kw: dict[str, Any] = {"vocab_size": vocab} if opts.get("reduction") == "sum" else {}
        got = vocab_parallel_cross_entropy(mine, target, mesh, **kw, **opts)
        got.sum().backward()
        assert full.grad is not None and mine.grad is not None
        grad_want = full.grad.chunk(world, -1)[rank] if mine.shape[-1] else full.grad[..., :0]
        gdiff = (mine.grad.float() - grad_want).abs()
        out.append((float((got.float() - want).abs().max()), float(gdiff.max()) if gdiff.numel() else 0.0))
    return out


def _check(results: list[list[tuple[float, float]]], dtype: torch.dtype) -> None:
    # float32: a few units in the last place of values near 1 (the loss of a row is about 5)
    loss_tol, grad_tol = (1e-5, 2e-6) if dtype == torch.float32 else (5e-2, 2e-2)
    for per_rank in results:
        for opts, (loss, grad) in zip(OPTIONS, per_rank, strict=True):
            assert loss <= loss_tol and grad <= grad_tol, (opts, loss, grad)


def _gloo(rank: int, world: int) -> dict[str, Any]:
    """Both gloo checks in one spawn (starting two processes costs more than either check)."""
    return {"body": _body(rank, world, 257, torch.float32), "llama": _llama_loss(rank, world)}


@pytest.fixture(scope="module")
def gloo_ranks() -> list[dict[str, Any]]:
    return run_processes(2, _gloo)


def test_matches_cross_entropy_on_two_gloo_ranks(gloo_ranks: list[dict[str, Any]]) -> None:
    _check([r["body"] for r in gloo_ranks], torch.float32)


@pytest.mark.parametrize("world,vocab", [(3, 257), (4, 257), (4, 5), (3, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_cross_entropy_on_threaded_ranks(world: int, vocab: int, dtype: torch.dtype) -> None:
    _check(run_threaded(world, _body, vocab, dtype), dtype)


def _all_ignored(rank: int, world: int) -> list[tuple[str, bool, bool, float, float]]:
    """Every target ``ignore_index`` (a micro-batch of prompt tokens only): value and gradient as F.cross_entropy."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    logits, _ = _data(8, torch.float32)
    target = torch.full(logits.shape[:-1], -100)
    out = []
    for opts in ({}, {"reduction": "sum"}, {"reduction": "none"}, {"label_smoothing": 0.1}):
        full = logits.clone().requires_grad_()
        want = F.cross_entropy(full.transpose(1, 2), target, **opts)
        want.sum().backward()
        mine = logits.chunk(world, -1)[rank].clone().requires_grad_()
        got = vocab_parallel_cross_entropy(mine, target, mesh, **opts)
        got.sum().backward()
        assert full.grad is not None and mine.grad is not None
        out.append((str(opts), bool(torch.isnan(got).any()), bool(torch.isnan(want).any()),
                    float(torch.nan_to_num(got - want, nan=0.0).abs().max()), float(mine.grad.abs().max())))
    return out


def test_every_target_ignored_gives_the_loss_of_cross_entropy_and_a_zero_gradient() -> None:
    for per_rank in run_threaded(2, _all_ignored):
        for opts, nan_got, nan_want, diff, grad in per_rank:
            # mean: 0 / 0 is NaN in both; the gradient is zero (F.cross_entropy's), never NaN
            assert (nan_got, diff, grad) == (nan_want, 0.0, 0.0), opts


def _errors(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    logits, target = _data(8, torch.float32)
    msgs = []
    for call in (lambda: vocab_parallel_cross_entropy(logits[..., :4], target, mesh, reduction="avg"),
                 lambda: vocab_parallel_cross_entropy(logits[..., :3], target, mesh, vocab_size=8),
                 lambda: vocab_parallel_cross_entropy(logits[..., :4], target[0], mesh),
                 lambda: vocab_parallel_cross_entropy(logits[..., :4], target, mesh, axis="dp")):
        with pytest.raises(TPLowerError) as exc:
            call()
        msgs.append(str(exc.value))
    return msgs


def test_bad_input_is_named() -> None:
    msgs = run_threaded(2, _errors)[0]
    assert "reduction='avg'" in msgs[0] and "mean, sum, none" in msgs[0]
    assert "holds 3 vocabulary logits" in msgs[1] and "piece of 8 is 4" in msgs[1]
    assert "plus the vocabulary dim" in msgs[2]
    assert "axis='dp'" in msgs[3]


def _llama_loss(rank: int, world: int) -> dict[str, float]:
    import copy
    import warnings

    import transformers

    import tplower
    from tplower.plans.hf import model_tp_plan

    config = transformers.LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = {**model_tp_plan(ref), "lm_head": "colwise"}  # logits stay sharded on the vocabulary
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = tplower.parallelize(copy.deepcopy(ref), mesh, plan)
    ids = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(2))
    want = ref(input_ids=ids, labels=ids, use_cache=False).loss  # transformers' shifted, token-mean loss
    want.backward()
    logits = tp(input_ids=ids, use_cache=False).logits  # [2, 9, this rank's 129 or 128 ids]
    got = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], mesh)
    got.backward()
    full = {n: p.grad for n, p in ref.named_parameters()}
    grad = max(float(((q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad) - full[n]).abs().max())
               for n, q in tp.named_parameters())
    return {"loss": abs(float(got) - float(want)), "grad": grad, "local_vocab": float(logits.shape[-1])}


def test_llama_loss_on_vocabulary_shards_equals_transformers_loss(gloo_ranks: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(r["llama"] for r in gloo_ranks):
        assert r["local_vocab"] == (129, 128)[rank]  # the whole logits never exist on a rank
        assert r["loss"] <= 1e-6 and r["grad"] <= 1e-6, r
