"""The Hugging Face workflow end to end on a parallelized model, against one process (2 gloo ranks, one spawn).

Each row is what a user does after (or before) ``tplower.parallelize(model, mesh, "auto")`` on a tiny random
Llama: ``save_pretrained`` (reloaded by ``from_pretrained`` in one process), ``load_state_dict`` of a whole
state dict, ``torch.save(model.state_dict())`` read back, ``clip_grad_norm_`` with a foreach AdamW, PEFT LoRA
added before and after ``parallelize`` (3 AdamW steps; the adapters' first draw; ``PeftModel.save_pretrained``
byte for byte as one process writes it), and a model built on meta filled from a safetensors
folder (one file; several with an index; tied embeddings; Qwen3-MoE's packed experts and a vocabulary of 129
that tp=2 does not divide) or from a DCP checkpoint. The oracle is the same model in one process.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import tplower
from tplower.core.support.errors import TPLowerError
from tplower.state.loading import materialize
from tplower.testing import run_processes

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

X = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
LORA = {"r": 4, "target_modules": ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], "lora_dropout": 0.0,
        "lora_bias": True,
        "init_lora_weights": False}


def _config(tie: bool = False) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=tie)


def _llama(tie: bool = False) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config(tie))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((_full(a).detach() - _full(b).detach()).abs().max())


def _train(one: Any, tp: Any, steps: int, ids: torch.Tensor = X, clip: float | None = None) -> dict[str, float]:
    """``steps`` AdamW(foreach) steps of both models on the same loss: worst logits, grad, param difference."""
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, foreach=True)
            for m in (one, tp)]
    worst = {"logits": 0.0, "grad": 0.0, "norm": 0.0}
    for _ in range(steps):
        outs, norms = [], []
        for m, opt in zip((one, tp), opts, strict=True):
            opt.zero_grad()
            y = m(input_ids=ids).logits
            y.square().mean().backward()
            outs.append(y)
            if clip is not None:
                norms.append(float(_full(torch.nn.utils.clip_grad_norm_(m.parameters(), clip))))
        worst["logits"] = max(worst["logits"], _diff(outs[0], outs[1]))
        g1 = {n: p.grad for n, p in one.named_parameters() if p.requires_grad}
        g2 = {n: p.grad for n, p in tp.named_parameters() if p.requires_grad}
        assert set(g1) == set(g2)
        worst["grad"] = max(worst["grad"], *(_diff(g1[n], g2[n]) for n in g1))
        if norms:
            worst["norm"] = max(worst["norm"], abs(norms[0] - norms[1]))
        for opt in opts:
            opt.step()
    p1 = dict(one.named_parameters())
    worst["param"] = max(_diff(p, p1[n]) for n, p in tp.named_parameters())
    return worst


def _replicated_sums(model: Any) -> dict[str, float]:
    """Each replicated parameter's sum in float64 (ranks must agree exactly)."""
    return {n: float(p.to_local().double().sum()) for n, p in model.named_parameters()
            if isinstance(p, DTensor) and all(q.is_replicate() for q in p.placements)}


def _same_adapter_file(tp: Any, one: Any, folder: Path, name: str) -> bool:
    """``tp.save_pretrained`` (every rank) writes the ``adapter_model.safetensors`` one process writes for ``one``."""
    import torch.distributed as dist

    tp.save_pretrained(folder / f"{name}_tp")
    if dist.get_rank() == 0:
        one.save_pretrained(folder / f"{name}_one")
    dist.barrier()
    return bool((folder / f"{name}_tp" / "adapter_model.safetensors").read_bytes()
                == (folder / f"{name}_one" / "adapter_model.safetensors").read_bytes())


def _first_draw(values: dict[str, torch.Tensor], dims: dict[str, int], r: int) -> dict[str, Any]:
    """For each named whole tensor sharded along ``dims[name]``: ``max |w| * sqrt(fan_in)`` (``kaiming_uniform_(a=
    sqrt(5))`` and ``nn.Linear``'s bias stay within 1; a bias's fan-in is its B's, ``r``) and whether its two halves
    along that dim are equal."""
    return {n: (float(values[n].abs().max()) * (values[n].shape[1] if values[n].ndim == 2 else r) ** 0.5,
                torch.equal(*values[n].chunk(2, d))) for n, d in dims.items()}


