"""Rules one process applies to the whole sequence, under context parallelism: 2 threaded ranks against one process.

Each case is a model-specific rule that reads more than a rank's tokens: the
loss's divisor given for a whole gradient-accumulation step. Each gives one
process's loss, logits and every gradient (within 1e-5), or a refusal on every
rank before any collective.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from context_cases import _grads, batch, tiny
from torch.distributed.device_mesh import init_device_mesh

import tplower
from tplower.testing import run_threaded

TOL = 1e-5


def _accumulated(mesh: Any) -> dict[str, float]:
    """Two micro-batches of one step with the caller's ``num_items_in_batch`` over both (as transformers' Trainer
    passes it): the summed loss and the accumulated gradients, against one process running the same step."""
    ref = tiny("llama", "sdpa")
    model = tplower.parallelize(copy.deepcopy(ref), mesh, None, context="cp")
    micro = [batch("padded", 21), batch("plain", 21)]
    count = torch.tensor(sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro))  # labels shifted by one
    want = sum(ref(**b, num_items_in_batch=count, use_cache=False).loss for b in micro)
    want.backward()
    parts = [tplower.shard_sequence({**b, "num_items_in_batch": count}, mesh) for b in micro]
    got = sum(model(**p).loss for p in parts)
    got.backward()
    return {"loss": float((got - want).abs()), "grad": float((_grads(model) - _grads(ref)).abs().max()),
            "kept": float(all(p["num_items_in_batch"] is count for p in parts))}


def _body(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    return {"accumulated": _accumulated(mesh)}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    tiny("llama", "sdpa")  # transformers' lazy imports once, outside the threads
    out: list[dict[str, Any]] = run_threaded(2, _body, timeout=300)
    return out


def test_a_given_token_count_is_kept_over_gradient_accumulation(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        got = r["accumulated"]
        assert got["kept"] == 1.0 and got["loss"] <= TOL and got["grad"] <= TOL, got
