"""Context parallelism under FSDP2 on 4 threaded ranks, against one process on the whole batch.

Two layouts a user picks: FSDP2 over ``dp`` beside ``cp`` (``parallelize``
sums each gradient over ``cp``, ``context_grads="sum"``), and FSDP2 over
``dp`` and ``cp`` flattened into one axis, torchtitan's layout
(``context_grads="mean"``: FSDP2 averages over the flattened axis, the loss's
gradient is the ``cp`` size). Each data-parallel rank takes 2 of the batch's
4 rows (no padding: every rank has the same token count, so the mean of the
two halves' losses is the whole batch's loss) and splits its sequence over
``cp``. Compared: the loss, the gradient norm ``clip_grad_norm_`` returns,
every parameter's gradient after the first step (gradients, not only
parameters: AdamW would hide a gradient off by a constant factor), and every
parameter after three AdamW steps.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from context_cases import tiny
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import tplower
from tplower.testing import run_threaded

LAYOUTS = ("dp", "dp_cp")


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rows(seq: int, step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (4, seq), generator=torch.Generator().manual_seed(100 * step + seq))
    return {"input_ids": ids, "labels": ids.clone()}


def _train(layout: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    ref = tiny("llama", "sdpa")
    if layout == "dp":
        model = tplower.parallelize(copy.deepcopy(ref), mesh, None, context="cp")
        shard_mesh = mesh["dp"]
    else:
        model = tplower.parallelize(copy.deepcopy(ref), mesh, None, context="cp", context_grads="mean")
        shard_mesh = mesh["dp", "cp"]._flatten("dp_cp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True) for m in (ref, model)]
    d = mesh.get_local_rank("dp")
    out: dict[str, Any] = {"loss": [], "norm": []}
    for step in range(3):
        whole = _rows(37, step)
        mine = tplower.shard_sequence({k: v[2 * d:2 * d + 2] for k, v in whole.items()}, mesh, "cp")
        got = []
        for m, opt, part in ((ref, opts[0], {**whole, "use_cache": False}), (model, opts[1], mine)):
            opt.zero_grad()
            loss = m(**part).loss
            loss.backward()
            if step == 0:
                got.append([_whole(p.grad).detach().clone() for p in m.parameters()])
            norm = float(_whole(torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1e9)))
            got_loss = float(loss.detach())
            opt.step()
            out["norm"].append(norm)
            out["loss"].append(got_loss)
        if step == 0:
            out["grad"] = max(float((q - p).abs().max()) for p, q in zip(*got, strict=True))
            out["grad_scale"] = max(float(p.abs().max()) for p in got[0])
    out["params"] = max(float((_whole(q).detach() - p.detach()).abs().max())
                        for p, q in zip(ref.parameters(), model.parameters(), strict=True))
    return out


def _body(rank: int, world: int) -> dict[str, Any]:
    return {layout: _train(layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_threaded(4, _body, timeout=600)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fsdp2_with_context_parallelism_gives_one_process_gradients(ranks: list[dict[str, Any]],
                                                                   layout: str) -> None:
    for r in ranks:
        got = r[layout]
        assert got["grad"] <= 1e-5 * max(1.0, got["grad_scale"]), got["grad"]
        one, ours = got["norm"][0::2], got["norm"][1::2]
        assert all(abs(a - b) <= 1e-5 * max(1.0, a) for a, b in zip(one, ours, strict=True)), got["norm"]
        # three AdamW steps at lr 1e-3: the parameters stay one process's (AdamW rescales tiny gradient noise)
        assert got["params"] <= 1e-4, got["params"]
    # ranks 0, 1 hold the batch's first two rows (dp 0), ranks 2, 3 the last two: the mean of the two halves'
    # losses (equal token counts) is one process's loss on the whole batch, at every step
    for step in range(3):
        one = ranks[0][layout]["loss"][2 * step]
        halves = [ranks[r][layout]["loss"][2 * step + 1] for r in (0, 2)]
        assert abs(sum(halves) / 2 - one) <= 1e-5, (one, halves)
        assert [ranks[r][layout]["loss"][2 * step + 1] for r in (1, 3)] == halves  # the same on both cp ranks


def _three_axes(rank: int, world: int) -> float:
    """FSDP2 over ``dp`` of a model on (dp=2, cp=2, tp=2) with the model's own tensor-parallel plan: the
    largest difference of a gradient from one process's on the whole batch."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    ref = tiny("llama", "sdpa")
    model = tplower.parallelize(copy.deepcopy(ref), mesh, "auto", context="cp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    whole = _rows(37, 0)
    d = mesh.get_local_rank("dp")
    ref(**whole, use_cache=False).loss.backward()
    model(**tplower.shard_sequence({k: v[2 * d:2 * d + 2] for k, v in whole.items()}, mesh, "cp")).loss.backward()
    return max(float((_whole(q.grad) - p.grad).abs().max())
               for p, q in zip(ref.parameters(), model.parameters(), strict=True))


@pytest.mark.slow
def test_fsdp2_over_dp_with_cp_and_tp_gives_one_process_gradients() -> None:
    assert max(run_threaded(8, _three_axes, timeout=600)) <= 1e-5


def test_fsdp2_beside_cp_holds_no_gradient_copy_at_the_end_of_backward() -> None:
    """Once FSDP2 sums over cp (``sum_context_in_fsdp``), tplower's own end-of-backward pass no longer takes the
    parameters FSDP2 replaced: it used to sum zeros for each of them every step, holding a buffer of the whole
    model's unsharded gradients at the end of backward (two more float32 layers a layer here: 592,025 bytes a layer
    against dp2's 295,972). Traced on fake ranks (``tplower.planner.trace_step``, which real runs match to the byte:
    tests/test_planner.py): the end of backward grows by a layer's sharded parameters, gradients and AdamW states,
    as at dp2 alone."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from tplower.planner import trace_step

    def end(sizes: dict[str, int], layers: int) -> int:
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2)
        t = trace_step(config, sizes, seq_len=64, micro_batch=2, dtype=torch.float32,
                       context_mode="ulysses" if "cp" in sizes else None)
        return sum(t.phases["backward end"].values())

    layer = 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64)  # float32 bytes of one decoder layer
    for sizes in ({"dp": 2, "cp": 2}, {"dp": 2}):
        # parameters, gradients and AdamW's two states of one more layer, sharded over dp2 (a few bytes of padding)
        assert abs(end(sizes, 4) - end(sizes, 3) - 4 * layer // 2) < 64, sizes
