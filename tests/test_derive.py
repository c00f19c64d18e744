"""``"derive"``: a plan from the module structure, explained per rule, equal to one process at tp=2.

MiniLM's derived plan is the shipped hand-written one (so it moves the same bytes per step); the
families without a shipped plan run in one spawn of 2 gloo ranks (CI: T5's encoder, split attention with
head counts divided and a per-head relative bias; more with TPLOWER_SLOW=1), output and every gradient against
one process, and grouped-query attention (llama-tiny, Qwen2, Mistral: key/value heads split as the query heads
they serve) likewise; the full list runs with ``python -m tplower.run.derive_table``. GPT-2's ``Conv1D`` projections
(weight ``[in, out]``, query/key/value packed in ``c_attn``) and BLOOM's alibi (built for all heads outside the
attention module) run in CI too.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from tplower import TPLowerError
from tplower.cli.main import main as cli_main
from tplower.families.alibi import local_alibi
from tplower.families.conv1d import conv1d_forward, is_conv1d
from tplower.plans.derive import derive_plan
from tplower.run.derive_table import run_derived, tiny_family
from tplower.run.hf_table import TOL
from tplower.run.models import LLAMA_TINY, MINILM, MINILM_TP_PLAN, skeleton


def test_minilm_derived_plan_is_the_hand_written_one() -> None:
    derived = derive_plan(skeleton(MINILM))
    assert derived.plan == MINILM_TP_PLAN
    rules = {r.key: r.rule for r in derived.rules}
    assert rules["encoder.layer.*.attention.self.query"] == "attention"
    assert rules["encoder.layer.*.output.dense"] == "mlp"
    assert rules["embeddings.word_embeddings"] == "embeddings"  # left whole, and said so
    assert "num_attention_heads" in derived.explain()


def test_a_model_without_known_projections_is_refused() -> None:
    with pytest.raises(TPLowerError, match=r"no rule shards a module of Sequential.*no rule matched a module"):
        derive_plan(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


def test_tplower_plan_writes_yaml(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "plan.yaml"
    assert cli_main(["plan", "--model", MINILM, "-o", str(out)]) == 0
    import yaml

    assert yaml.safe_load(out.read_text()) == MINILM_TP_PLAN
    assert "attention output projection: rowwise" in capsys.readouterr().err


@pytest.mark.parametrize("families", [pytest.param(["t5_encoder", "gpt2", "bloom"], id="ci"),
                                      pytest.param(["bert", "roberta", "electra", "distilbert", "opt", "gpt_neox",
                                                    "vit", "whisper_encoder"],
                                                   id="more", marks=pytest.mark.slow)])
def test_derived_families_match_one_process_at_tp2(families: list[str]) -> None:
    rows = {r.family: r for r in run_derived(families)}
    for family, row in rows.items():
        assert row.outcome.status == "pass", (family, row.outcome)
        assert row.outcome.grad_diff is not None and row.outcome.grad_diff <= TOL
        assert row.sharded >= 4, family  # the plan shards attention and MLP, not nothing


def test_gpt2_conv1d_projections_are_derived_with_qkv_packed() -> None:
    derived = derive_plan(tiny_family("gpt2")[0])
    assert derived.plan == {
        "h.*.attn": {"local_attrs": {"num_heads": "divide", "split_size": "divide"}},
        "h.*.attn.c_attn": {"style": "conv1d_colwise", "packed": {"weight": 3, "bias": 3}},
        "h.*.attn.c_proj": "conv1d_rowwise",
        "h.*.mlp.c_fc": "conv1d_colwise",
        "h.*.mlp.c_proj": "conv1d_rowwise",
    }
    assert {r.key: r.rule for r in derived.rules}["h.*.attn.c_attn"] == "fused_conv1d"


def test_bloom_attention_slices_alibi() -> None:
    plan = derive_plan(tiny_family("bloom")[0]).plan
    assert plan["h.*.self_attention"] == {"local_attrs": {"num_heads": "divide", "split_size": "divide"},
                                          "local_compute": "tplower.families.alibi:alibi_heads_forward"}
    assert plan["h.*.self_attention.query_key_value"] == "colwise"


def test_conv1d_forward_is_conv1d_on_local_parameters() -> None:
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(6, 4)
    nn.init.normal_(conv.bias)
    x = torch.randn(2, 3, 4)
    assert is_conv1d(conv) and not is_conv1d(nn.Linear(4, 6))
    torch.testing.assert_close(conv1d_forward(conv, x), conv(x))
    conv.bias = None  # a bias deferred until after the output reduction
    torch.testing.assert_close(conv1d_forward(conv, x), x @ conv.weight)


def test_local_alibi_is_each_ranks_heads() -> None:
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    batch, heads, seq = 2, 4, 5
    alibi = build_alibi_tensor(torch.ones(batch, seq, dtype=torch.long), heads, torch.float32)  # [b*h, 1, seq]
    for index, mine in ((0, (0, 1)), (1, (2, 3))):
        want = torch.stack([alibi[b * heads + h] for b in range(batch) for h in mine])
        torch.testing.assert_close(local_alibi(alibi, batch, 2, index), want)
    with pytest.raises(TPLowerError, match="not \\[batch \\* heads"):
        local_alibi(alibi[:7], batch, 2, 1)


def test_explain_reads_conv1d_styles_as_conv1d(capsys) -> None:  # type: ignore[no-untyped-def]
    assert cli_main(["explain", "--plan", "derive", "--model", "gpt2"]) == 0
    out = capsys.readouterr().out
    # resolved on the model, module by module
    fc = out[out.index("h.0.mlp.c_fc: region, lowered"):]
    assert fc.splitlines()[2:4] == ["  param weight: tp S(1)", "  param bias: tp S(0)"]  # weight [in, out]
    proj = out[out.index("h.0.mlp.c_proj: region, lowered"):]
    assert "  param weight: tp S(0)" in proj.splitlines()[1:4]


def test_a_linear_style_on_a_conv1d_names_the_conv1d_style() -> None:
    from tplower.plans.entries import resolve_entry

    with pytest.raises(TPLowerError, match=r"plan\['h.0.mlp.c_fc'\]: style 'colwise'.*takes conv1d_colwise"):
        resolve_entry("colwise", "h.0.mlp.c_fc", kind="other")
    with pytest.raises(TPLowerError, match="takes conv1d_rowwise"):
        resolve_entry("rowwise", "h.0.mlp.c_proj", kind="other")
    entry = resolve_entry({"style": "conv1d_colwise", "packed": {"weight": 3, "bias": 3}}, "c_attn", kind="other")
    assert entry.params == {"weight": {"tp": Shard(1)}, "bias": {"tp": Shard(0)}}
    assert entry.packed == {"weight": 3, "bias": 3}
    assert entry.local_compute == "tplower.families.conv1d:conv1d_forward"
    row = resolve_entry("conv1d_rowwise", "c_proj", kind="other")
    assert row.params == {"weight": {"tp": Shard(0)}, "bias": {"tp": Replicate()}} and row.deferred_bias == "bias"


def _derived_against_one_process(rank: int, world: int, names: list[str]) -> dict[str, tuple[Any, list[str]]]:
    """Each model parallelized by ``"derive"`` at tp=``world``: its outcome against one process (logits and every
    gradient) and the parameters the plan shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from tplower.nn.parallelize import parallelize
    from tplower.run.hf_table import architectures, compare_training, input_ids, tiny_model
    from tplower.run.models import LLAMA_TINY, load_model
    from tplower.run.quiet import quiet_transformers

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    with quiet_transformers():
        for name in names:
            ref = load_model(LLAMA_TINY)[0] if name == LLAMA_TINY else tiny_model(architectures([name])[0])
            tp = parallelize(copy.deepcopy(ref), mesh, "derive")
            sharded = [n for n, p in tp.named_parameters()
                       if isinstance(p, DTensor) and any(isinstance(q, Shard) for q in p.placements)]
            out[name] = (compare_training(tp, ref, input_ids()), sharded)
    return out


