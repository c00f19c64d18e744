"""Hugging Face plans as they ship: ``plan="auto"``, prefixes, parameter keys and transformers 5 styles.

Each case runs the parallelized model at tp=2 (and 4 where it matters) on the
threaded group and compares its output and every parameter gradient (whole,
``full_tensor``) with the same model in one process.
"""

from __future__ import annotations

import copy
import types
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from tplower import TPLowerError
from tplower.nn.parallelize import parallelize
from tplower.plans.entries import load_plan, match_plan
from tplower.plans.hf import model_tp_plan, resolve_model_plan
from tplower.testing import RankFailure, run_threaded

TOL = {"atol": 1e-5, "rtol": 1e-4}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(rank: int, world: int, ref: nn.Module, plan: Any, inputs: dict[str, torch.Tensor],
             out_of: Any = lambda o: o) -> dict[str, float]:
    """Output and every gradient of ``ref`` parallelized by ``plan``, against ``ref`` in one process (max diffs)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = parallelize(copy.deepcopy(ref), mesh, plan)
    out = out_of(model(**inputs))
    out.square().sum().backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    if rank != 0:
        return {}
    want = out_of(ref(**inputs))  # rank 0 alone runs the shared reference (threads share it)
    want.square().sum().backward()
    diffs = {"out": float((out - want).abs().max())}
    for name, p in ref.named_parameters():
        assert name in grads, f"{name} got no gradient"
        diffs[name] = float((grads[name] - p.grad).abs().max())
    return diffs


def _tiny(arch: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 64}
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=8)).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_auto_plan_of_causal_lm_matches_one_process(arch: str) -> None:
    """Vocabulary-parallel embedding, gathered lm_head, and (Qwen3) q/k norms whose gradients are reduced."""
    ref = _tiny(arch)
    plan = model_tp_plan(ref)
    assert plan["lm_head"] == "colwise_gather_output" and plan["model.embed_tokens"] == "embedding_rowwise"
    ids = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))}
    diffs = run_threaded(2, _compare, ref, "auto", ids, lambda o: o.logits)[0]
    assert max(diffs.values()) < 1e-5, {k: v for k, v in diffs.items() if v >= 1e-5}


def test_base_model_plan_dict_is_put_under_the_prefix() -> None:
    ref = _tiny("llama")
    base = dict(ref.config.base_model_tp_plan)
    assert all(not k.startswith("model.") for k in base)
    plan = resolve_model_plan(base, ref)
    assert set(plan) == {f"model.{k}" for k in base}
    ids = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(4))}
    diffs = run_threaded(2, _compare, ref, base, ids, lambda o: o.logits)[0]
    assert max(diffs.values()) < 1e-5


def _table_model(model_type: str) -> nn.Module:
    from tplower.run.hf_table import architectures, tiny_model
    from tplower.run.quiet import quiet_transformers

    with quiet_transformers():
        return tiny_model(architectures([model_type])[0])


def _auto_install(rank: int, world: int, ref: nn.Module) -> int:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = parallelize(copy.deepcopy(ref), mesh, "auto")
    return sum(isinstance(p, DTensor) and not p.placements[0].is_replicate() for p in model.parameters())


def test_auto_never_warns_about_its_own_shipped_keys() -> None:
    """Qwen3-MoE ships dense-MLP keys (``mlp.gate_proj``) for configs with dense layers; this one has none."""
    ref = _table_model("qwen3_moe")
    assert "model.layers.*.mlp.gate_proj" in model_tp_plan(ref)  # shipped, naming no module of this config
    with warnings.catch_warnings(record=True) as caught:  # the ranks are threads: their warnings come here
        warnings.simplefilter("always")
        sharded = run_threaded(2, _auto_install, ref)[0]
    assert not [str(w.message) for w in caught if "matches no module" in str(w.message)]
    assert sharded > 0


def _governed(plan: Any, model: nn.Module) -> dict[str, Any]:
    """``{module or parameter name: plan value}`` as ``parallelize`` would apply ``plan`` to ``model``."""
    resolved = resolve_model_plan(plan, model)
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the respelled dense-MLP keys of Qwen3-MoE: user keys naming nothing
        return {name: resolved[key] for name, key in match_plan(resolved, names).items()}


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_prefix_is_one_rule_per_key_for_every_model(model_type: str) -> None:
    """The shipped plan respelled without ``model.`` governs the same modules, though ``lm_head`` (top level)
    matches as written: each key is put under the prefix on its own, for Llama and Qwen3-MoE alike."""
    ref = _table_model(model_type)
    shipped = model_tp_plan(ref)
    respelled = {k.removeprefix("model."): v for k, v in shipped.items()}
    assert "lm_head" in respelled and "layers.*.self_attn.q_proj" in respelled
    want = _governed(shipped, ref)
    assert any(".self_attn.q_proj" in name for name in want)
    assert _governed(respelled, ref) == want


def test_auto_on_a_model_without_a_plan_names_the_model() -> None:
    with pytest.raises(TPLowerError, match="plan='auto': Linear has no tp_plan"):
        model_tp_plan(nn.Linear(2, 2))
    with pytest.raises(TPLowerError, match=r"plan='auto': Linear has no tp_plan.* use plan='derive'"):
        resolve_model_plan("Auto", nn.Linear(2, 2))


def test_plan_names_are_read_in_any_case_and_never_as_files() -> None:
    """``"Auto"`` is transformers' own plan of the model (``tp_plan``: every key names a module of Llama), not a
    file of that name; ``load_plan`` says a plan name is no file."""
    ref = _tiny("llama")
    for name in ("auto", "Auto", "AUTO"):
        assert resolve_model_plan(name, ref) == dict(ref.tp_plan), name
    with pytest.raises(TPLowerError, match=r"load_plan: 'Derive' is the plan name 'derive'.*not a file"):
        load_plan("Derive")


class _Emb(nn.Module):
    """A scaled embedding (as Gemma's): the module's own forward must still run."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 6, padding_idx=7)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids) * 1.5


@pytest.mark.parametrize("world", [2, 4])
def test_vocabulary_parallel_embedding_with_padding_row(world: int) -> None:
    torch.manual_seed(1)
    ref = _Emb()
    ids = {"ids": torch.tensor([[0, 7, 11, 5, 6, 7], [3, 3, 9, 1, 7, 2]])}  # every rank's rows and the padding row
    diffs = run_threaded(world, _compare, ref, {"emb": "embedding_rowwise"}, ids)[0]
    assert max(diffs.values()) < 1e-6, diffs
    assert ref.emb.weight.grad is not None and ref.emb.weight.grad[7].abs().max() == 0  # the padding row: no grad


class _PackedMLP(nn.Module):
    """A fused gate/up projection (Phi-3's gate_up_proj) then a row-parallel down projection."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up, self.down = nn.Linear(8, 2 * 12), nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


def _packed_layout(rank: int, world: int, ref: nn.Module) -> bool:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = parallelize(copy.deepcopy(ref), mesh, {"gate_up": "packed_colwise", "down": "rowwise"})
    w = model.gate_up.weight
    assert isinstance(w, DTensor) and w.placements == (_StridedShard(0, split_factor=2),)
    gate, up = ref.gate_up.weight.detach().chunk(2, 0)  # each rank holds its piece of the gate and of the up part
    want = torch.cat([gate.chunk(world, 0)[rank], up.chunk(world, 0)[rank]])
    return torch.equal(w.to_local(), want) and torch.equal(w.full_tensor(), ref.gate_up.weight.detach())


def test_packed_colwise_shards_each_part_and_matches_one_process() -> None:
    torch.manual_seed(2)
    ref = _PackedMLP()
    x = {"x": torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(5))}
    diffs = run_threaded(2, _compare, ref, {"gate_up": "packed_colwise", "down": "rowwise"}, x)[0]
    assert max(diffs.values()) < 1e-5, diffs
    assert all(run_threaded(2, _packed_layout, ref))


class _HeadScaled(nn.Module):
    """Attention-like: a per-head parameter (as attention sinks) used on this rank's heads only."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        heads = q.view(*q.shape[:-1], -1, 2) * self.scale[:, None]  # local heads: scale is local too
        return self.o(heads.flatten(-2))


def test_parameter_keys_place_a_parameter_inside_local_params() -> None:
    torch.manual_seed(3)
    ref = _HeadScaled()
    plan = {"": "local_params", "scale": "colwise", "q": "colwise", "o": "rowwise"}
    x = {"x": torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(6))}
    diffs = run_threaded(2, _compare, ref, plan, x)[0]
    assert max(diffs.values()) < 1e-5, diffs


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Linear(4, 4)
        self.kv_a_proj = nn.Linear(4, 4)


