"""Dropout across ranks (tplower.runtime.dropout): replicated activations get one mask, sharded ones each rank's own.

A stack of two blocks ``x + drop_rep(o(drop_sharded(gelu(q(norm(x))))))`` with ``q`` column-parallel and ``o``
row-parallel at tp=2 on 2 gloo ranks, every rank seeded alike, dropout 0.1. Forward hooks record each dropout's
mask (``out != 0``). Measured: the correlation between the two ranks' masks inside the sharded region (their own
features: it must be near 0, where one common stream gave 1: head ``h`` on rank 0 and ``h + H/2`` on rank 1 shared
a mask), the drop rate, that the replicated region's masks are the same on both ranks, and that the replicated
parameters are equal on both ranks after three SGD steps, also where the intermediate size does not divide (65
features: 33 and 32, so the ranks drew different counts of random numbers in the sharded region and, from one
stream, their replicated masks drifted apart). Activation checkpointing recomputes the same masks: the
gradients with and without it are equal; the generated forwards (``tplower codegen``) draw the hooks' masks. A
tiny BERT (derived plan, attention and hidden dropout 0.1) keeps
its replicated parameters equal on both ranks over AdamW steps.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import tplower
from tplower.testing import run_processes

D, P = 16, 0.1


class _Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm, self.q, self.o = nn.LayerNorm(D), nn.Linear(D, hidden), nn.Linear(hidden, D)
        self.drop_sharded, self.drop_rep = nn.Dropout(P), nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop_rep(self.o(self.drop_sharded(F.gelu(self.q(self.norm(x))))))


class _Net(nn.Module):
    def __init__(self, hidden: int, ckpt: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(hidden) for _ in range(2))
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return x


PLAN = {"blocks.*.q": "colwise", "blocks.*.o": "rowwise"}


def _digest(t: torch.Tensor) -> str:
    local = t.to_local() if isinstance(t, DTensor) else t
    return hashlib.sha256(local.detach().contiguous().numpy().tobytes()).hexdigest()


def _record(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    masks: dict[str, list[torch.Tensor]] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Dropout):
            m.register_forward_hook(lambda mod, args, out, name=name: masks.setdefault(name, []).append(out != 0))
    return masks


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    return float(((a - a.mean()) * (b - b.mean())).mean() / (a.std(unbiased=False) * b.std(unbiased=False)))


def _masks_and_replicas(mesh: Any, hidden: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = tplower.parallelize(_Net(hidden), mesh, PLAN).train()
    masks = _record(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 32, D, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    sharded = torch.stack([m.float() for m in masks["blocks.0.drop_sharded"][:1]]) if hidden % 2 == 0 else None
    return {"sharded": sharded,  # [1, 4, 32, hidden/2] of the first step
            "sharded_rate": float(torch.cat([(~m).float().flatten() for m in masks["blocks.0.drop_sharded"]]).mean()),
            "layers_equal": bool(torch.equal(masks["blocks.0.drop_sharded"][0], masks["blocks.1.drop_sharded"][0])),
            "rep": [_digest(m) for k in ("blocks.0.drop_rep", "blocks.1.drop_rep") for m in masks[k]],
            "replicas": [_digest(p) for p in model.parameters()
                         if not isinstance(p, DTensor) or all(q.is_replicate() for q in p.placements)]}


def _checkpointed(mesh: Any) -> float:
    """Gradients with activation checkpointing equal those without, from the same seed (the recompute's masks)."""
    torch.manual_seed(0)
    ref = _Net(64)
    grads = []
    for ckpt in (False, True):
        model = tplower.parallelize(copy.deepcopy(ref), mesh, PLAN).train()
        model.ckpt = ckpt
        torch.manual_seed(5)
        model(torch.randn(2, 8, D, generator=torch.Generator().manual_seed(2))).square().mean().backward()
        grads.append([p.grad.to_local() for p in model.parameters()])
    return max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))


def _generated(mesh: Any) -> bool:
    """The generated forwards (tplower codegen) switch streams where the boundaries do: the same masks."""
    from tplower.codegen.emit import emit, install

    torch.manual_seed(0)
    ref = _Net(64)
    out = []
    for written in (False, True):
        model = copy.deepcopy(ref)
        model = install(model, mesh, emit(ref, mesh, PLAN)) if written else tplower.parallelize(model, mesh, PLAN)
        masks = _record(model.train())
        torch.manual_seed(7)
        model(torch.randn(2, 8, D, generator=torch.Generator().manual_seed(2)))
        out.append({k: [_digest(m) for m in v] for k, v in masks.items()})
    return out[0] == out[1]


def _bert(mesh: Any) -> list[str]:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=66, max_position_embeddings=32, attention_probs_dropout_prob=P,
                        hidden_dropout_prob=P, attn_implementation="eager")
    model = tplower.parallelize(BertForMaskedLM(config), mesh, "derive").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return [_digest(p) for p in model.parameters()
            if not isinstance(p, DTensor) or all(q.is_replicate() for q in p.placements)]


def _rank(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return {"even": _masks_and_replicas(mesh, 64), "uneven": _masks_and_replicas(mesh, 65),
            "checkpoint": _checkpointed(mesh), "generated": _generated(mesh), "bert": _bert(mesh)}


def test_replicated_dropout_agrees_and_sharded_dropout_is_each_ranks_own() -> None:
    r0, r1 = run_processes(2, _rank, timeout=300)
    corr = _corr(r0["even"]["sharded"], r1["even"]["sharded"])
    assert abs(corr) < 0.1, corr  # 8192 mask entries: independent masks correlate about 0 +- 0.011
    for case in ("even", "uneven"):
        for r in (r0, r1):
            assert 0.08 < r[case]["sharded_rate"] < 0.12, (case, r[case]["sharded_rate"])
            assert not r[case]["layers_equal"], case
        assert r0[case]["rep"] == r1[case]["rep"], case  # the replicated region: one mask on both ranks
        assert r0[case]["replicas"] == r1[case]["replicas"], case
    assert r0["checkpoint"] == 0.0 and r1["checkpoint"] == 0.0
    assert r0["generated"] and r1["generated"]
    assert r0["bert"] == r1["bert"]