def test_derived_grouped_query_attention_splits_qkvo_and_matches_one_process() -> None:
    """llama-tiny (8 query heads sharing 4 key/value heads) and tiny Qwen2 (4 sharing 2, q/k/v with biases) at tp=2
    on gloo; ``TPLOWER_SLOW=1`` adds tiny Mistral (4 sharing 2 again, Llama's attention: a duplicate of the two)."""
    from tplower.testing import run_processes

    names = [LLAMA_TINY, "qwen2", *(["mistral"] if os.environ.get("TPLOWER_SLOW") == "1" else [])]
    results = run_processes(2, _derived_against_one_process, names, timeout=300)
    for name in names:
        for rank in results:
            outcome, sharded = rank[name]
            assert outcome.status == "pass", (name, outcome)
            assert outcome.grad_diff is not None and outcome.grad_diff <= TOL
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                assert f"model.layers.1.self_attn.{proj}.weight" in sharded, (name, proj)


def test_attention_whose_heads_do_not_divide_is_left_whole_and_said() -> None:
    model = skeleton(LLAMA_TINY)  # 8 query heads, 4 key/value heads
    four = derive_plan(model, tp=4)
    assert four.plan["model.layers.*.self_attn.k_proj"] == "colwise"
    eight = derive_plan(model, tp=8)  # 4 key/value heads do not divide over 8 ranks
    assert not any("self_attn" in key for key in eight.plan)
    assert eight.plan["model.layers.*.mlp.down_proj"] == "rowwise"
    why = {r.key: r.why for r in eight.rules}["model.layers.*.self_attn"]
    assert "num_key_value_heads=4 does not divide over tp=8" in why and why.endswith("left whole")
    with pytest.raises(ValueError, match="tp=0"):
        derive_plan(model, tp=0)