def _refusals(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    msgs = []
    for plan in ({"experts": "grouped_gemm"}, {"experts": "packed_rowwise"}):
        with pytest.raises(TPLowerError) as exc:
            parallelize(_Experts(), mesh, plan)
        msgs.append(str(exc.value))
    return msgs


def test_moe_styles_not_lowered_are_refused_naming_style_and_module() -> None:
    msgs = run_threaded(2, _refusals)[0]
    assert "'experts'" in msgs[0] and "'grouped_gemm'" in msgs[0] and "its own key" in msgs[0]
    assert "'packed_rowwise'" in msgs[1] and "its own key" in msgs[1]  # a style for a parameter key only


class _LatentAttention(nn.Module):
    """Multi-head latent attention in small: kv_a_proj's rotary tail meets this rank's query heads directly."""

    config = types.SimpleNamespace(qk_rope_head_dim=2)

    def __init__(self) -> None:
        super().__init__()
        self.kv_a_proj = nn.Linear(8, 6 + 2)
        self.kv_b_proj, self.q_proj, self.o_proj = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k_pass, k_rope = self.kv_a_proj(x).split([6, 2], dim=-1)
        k = self.kv_b_proj(k_pass).view(*x.shape[:-1], -1, 2)  # this rank's heads of 2 dims
        q = self.q_proj(x).view(*x.shape[:-1], -1, 2)
        return self.o_proj((q * (k + k_rope[..., None, :])).flatten(-2))


_MLA = {"kv_b_proj": "colwise", "q_proj": "colwise", "o_proj": "rowwise"}


def test_mla_kv_a_proj_reduces_the_gradient_of_the_rotary_tail() -> None:
    torch.manual_seed(5)
    ref = _LatentAttention()
    x = {"x": torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(9))}
    diffs = run_threaded(2, _compare, ref, {**_MLA, "kv_a_proj": "mla_kv_a_proj"}, x)[0]
    assert max(diffs.values()) < 1e-5, diffs
    ref.zero_grad()
    # the same plan without it would give kv_a_proj a wrong gradient (its rotary tail meets sharded heads): the
    # first forward refuses it before any backward, naming the parameter
    with pytest.raises(RankFailure, match=r"(?s)uncovered.*'weight' of module 'kv_a_proj'"):
        run_threaded(2, _compare, ref, _MLA, x)


