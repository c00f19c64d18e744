"""Ranks that call different modules under context parallelism still get one process's gradients.

A decoder whose MLP is a hand-written mixture-of-experts loop that calls an expert only when one of this rank's
tokens reaches it (routing by each token's global position, so the experts a rank calls depend on which tokens it
holds): under ``cp=2`` (one contiguous piece per rank) rank 0 calls expert 0 only and rank 1 expert 1 only
(``disjoint``), or rank 0 skips expert 1 while rank 1 calls both (``skip``). The gradient sums over ``cp`` run
once, in one order, at the end of backward (:mod:`tplower.runtime.grad_sums`), so the ranks issue the same
collectives: the loss, every gradient and the parameters after two AdamW steps are one process's on the whole
sequence; an expert no rank's token reaches keeps no gradient. Then the same with two micro-batches accumulated,
with reentrant activation checkpointing per layer and around each expert call (one pass a backward either way),
with two backward calls through one graph (``retain_graph``), with the pass in many small chunks (one
``all_reduce`` each), with ``backward(inputs=...)`` naming one MLP's parameters, on a deep copy of the parallelized
model, with a one-token step whose placeholder token on the empty rank reaches an expert no real token reaches (no
gradient, as one process), and through ``torch.autograd.grad`` (summed where each module runs: every rank calls
the same modules there). 2 gloo ranks; the reference is one process with
``use_cache=False``. On 4 threaded ranks: a ``(cp=2, tp=2)`` mesh with the experts colwise and
rowwise around a scalar the coverage probe finds (decided alike on the cp ranks whichever experts they called),
and FSDP2 over ``dp`` beside ``cp`` with the sum over ``cp`` folded into FSDP2's
(:func:`tplower.sum_context_in_fsdp`).
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import threading
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import tplower
from tplower.core.lower.traffic import CollectiveTraffic
from tplower.runtime import grad_sums
from tplower.runtime.grad_sums import BUCKET_BYTES
from tplower.testing import run_processes, run_threaded

pytest.importorskip("transformers")

SEQ, HIDDEN, VOCAB = 24, 32, 64
TOL = dict(atol=2e-5, rtol=1e-4)
#: parameters after AdamW steps (lr 1e-2): Adam divides by the gradient's own size, so rounding in a tiny gradient
#: moves a parameter by up to the step size times its relative error
PARAM_TOL = dict(atol=1e-4, rtol=1e-3)


def _routes(pattern: str) -> torch.Tensor:
    """The expert of each global position: the first half is rank 0's piece, the second rank 1's."""
    half = torch.arange(SEQ) >= SEQ // 2
    if pattern == "disjoint":  # rank 0: expert 0 only; rank 1: expert 1 only
        return half.long()
    if pattern == "skip":  # rank 0: expert 0 only; rank 1: both
        return (half & (torch.arange(SEQ) % 2 == 1)).long()
    if pattern == "unused":  # expert 1 reached by no token on any rank
        return torch.zeros(SEQ, dtype=torch.long)
    raise ValueError(pattern)


class _Positions:
    """The global positions of the tokens of the current call (each token routes by its own)."""

    ids: torch.Tensor | None = None


class SkipMoE(nn.Module):
    """Two experts, each called on the tokens routed to it, skipped when none is (the loop of many MoE blocks)."""

    def __init__(self, positions: _Positions, routes: torch.Tensor) -> None:
        super().__init__()
        self.positions, self.routes = positions, routes
        self.router = nn.Linear(HIDDEN, 2, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), _Scaled(),
                                                   nn.Linear(2 * HIDDEN, HIDDEN)) for _ in range(2))
        self.checkpointed = False  # each expert call under reentrant activation checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.positions.ids
        assert ids is not None
        if ids.shape[-1] != x.shape[1]:  # a rank without a token runs one placeholder token: to expert 1
            ids = torch.full((1, x.shape[1]), -1, dtype=torch.long)
        choice = torch.cat([self.routes, torch.ones(1, dtype=torch.long)])[ids].expand(x.shape[:2])  # [B, S]
        gates = self.router(x).softmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if not bool(mask.any()):
                continue
            y = checkpoint(expert, x[mask], use_reentrant=True) if self.checkpointed else expert(x[mask])
            out[mask] = y * gates[mask][:, e:e + 1]
        return out


class _Scaled(nn.Module):
    """SiLU times a learnable scalar: under tp (colwise before, rowwise after) a parameter the plan leaves whole on
    sharded activations, which the coverage probe finds in the first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor([1.3]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.silu(x) * self.alpha


_SEEDED = threading.Lock()  # threaded ranks share the global generator: one model made at a time


def _model(pattern: str) -> nn.Module:
    with _SEEDED:
        return _seeded_model(pattern)


def _seeded_model(pattern: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = LlamaForCausalLM(config)
    positions = _Positions()
    for layer in model.model.layers:
        layer.mlp = SkipMoE(positions, _routes(pattern))

    model.register_forward_pre_hook(_Remember(positions), with_kwargs=True)
    return model


class _Remember:
    """The model's forward pre-hook that keeps the call's positions (an object: a deep copy of the model copies
    it with the copy's own :class:`_Positions`)."""

    def __init__(self, positions: _Positions) -> None:
        self.positions = positions

    def __call__(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("position_ids")
        self.positions.ids = ids if ids is not None else torch.arange(kwargs["input_ids"].shape[1]).unsqueeze(0)


def _checkpointed(model: nn.Module) -> None:
    """Reentrant activation checkpointing per decoder layer (transformers' default kind)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(2)]


def _whole(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _kept(model: nn.Module) -> bool:
    """Every gradient through ``torch.save``, ``pickle`` and ``deepcopy``, and ``deepcopy`` of the model."""
    for p in model.parameters():
        if p.grad is None:
            continue
        buffer = io.BytesIO()
        torch.save(p.grad, buffer)
        buffer.seek(0)
        for c in (torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(p.grad)), copy.deepcopy(p.grad)):
            if not torch.equal(c.to_local(), p.grad.to_local()):
                return False
    copy.deepcopy(model)
    return True


def _train(model: nn.Module, mesh: Any, how: str) -> dict[str, Any]:
    """Two AdamW steps, each over the two micro-batches (``accumulate``) or the first alone; the gradients and
    parameters after the first step, the parameters after the second."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out: dict[str, Any] = {}
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        losses = []
        for ids in (_batches() if how == "accumulate" else _batches()[:1]):
            if how == "short" and step == 1:  # one token: at cp=2 rank 1 holds none (a placeholder token)
                ids = ids[:, :1]
            batch: dict[str, Any] = {"input_ids": ids, "labels": ids}
            if mesh is not None:
                batch = tplower.shard_sequence(batch, mesh, "cp", balance=False)
            else:
                batch["position_ids"] = torch.arange(ids.shape[1]).unsqueeze(0)
            loss = model(**batch).loss
            if how == "retain":  # two backward calls through one graph: twice the gradient, summed twice
                loss.backward(retain_graph=True)
                loss.backward()
            elif how == "inputs":  # the last layer's MLP's gradients alone (rank 0 never calls its expert 1)
                loss.backward(inputs=list(model.model.layers[-1].mlp.parameters()))
            elif how == "grad":  # gradients returned, not accumulated: .grad set by hand
                params = [p for p in model.parameters() if p.requires_grad]
                for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True), strict=True):
                    p.grad = g
            else:
                loss.backward()
            losses.append(float(loss.detach()))
        if step == 0:
            out["loss"] = losses
            out["grads"] = {n: _whole(p.grad) for n, p in model.named_parameters()}
            out["kept"] = _kept(model) if mesh is not None else True
        opt.step()
    out["params"] = {n: _whole(p.detach()) for n, p in model.named_parameters()}
    return out


def _ranks(rank: int, world: int, runs: list[tuple[str, str]], tp: int) -> dict[str, Any]:
    os.environ["OMP_NUM_THREADS"] = "1"
    shape, names = ((world // tp, tp), ("cp", "tp")) if tp > 1 else ((world,), ("cp",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    out: dict[str, Any] = {}
    for pattern, how in runs:
        grad_sums.BUCKET_BYTES = SMALL_BUCKET if how == "chunks" else BUCKET_BYTES
        model = _model(pattern)
        _prepare(model, how)
        with warnings.catch_warnings():  # the coverage probe names the scales it reduces over tp
            warnings.simplefilter("ignore")
            tplower.parallelize(model, mesh, PLAN if tp > 1 else None, context="cp")
        if how == "copy":  # a deep copy of the parallelized model is what trains
            model = copy.deepcopy(model)
        with CollectiveTraffic() as comm:
            got = _train(model, mesh, how)
        got["counts"] = dict(comm.counts)
        out[f"{pattern}-{how}"] = got
        dist.barrier()
    return out


def _prepare(model: nn.Module, how: str) -> None:
    if how == "checkpoint":
        _checkpointed(model)
    if how == "expert_checkpoint":
        for layer in model.model.layers:
            layer.mlp.checkpointed = True


def _one_process(pattern: str, how: str) -> dict[str, Any]:
    model = _model(pattern)
    _prepare(model, how)
    return _train(model, None, how)


def _check(got: dict[str, Any], want: dict[str, Any], pattern: str) -> None:
    torch.testing.assert_close(got["loss"], want["loss"], **TOL)
    for name, g in want["grads"].items():
        if g is None:  # no token reaches it on any rank: no gradient, as in one process
            assert got["grads"][name] is None, name
        else:
            torch.testing.assert_close(got["grads"][name], g, **TOL, msg=lambda m, n=name: f"{pattern} {n}: {m}")
    for name, p in want["params"].items():
        torch.testing.assert_close(got["params"][name], p, **PARAM_TOL, msg=lambda m, n=name: f"{pattern} {n}: {m}")
    assert got["kept"]


PATTERNS = ["disjoint", "skip", "unused"]
HOWS = ["step", "accumulate", "checkpoint"]
#: what each rank runs: every pattern one step; accumulation and checkpointing where the ranks call different
#: experts; torch.autograd.grad (summed in each module's backward) where every rank calls the same ones
RUNS = [(p, h) for p in PATTERNS for h in HOWS if h == "step" or p != "unused"] + [
    ("unused", "grad"), ("skip", "retain"), ("skip", "chunks"), ("skip", "expert_checkpoint"), ("skip", "inputs"),
    ("disjoint", "copy"), ("skip", "short")]
#: beside tp: the experts' first Linear colwise and last rowwise (the scalar between them found by the coverage
#: probe: its gradient is summed over tp too, decided alike on the cp ranks whichever experts they called)
PLAN = {"model.layers.*.mlp.experts.*.0": "colwise", "model.layers.*.mlp.experts.*.2": "rowwise"}
#: ``chunks``: the pass in chunks of this many bytes (not 25 MiB): the model's gradients take several
SMALL_BUCKET = 4096


@pytest.fixture(scope="module")
def cp2() -> list[dict[str, Any]]:
    return run_processes(2, _ranks, RUNS, 1, timeout=240, pg_timeout=60)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_ranks_calling_different_experts_get_one_process_gradients(cp2: list[dict[str, Any]], pattern: str) -> None:
    want = _one_process(pattern, "step")
    for rank in cp2:
        _check(rank[f"{pattern}-step"], want, pattern)
        # the loss's all_reduce, then the gradients' sums: one all_reduce for the whole model, whatever was called
        assert rank[f"{pattern}-step"]["counts"]["all_reduce"] == 2 * 2, rank[f"{pattern}-step"]["counts"]


@pytest.mark.parametrize(("pattern", "how"), [r for r in RUNS if r[1] != "step"], ids=[f"{p}-{h}" for p, h in RUNS
                                                                                      if h != "step"])
def test_accumulation_checkpointing_retain_graph_chunks_and_autograd_grad(cp2: list[dict[str, Any]], pattern: str,
                                                                          how: str) -> None:
    want = _one_process(pattern, "step" if how == "chunks" else how)
    for rank in cp2:
        _check(rank[f"{pattern}-{how}"], want, pattern)


def test_one_pass_a_backward_with_reentrant_checkpointing(cp2: list[dict[str, Any]]) -> None:
    for rank in cp2:  # per layer, and around each expert call (whose count differs between the ranks)
        for how in ("checkpoint", "expert_checkpoint"):
            assert rank[f"skip-{how}"]["counts"]["all_reduce"] == 2 * 2, (how, rank[f"skip-{how}"]["counts"])


def test_the_pass_in_chunks_sends_one_all_reduce_a_chunk(cp2: list[dict[str, Any]]) -> None:
    model = _model("skip")
    elements = sum(p.numel() for p in model.parameters()) + len(list(model.parameters()))  # gradients and flags
    chunks = -(-elements * 4 // SMALL_BUCKET)  # float32: ceil(bytes / chunk bytes)
    assert chunks > 10
    for rank in cp2:
        assert rank["skip-chunks"]["counts"]["all_reduce"] == 2 * (1 + chunks)  # two steps: the loss, the chunks


@pytest.fixture(scope="module")
def cp2_tp2() -> list[dict[str, Any]]:
    return run_threaded(4, _ranks, [("disjoint", "step"), ("skip", "accumulate")], 2, timeout=240)


@pytest.mark.parametrize(("pattern", "how"), [("disjoint", "step"), ("skip", "accumulate")], ids=["disjoint", "skip"])
def test_beside_tensor_parallelism(cp2_tp2: list[dict[str, Any]], pattern: str, how: str) -> None:
    want = _one_process(pattern, how)
    for rank in cp2_tp2:
        _check(rank[f"{pattern}-{how}"], want, pattern)


def _fsdp_ranks(rank: int, world: int, pattern: str) -> dict[str, Any]:
    """FSDP2 over ``dp`` beside ``cp`` (2 x 2), the sum over ``cp`` folded into FSDP2's: each ``dp`` rank takes
    half the rows (equal token counts: the mean of the halves' losses is the whole batch's)."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = _model(pattern)
    tplower.parallelize(model, mesh, None, context="cp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    tplower.sum_context_in_fsdp(model, mesh, "cp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    d = mesh.get_local_rank("dp")
    out: dict[str, Any] = {}
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        ids = torch.cat(_batches())[2 * d:2 * d + 2]
        part = tplower.shard_sequence({"input_ids": ids, "labels": ids}, mesh, "cp", balance=False)
        model(**part).loss.backward()
        if step == 0:
            out["grads"] = {n: _whole(p.grad) for n, p in model.named_parameters()}
        opt.step()
    out["params"] = {n: _whole(p.detach()) for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("pattern", ["disjoint", "skip"])
def test_under_fsdp2_the_sum_over_cp_folds_into_fsdp2s(pattern: str) -> None:
    ranks = run_threaded(4, _fsdp_ranks, pattern, timeout=240)
    model = _model(pattern)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        ids = torch.cat(_batches())
        model(input_ids=ids, labels=ids, position_ids=torch.arange(SEQ).unsqueeze(0)).loss.backward()
        if step == 0:
            grads = {n: p.grad for n, p in model.named_parameters()}
        opt.step()
    for got in ranks:
        for name, g in grads.items():
            torch.testing.assert_close(got["grads"][name], g, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["params"][name], p.detach(), **PARAM_TOL,
                                       msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module", autouse=True)
def _native_all_reduce(native_all_reduce: None) -> None:
    """This module counts collectives by the names the lowering gives them: gloo's small all_reduces run natively."""