def _lora(before: bool, mesh: Any, folder: Path) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    one = get_peft_model(_llama(), LoraConfig(**LORA))
    first = {n: p.detach().clone() for n, p in one.named_parameters() if "lora_" in n}  # one process's draw
    if before:
        torch.manual_seed(5)
        tp = get_peft_model(_llama(), LoraConfig(**LORA))
        tplower.parallelize(tp, mesh, "auto")  # the PeftModel: "auto" is its transformers model's plan
    else:
        tp = get_peft_model(tplower.parallelize(_llama(), mesh, "auto"), LoraConfig(**LORA))
        one.load_state_dict({k: _full(v) for k, v in tp.state_dict().items() if "lora_" in k}, strict=False)
    kinds = {(n.split(".")[-3], type(p.data).__name__, tuple(tplower.format_placement(q) for q in p.placements))
             for n, p in tp.named_parameters() if "lora_" in n and isinstance(p, DTensor)}
    plain = [n for n, p in tp.named_parameters() if "lora_" in n and not isinstance(p, DTensor)]
    dims = {n: p.placements[0].dim for n, p in tp.named_parameters()
            if "lora_" in n and isinstance(p, DTensor) and p.placements[0].is_shard()}
    draw = _first_draw({n: _full(p).detach() for n, p in tp.named_parameters() if n in dims}, dims, LORA["r"])
    saved = _same_adapter_file(tp, one, folder, "before" if before else "after")
    return {**_train(one, tp, 3), "kinds": sorted(kinds), "plain": plain, "sums": _replicated_sums(tp),
            "saved": saved, "draw": draw, "draw_one": _first_draw(first, dims, LORA["r"])}


def _lora_inner(mesh: Any, folder: Path) -> bool:
    """LoRA added before, ``parallelize`` given the model inside the ``PeftModel``: its save is whole too."""
    from peft import LoraConfig, get_peft_model

    models = []
    for _ in range(2):
        torch.manual_seed(5)
        models.append(get_peft_model(_llama(), LoraConfig(**LORA)))
    tplower.parallelize(models[0].base_model.model, mesh, "auto")
    return _same_adapter_file(models[0], models[1], folder, "inner")


