"""Parameters whose sharded dim does not divide: ``torch.chunk`` pieces, as ``distribute_tensor`` cuts them.

A tiny Llama (``"auto"`` plan: vocabulary-parallel embedding, colwise/rowwise attention and MLP, colwise
``lm_head`` gathered) with a vocabulary of 257 (the remainder of GPT-2's 50257 at tp=2 and 4) or 130 (BERT's
30522 at tp=4) and an intermediate size of 129: logits, loss, every gradient and 3 AdamW steps against one
process at tp=2 (gloo), 3 and 4 (threaded); DCP saved at tp=2 and read at tp=3, tp=4 and in one process; and
a tp that does not divide the key/value heads refused at ``parallelize``.
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import tplower
from tplower import TPLowerError
from tplower.testing import run_processes, run_threaded

transformers = pytest.importorskip("transformers")
SLOW = os.environ.get("TPLOWER_SLOW") == "1"


def _llama(vocab: int, inter: int, kv: int = 12) -> Any:
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=96, intermediate_size=inter,
                                      num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=kv,
                                      head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).float()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(rank: int, world: int, ref: Any) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = tplower.parallelize(copy.deepcopy(ref), mesh, "auto")
    one = copy.deepcopy(ref)
    # eps 1e-6: Adam divides by sqrt(v) + eps, which turns float32 rounding of near-zero gradients into whole
    # steps of lr; a larger eps keeps the comparison about the sharding
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6, foreach=True) for m in (one, tp)]
    out: dict[str, Any] = {"pieces": tuple(tp.lm_head.weight.to_local().shape[:1]) +
                           tuple(tp.model.layers[0].mlp.up_proj.weight.to_local().shape[:1])}
    ids = torch.randint(0, ref.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    for step in range(3):
        res = []
        for m, opt in zip((one, tp), opts, strict=True):
            opt.zero_grad()
            r = m(input_ids=ids, labels=ids, use_cache=False)
            r.loss.backward()
            res.append(r)
        if step == 0:
            out["logits"] = float((res[0].logits - res[1].logits).abs().max())
            out["loss"] = abs(float(res[0].loss) - float(res[1].loss))
            out["grad"] = max(float((_full(q.grad) - p.grad).abs().max()) / max(float(p.grad.abs().max()), 1e-6)
                              for p, q in zip(one.parameters(), tp.parameters(), strict=True))
        for opt in opts:
            opt.step()
    out["params"] = max(float((_full(q) - p).abs().max()) for p, q in zip(one.parameters(), tp.parameters(),
                                                                          strict=True))
    return out


def _check(per_rank: list[dict[str, Any]], pieces: tuple[int, ...] | None = None) -> None:
    for r in per_rank:
        assert r["logits"] <= 1e-5 and r["loss"] <= 1e-5 and r["grad"] <= 1e-4, r
        assert r["params"] <= 1e-5, r
    if pieces is not None:
        assert tuple(r["pieces"] for r in per_rank) == pieces  # torch.chunk's pieces, as distribute_tensor's


def _tp2(rank: int, world: int, refs: list[Any]) -> list[dict[str, Any]]:
    return [_train(rank, world, ref) for ref in refs]


def test_uneven_vocabulary_and_intermediate_at_tp2() -> None:
    refs = [_llama(257, 129)] + ([_llama(257, 128), _llama(128, 129)] if SLOW else [])  # each alone: slow run
    per_rank = run_processes(2, _tp2, refs, timeout=600)
    for i, want in enumerate([((129, 65), (128, 64)), ((129, 64), (128, 64)), ((64, 65), (64, 64))][:len(refs)]):
        _check([r[i] for r in per_rank], want)


@pytest.mark.parametrize("world,vocab,want", [
    pytest.param(3, 257, ((86, 43), (86, 43), (85, 43)), marks=pytest.mark.slow),  # the DCP test reads at tp=3
    (4, 257, ((65, 33), (65, 33), (65, 33), (62, 30))),
    pytest.param(4, 130, ((33, 33), (33, 33), (33, 33), (31, 30)), marks=pytest.mark.slow)])
def test_uneven_at_tp3_and_tp4(world: int, vocab: int, want: tuple[tuple[int, int], ...]) -> None:
    _check(run_threaded(world, _train, _llama(vocab, 129)), want)


def _save(rank: int, world: int, ref: Any, folder: str) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(tplower.parallelize(copy.deepcopy(ref), mesh, "auto").state_dict(), checkpoint_id=folder)


def _load(rank: int, world: int, ref: Any, folder: str) -> bool:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    blank = copy.deepcopy(ref)
    with torch.no_grad():
        for p in blank.parameters():
            p.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = tplower.parallelize(blank, mesh, "auto")
    sd = tp.state_dict()
    dcp.load(sd, checkpoint_id=folder)
    tp.load_state_dict(sd)
    return all(torch.equal(_full(q), p) for p, q in zip(ref.parameters(), tp.parameters(), strict=True))


@pytest.mark.slow  # tests/test_packed_checkpoint.py reshards tp=2 -> tp=4 and one process in CI
def test_dcp_saved_at_tp2_loads_at_tp3_tp4_and_in_one_process(tmp_path: Path) -> None:
    ref, folder = _llama(257, 129), str(tmp_path / "ckpt")
    run_processes(2, _save, ref, folder)
    for world in (3, 4):
        assert all(run_threaded(world, _load, ref, folder)), world
    one = copy.deepcopy(ref)
    sd = {k: torch.zeros_like(v) for k, v in one.state_dict().items()}
    dcp.load(sd, checkpoint_id=folder, no_dist=True)
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())


def _heads(rank: int, world: int, ref: Any) -> str:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with pytest.raises(TPLowerError) as exc:
        tplower.parallelize(copy.deepcopy(ref), mesh, "auto")
    return str(exc.value)


def test_key_value_heads_that_do_not_divide_are_refused_at_parallelize() -> None:
    msg = run_threaded(4, _heads, _llama(128, 128, kv=2))[0]
    assert "num_key_value_heads=2 does not divide over 4" in msg and "among [1, 2]" in msg
    assert "model.layers.0.self_attn" in msg


def _fsdp(rank: int, world: int, ref: Any, ids: torch.Tensor, want: dict[str, torch.Tensor]) -> float:
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_coordinate()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tplower.parallelize(copy.deepcopy(ref), mesh, "auto")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model(input_ids=ids.chunk(2, 0)[dp], use_cache=False).logits.square().mean().backward()
    return max(float((_full(p.grad) - want[n] / 2).abs().max()) / max(float(want[n].abs().max()), 1e-6)
               for n, p in model.named_parameters())


def test_fsdp2_over_dp_with_uneven_tp_shards() -> None:
    ref = _llama(257, 129)
    ids = torch.randint(0, 257, (4, 8), generator=torch.Generator().manual_seed(0))
    for half in ids.chunk(2, 0):  # each dp rank's loss; FSDP2 averages their gradients
        ref(input_ids=half, use_cache=False).logits.square().mean().backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref.zero_grad(set_to_none=True)
    for worst in run_threaded(4, _fsdp, ref, ids, want, timeout=600):
        assert worst <= 1e-4, worst


def _tools(rank: int, world: int, ref: Any) -> dict[str, Any]:
    from tplower.codegen.emit import emit, install

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ids = torch.randint(0, 257, (2, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = tplower.verify(lambda: copy.deepcopy(ref), "auto", mesh, {"input_ids": ids, "use_cache": False},
                                steps=2)
        source = emit(ref, mesh, "auto")
        hooked = tplower.parallelize(copy.deepcopy(ref), mesh, "auto")
        written = install(copy.deepcopy(ref), mesh, source)
    with torch.no_grad():
        same = bool(torch.equal(hooked(input_ids=ids).logits, written(input_ids=ids).logits))
    return {"verify": report.ok, "codegen": same, "written_out": "ops.hooked(" not in source}


def test_verify_and_codegen_take_uneven_shards() -> None:
    for r in run_threaded(2, _tools, _llama(257, 129)):
        assert r == {"verify": True, "codegen": True, "written_out": True}, r
