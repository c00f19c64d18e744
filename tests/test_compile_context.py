"""A compiled context-parallel train step breaks no graph, on plain, padded and packed batches whose layouts change.

``torch.compile(model, backend="aot_eager")`` of tiny Llama under ``parallelize(model, mesh, None, context="cp")``
at cp=2 (2 gloo ranks, Ulysses), five steps per kind of batch, the padding and the documents' lengths changing
from step to step: dynamo's graph-break counter stays at 0 (the batch's runs and the layout's orders are made by
``shard_sequence``, eagerly, so the forward reads no tensor values and takes no lock), and each step's loss is one
process's on the whole batch. ``TPLOWER_SLOW=1`` (compiling takes about 30 s a kind on 2 cores).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import tplower
from tplower.testing import run_processes

pytestmark = pytest.mark.skipif(not os.environ.get("TPLOWER_SLOW"), reason="slow: runs with TPLOWER_SLOW=1")
pytest.importorskip("transformers")

SEQ = 48


def _batch(kind: str, step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(step))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if kind == "padded":  # row 0 left-padded by 3 + step tokens
        mask = torch.ones(2, SEQ, dtype=torch.long)
        mask[0, :3 + step] = 0
        batch["attention_mask"] = mask
        batch["labels"][mask == 0] = -100
    if kind == "packed":  # two documents, the cut moving
        cut = 10 + 3 * step
        batch["position_ids"] = torch.cat([torch.arange(cut), torch.arange(SEQ - cut)]).unsqueeze(0).expand(2, SEQ)
    return batch


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def _ranks(rank: int, world: int, kinds: tuple[str, ...]) -> dict[str, Any]:
    import torch._dynamo as dynamo

    os.environ["OMP_NUM_THREADS"] = "1"
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    out: dict[str, Any] = {}
    for kind in kinds:
        dynamo.reset()
        dynamo.utils.counters.clear()
        model = tplower.parallelize(_model(), mesh, None, context="cp")
        compiled = torch.compile(model, backend="aot_eager")
        losses = []
        for step in range(5):
            loss = compiled(**tplower.shard_sequence(_batch(kind, step), mesh, "cp")).loss
            loss.backward()
            losses.append(float(loss.detach()))
        out[kind] = {"breaks": sum(dynamo.utils.counters["graph_break"].values()), "losses": losses,
                     "graphs": dynamo.utils.counters["stats"].get("unique_graphs", 0)}
    return out


KINDS = ("plain", "padded", "packed")


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_processes(2, _ranks, KINDS, timeout=600)


@pytest.mark.parametrize("kind", KINDS)
def test_no_graph_break_and_one_process_loss(ranks: list[dict[str, Any]], kind: str) -> None:
    model = _model()
    want = [float(model(**_batch(kind, step)).loss) for step in range(5)]
    for rank in ranks:
        assert rank[kind]["breaks"] == 0, rank[kind]
        torch.testing.assert_close(rank[kind]["losses"], want, atol=1e-5, rtol=1e-5)