def test_every_module_left_whole_gets_a_line() -> None:
    for model in (skeleton(LLAMA_TINY), tiny_family("bert")[0]):
        derived = derive_plan(model)
        said = set(derived.plan) | {r.key for r in derived.rules}
        for qual, module in model.named_modules():
            if qual and next(module.parameters(recurse=False), None) is not None:
                key = ".".join("*" if p.isdigit() else p for p in qual.split("."))
                assert key in said or any(key.startswith(f"{k}.") for k in said), key
    rules = {r.key: r for r in derive_plan(skeleton(LLAMA_TINY)).rules}
    assert rules["model.norm"].rule == "whole" and "a norm" in rules["model.norm"].why


def _auto_and_derive_at(rank: int, world: int, ref: nn.Module) -> tuple[str, bool, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from tplower.nn.parallelize import parallelize

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with pytest.raises(TPLowerError) as refused:
        parallelize(copy.deepcopy(ref), mesh, "auto")
    tp = parallelize(copy.deepcopy(ref), mesh, "derive")
    q = tp.get_submodule("model.layers.0.self_attn.q_proj").weight
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        diff = float((tp(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max())
    return str(refused.value), isinstance(q, DTensor) and q.placements[0].is_replicate(), diff


def test_derive_leaves_whole_the_attention_auto_refuses_to_split() -> None:
    """4 query heads sharing 2 key/value heads at tp=4: one rule for every plan (each rank owns whole heads)."""
    from tplower.run.hf_table import architectures, tiny_model
    from tplower.testing import run_threaded

    ref = tiny_model(architectures(["llama"])[0])
    for message, replicated, diff in run_threaded(4, _auto_and_derive_at, ref):
        assert "num_key_value_heads=2 does not divide over 4" in message
        assert replicated and diff <= TOL


class _SinkAttention(nn.Module):
    """Attention with a per-head parameter of its own (as gpt-oss's sinks): its use cannot be told from a shape."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(8, 8) for _ in range(4))
        self.sinks = nn.Parameter(torch.zeros(4))


def test_attention_holding_other_weights_is_left_whole_and_said() -> None:
    """A sink, an output gate or a norm over the whole width may need every head: such attention is left whole
    (gpt-oss, OLMo-2, Laguna and others erred at the forward, split), and a layer that differs from the others
    under one glob gets an exact key."""
    with pytest.raises(TPLowerError, match=r"every match is left whole: self_attn: it holds weights besides its "
                                           r"projections \(sinks\)"):
        derive_plan(nn.ModuleDict({"self_attn": _SinkAttention()}))
    plain = _SinkAttention()
    del plain.sinks
    layers = nn.ModuleDict({"layers": nn.ModuleList([plain, _SinkAttention()])})
    plan = derive_plan(layers).plan
    assert plan["layers.*.q_proj"] == "colwise" and plan["layers.1.q_proj"] == {} and plan["layers.1.o_proj"] == {}
