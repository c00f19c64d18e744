"""Context parallelism on an encoder (bidirectional attention) on 2 threaded ranks, against one process.

A tiny BERT: every token attends to every token of its row, padding aside,
so the mask is transformers' bidirectional one for the whole sequence (a
causal mask would be silently wrong wherever a row is padded). Both modes,
``eager`` and ``sdpa``, balance on and off, a batch with padding: the last
hidden state made whole by ``gather_sequence`` and every parameter's gradient
of a loss on it.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import tplower
from tplower.testing import run_threaded

CASES = list(itertools.product(("ulysses", "allgather"), ("eager", "sdpa"), (True, False)))


def _bert(impl: str) -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, attn_implementation=impl)
    torch.manual_seed(0)
    return BertModel(config).eval()


MODELS: dict[str, torch.nn.Module] = {}


def _body(rank: int, world: int) -> dict[str, tuple[float, float]]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    ids = torch.randint(0, 100, (2, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, 9:] = 0  # row 1 padded at its end
    batch = {"input_ids": ids, "attention_mask": mask}
    out = {}
    for mode, impl, balance in CASES:
        ref = copy.deepcopy(MODELS[impl])
        par = tplower.parallelize(copy.deepcopy(MODELS[impl]), mesh, None, context="cp", context_mode=mode)
        want = ref(**batch).last_hidden_state
        (want.square() * mask[..., None]).sum().backward()
        part = tplower.shard_sequence(batch, mesh, "cp", balance=balance)
        got = par(**part).last_hidden_state
        whole = tplower.gather_sequence(got, mesh, "cp", split=part)
        (whole.square() * mask[..., None]).sum().backward()
        grads = [(q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad, p.grad)
                 for p, q in zip(ref.parameters(), par.parameters(), strict=True) if p.grad is not None]
        out[f"{mode}-{impl}-{balance}"] = (
            float(((whole - want) * mask[..., None]).abs().max()),
            max(float((a - b).abs().max()) / max(1.0, float(b.abs().max())) for a, b in grads))
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    for impl in ("eager", "sdpa"):  # built once, outside the threads (they share torch's generator)
        MODELS[impl] = _bert(impl)
    return run_threaded(2, _body, timeout=300)


@pytest.mark.parametrize("case", [f"{m}-{i}-{b}" for m, i, b in CASES])
def test_encoder_with_padding_matches_one_process(ranks: list[dict[str, Any]], case: str) -> None:
    for r in ranks:
        hidden, grad = r[case]
        assert hidden <= 1e-5 and grad <= 1e-5, (case, hidden, grad)


#: (attention kernel, sequence length, balance): one that divides over cp, one that does not
VERIFY_CASES = [("eager", 12, True), ("sdpa", 13, False)]


def _verify_body(rank: int, world: int) -> list[tuple[str, str, float, bool]]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    out = []
    for impl, length, balance in VERIFY_CASES:
        ids = torch.randint(0, 100, (2, length), generator=torch.Generator().manual_seed(2))
        report = tplower.verify(lambda impl=impl: copy.deepcopy(MODELS[impl]), "derive", mesh, {"input_ids": ids},
                                context="cp", balance=balance)
        out += [(c.phase, c.placement, c.max_diff, c.ok) for c in report.checks if c.module.endswith("attention.self")]
    return out


def test_verify_gathers_bert_attention_over_cp_and_tp() -> None:
    # BERT's attention.self ends before its output projection: under tp its output keeps this rank's heads (the
    # last dim split), so verify makes it whole over tp as well as over cp before comparing with one process
    for impl in ("eager", "sdpa"):
        MODELS.setdefault(impl, _bert(impl))
    ranks = run_threaded(4, _verify_body, timeout=300)
    for checks in ranks:
        assert len(checks) == 4 * len(VERIFY_CASES)  # two layers, forward and backward, per case
        for phase, where, diff, ok in checks:
            assert where == "S(1) over 'cp', S(-1) over 'tp'" and ok and diff <= 1e-5, (phase, where, diff)