def _lora_redraw(mesh: Any) -> dict[str, Any]:
    """Adapters PEFT injected with no ``PeftModel`` keep per-shard draws (and say so) until ``place_lora``, which
    draws them whole: compared with PEFT's own ``reset_lora_parameters`` on one process's layers, in module order
    from the same generator state."""
    import warnings

    from peft import LoraConfig, inject_adapter_in_model

    from tplower.adapters.lora import place_lora

    config = {"r": 4, "target_modules": ["q_proj", "o_proj", "down_proj"], "lora_dropout": 0.0}
    tp = inject_adapter_in_model(LoraConfig(**config), tplower.parallelize(_llama(), mesh, "auto"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tp(input_ids=X)
    torch.manual_seed(11)
    place_lora(tp)
    one = inject_adapter_in_model(LoraConfig(**config), _llama())
    torch.manual_seed(11)
    for name, module in one.named_modules():
        if name.endswith(("o_proj", "down_proj")):  # the rowwise layers: their A is the sharded adapter
            module.reset_lora_parameters("default", True)
    want = dict(one.named_parameters())
    return {"warned": sum("per-shard" in str(w.message) for w in caught),
            "diff": max(_diff(p, want[n]) for n, p in tp.named_parameters() if "lora_" in n
                        and isinstance(p, DTensor) and p.placements[0].is_shard()),
            "drawn": sorted(n for n, p in tp.named_parameters() if "lora_" in n and isinstance(p, DTensor)
                            and p.placements[0].is_shard())}


def _meta_load(mesh: Any, folder: str, build: Any, *, ids: torch.Tensor = X, **kw: Any) -> dict[str, Any]:
    import accelerate

    ref = build()
    with accelerate.init_empty_weights():
        model = type(ref)(ref.config)
    tplower.parallelize(model, mesh, "auto", **kw)
    report = tplower.load_safetensors(model, folder)
    local = sum(t._local_tensor.nbytes if isinstance(t, DTensor) else t.nbytes
                for t in {id(t): t for t in model.state_dict(keep_vars=True).values()}.values())
    out = {"logits": _diff(model(input_ids=ids).logits, ref(input_ids=ids).logits), "read": report.bytes_read,
           "local": local, "whole": sum(t.nbytes for t in ref.state_dict().values()),
           "missing": report.missing, "materialized": len(report.materialized), "tied": report.tied}
    out["step"] = _train(ref, model, 1, ids)
    return out


def _refusal(model: Any, folder: Path) -> str:
    """``load_safetensors``' error message, or ``"loaded"`` when it did not refuse."""
    try:
        tplower.load_safetensors(model, folder)
    except TPLowerError as e:
        return str(e)
    return "loaded"


def _rank(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaForCausalLM

    from tplower.run.hf_configs import tiny_config

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    d = Path(tmp)
    ref = _llama()
    want = ref(input_ids=X).logits
    out: dict[str, Any] = {}

    tp = tplower.parallelize(copy.deepcopy(ref), mesh, "auto")
    tp.save_pretrained(d / "saved")
    out["files"] = sorted(p.name for p in (d / "saved").iterdir())
    out["save_pretrained"] = _diff(LlamaForCausalLM.from_pretrained(d / "saved")(input_ids=X).logits, want)

    blank = tplower.parallelize(_llama(), mesh, "auto")
    with torch.no_grad():
        for p in blank.parameters():
            p.zero_()
    blank.load_state_dict(ref.state_dict())
    out["full_load"] = _diff(blank(input_ids=X).logits, want)

    torch.save(tp.state_dict(), d / f"state{rank}.pt")
    again = tplower.parallelize(_llama(), mesh, "auto")
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    again.load_state_dict(torch.load(d / f"state{rank}.pt", weights_only=False))
    out["torch_save"] = _diff(again(input_ids=X).logits, want)

    out["clip"] = _train(copy.deepcopy(ref), tplower.parallelize(copy.deepcopy(ref), mesh, "auto"), 2, clip=0.5)
    out["lora_before"] = _lora(True, mesh, d)
    out["lora_after"] = _lora(False, mesh, d)
    out["lora_inner"] = _lora_inner(mesh, d)
    out["lora_redraw"] = _lora_redraw(mesh)

    ids = torch.tensor([[0, 0, 5, 9, 11, 3], [7, 2, 8, 1, 4, 6]])  # left padding on the first row
    mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()
    greedy = {"max_new_tokens": 5, "do_sample": False, "use_cache": True, "pad_token_id": 0}
    out["generate"] = torch.equal(ref.generate(input_ids=ids, attention_mask=mask, **greedy),
                                  tp.generate(input_ids=ids, attention_mask=mask, **greedy))

    tied = _llama(tie=True)
    moe_config = tiny_config("qwen3_moe", vocab_size=129)

    def moe() -> Any:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(moe_config)

    if rank == 0:  # the folders a one-process run writes
        tied.save_pretrained(d / "tied")
        ref.save_pretrained(d / "sharded", max_shard_size="50KB")
        moe().save_pretrained(d / "moe", save_original_format=False)
        moe().save_pretrained(d / "moe_original")
    dist.barrier()
    out["index"] = (d / "sharded" / "model.safetensors.index.json").is_file()
    out["meta_tied"] = _meta_load(mesh, str(d / "tied"), lambda: _llama(tie=True))
    out["meta_sharded"] = _meta_load(mesh, str(d / "sharded"), _llama)
    ids = torch.randint(0, 129, (2, 8), generator=torch.Generator().manual_seed(2))
    out["meta_moe"] = _meta_load(mesh, str(d / "moe"), moe, ids=ids)
    out["meta_moe_ep"] = _meta_load(mesh, str(d / "moe"), moe, ids=ids, experts="ep")
    from transformers import AutoModelForCausalLM

    for experts in ("tp", "ep"):  # packed and index-sharded experts gathered whole, written in the original format
        tplower.parallelize(moe(), mesh, "auto", experts=experts).save_pretrained(d / f"moe_saved_{experts}")
        back = AutoModelForCausalLM.from_pretrained(d / f"moe_saved_{experts}")
        out[f"moe_save_{experts}"] = _diff(back(input_ids=ids).logits, moe()(input_ids=ids).logits)
    import accelerate

    with accelerate.init_empty_weights():
        converted = type(moe())(moe_config)
    out["converted"] = _refusal(tplower.parallelize(converted, mesh, "auto"), d / "moe_original")
    with torch.device("meta"):
        bare = LlamaForCausalLM(_config())
    out["meta_buffers"] = _refusal(tplower.parallelize(bare, mesh, "auto"), d / "saved")

    dcp.save(tp.state_dict(), checkpoint_id=str(d / "dcp"))
    with accelerate.init_empty_weights():
        from_dcp = LlamaForCausalLM(_config())
    tplower.parallelize(from_dcp, mesh, "auto")
    materialize(from_dcp)
    state = from_dcp.state_dict()
    dcp.load(state, checkpoint_id=str(d / "dcp"))
    from_dcp.load_state_dict(state)
    out["dcp"] = _diff(from_dcp(input_ids=X).logits, want)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        return run_processes(2, _rank, tmp, timeout=600.0)


def test_save_pretrained_writes_whole_weights_that_one_process_reloads(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert "model.safetensors" in r["files"] and "config.json" in r["files"]
        assert r["save_pretrained"] == 0.0
        assert r["moe_save_tp"] == 0.0 and r["moe_save_ep"] == 0.0  # Qwen3-MoE, experts under TP and EP


def test_whole_state_dict_and_torch_save_load_into_a_parallelized_model(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["full_load"] < 1e-6
        assert r["torch_save"] < 1e-6


def test_generate_with_kv_cache_and_left_padding_gives_one_process_tokens(ranks: list[dict[str, Any]]) -> None:
    assert all(r["generate"] for r in ranks)


def test_clip_and_foreach_adamw_on_the_auto_plan_equal_one_process(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["clip"]["norm"] < 1e-5 and r["clip"]["grad"] < 1e-6 and r["clip"]["param"] < 1e-4


@pytest.mark.parametrize("when", ["lora_before", "lora_after"])
def test_lora_trains_as_one_process(ranks: list[dict[str, Any]], when: str) -> None:
    for r in ranks:
        got = r[when]
        assert got["plain"] == []  # every adapter is a DTensor
        # colwise bases: A whole, B as the base; rowwise bases: A as the base, B whole
        assert got["kinds"] == [("lora_A", "DTensor", ("R",)), ("lora_A", "DTensor", ("S(1)",)),
                                ("lora_B", "DTensor", ("R",)), ("lora_B", "DTensor", ("S(0)",))]
        assert got["logits"] < 1e-5 and got["grad"] < 1e-6 and got["param"] < 1e-4
        assert got["saved"]  # adapter_model.safetensors byte for byte as one process writes it
    assert ranks[0][when]["sums"] == ranks[1][when]["sums"]  # replicated adapters identical across ranks


def test_lora_added_after_parallelize_starts_from_whole_draws(ranks: list[dict[str, Any]]) -> None:
    """PEFT draws a sharded adapter per rank at the local shape (a rowwise A within sqrt(2)/sqrt(in), the same values
    on both ranks); tplower draws it again whole. One process's values cannot be replayed (PEFT's local draws used
    other amounts of the generator), so: within one process's bound 1/sqrt(fan_in) (a per-shard draw, at least 128
    distinct values, stays within it with probability at most 2**-64), halves unequal, as one process's draw seen
    the same way; and,
    drawn by ``place_lora`` from a known generator state, bit for bit PEFT's one-process ``reset_lora_parameters``."""
    for r in ranks:
        draw, one = r["lora_after"]["draw"], r["lora_after"]["draw_one"]
        assert len(draw) == 2 * (2 + 3 * 2)  # per layer: A of o and down; B and its bias of q, v and gate
        for name, (bound, halves_equal) in draw.items():  # 1e-6: the float bound of kaiming_uniform_
            assert bound <= 1.0 + 1e-6 and not halves_equal, name
            assert one[name][0] <= 1.0 + 1e-6 and not one[name][1], name
        before = r["lora_before"]["draw"]  # added before parallelize: one process's draw itself
        assert before == one
        redraw = r["lora_redraw"]
        assert redraw["warned"] == 6  # each LoRA layer's forward, before place_lora
        assert len(redraw["drawn"]) == 6 and redraw["diff"] == 0.0


def test_lora_save_pretrained_when_the_peft_model_was_not_parallelized(ranks: list[dict[str, Any]]) -> None:
    assert all(r["lora_inner"] for r in ranks)  # parallelize(peft_model.base_model.model): saved whole


@pytest.mark.parametrize("case", ["meta_tied", "meta_sharded", "meta_moe", "meta_moe_ep"])
def test_meta_model_filled_from_safetensors_reads_only_its_slices(ranks: list[dict[str, Any]], case: str) -> None:
    assert ranks[0]["index"]  # "meta_sharded" reads several files through model.safetensors.index.json
    for r in ranks:
        got = r[case]
        assert got["missing"] == [] and got["materialized"] > 0
        assert got["logits"] < 1e-5
        assert got["step"]["grad"] < 1e-6 and got["step"]["param"] < 1e-4
        assert got["read"] == got["local"] < got["whole"]  # this rank's boxes, no more
    assert ranks[0]["meta_tied"]["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}


def test_loading_refusals_name_the_fix(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert "save_original_format=False" in r["converted"]
        assert "init_empty_weights" in r["meta_buffers"]


def test_meta_model_from_a_dcp_checkpoint(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["dcp"] < 1e-6


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(x))))


#: sequence parallelism: the block's input and output are sequence shards (dim 1)
SP_PLAN = {"norm": "sequence_parallel", "up": {"style": "colwise", "in_src": {"0": {"tp": "S(1)"}}},
           "down": {"style": "rowwise", "out_dst": {"out": {"tp": "S(1)"}}}}


def _sp_rank(rank: int, world: int, ref: Any, x: torch.Tensor) -> dict[str, Any]:
    one, tp = copy.deepcopy(ref), copy.deepcopy(ref)  # threads share the RNG: the model is drawn once, outside
    tplower.parallelize(tp, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), SP_PLAN)
    one(x).square().sum().backward()
    y = tp(x.chunk(world, 1)[rank])  # this rank's sequence shard in, its shard out
    y.square().sum().backward()  # the ranks' losses sum to one process's
    worst = max(_diff(p.grad, q.grad) / float(q.grad.abs().max())
                for (n, p), q in zip(tp.named_parameters(), one.parameters(), strict=True) if p.requires_grad)
    return {"out": _diff(y, one(x).chunk(world, 1)[rank]), "grad": worst,
            "whole": sorted(n for n, p in tp.named_parameters() if "lora" in n and isinstance(p, DTensor)
                            and p.placements[0].is_replicate())}


def test_lora_under_sequence_parallelism_reduces_the_whole_adapters_gradients() -> None:
    """Under sequence parallelism the whole adapter runs on a sequence shard: its gradient is partial per rank and
    must be summed (without it each rank's A of ``up`` would hold its shard's gradient only)."""
    from peft import LoraConfig, get_peft_model

    from tplower.testing import run_threaded

    torch.manual_seed(0)
    ref = get_peft_model(_Block(), LoraConfig(r=2, target_modules=["up", "down"], lora_dropout=0.0,
                                              init_lora_weights=False))
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(3))
    for r in run_threaded(2, _sp_rank, ref, x):
        assert r["whole"] == ["base_model.model.down.lora_B.default.weight",
                              "base_model.model.up.lora_A.default.weight"]
        assert r["out"] < 1e-5
        assert r["grad"] < 1e-6  # relative to the largest entry of each gradient