class _ScaledHead(nn.Linear):
    """An lm_head with a per-output parameter of its own (as Dory's): colwise shards it with the weight rows."""

    def __init__(self) -> None:
        super().__init__(8, 6, bias=False)
        self.logit_scale = nn.Parameter(torch.rand(6, generator=torch.Generator().manual_seed(7)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.logit_scale


def test_colwise_shards_a_module_s_other_parameters_with_its_rows() -> None:
    torch.manual_seed(4)
    ref = nn.Sequential(_ScaledHead())
    x = {"input": torch.randn(2, 8, generator=torch.Generator().manual_seed(8))}
    diffs = run_threaded(2, _compare, ref, {"0": "colwise_gather_output"}, x)[0]
    assert max(diffs.values()) < 1e-6, diffs


def test_unit_colwise_keys_and_values_match_one_process_and_refuse_heads_that_do_not_divide() -> None:
    """transformers 5.25's ``unit_colwise`` (whole heads per rank, on k_proj/v_proj): plain colwise where the head
    counts divide over tp; where they do not (transformers would replicate heads), the head-count rule refuses."""
    ref = _tiny("llama")
    plan = {k: ("unit_colwise" if k.endswith(("k_proj", "v_proj")) else v) for k, v in model_tp_plan(ref).items()}
    assert sum(v == "unit_colwise" for v in plan.values()) == 2
    ids = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(4))}
    diffs = run_threaded(2, _compare, ref, plan, ids, lambda o: o.logits)[0]
    assert max(diffs.values()) < 1e-5, {k: v for k, v in diffs.items() if v >= 1e-5}
    ref.config.num_key_value_heads = 1  # the modules keep 2 heads' width; the rule reads the config first
    with pytest.raises(RankFailure, match="num_key_value_heads=1 does not divide over 2"):
        run_threaded(2, _compare, ref, plan, ids, lambda o: o.logits)
