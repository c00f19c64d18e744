"""``"derive"``: a plan from the module structure, explained per rule, equal to one process at tp=2.

MiniLM's derived plan is the shipped hand-written one (so it moves the same bytes per step); the
families without a shipped plan run in one spawn of 2 gloo ranks (CI: T5's encoder, split attention with
head counts divided and a per-head relative bias; more with TPLOWER_SLOW=1), output and every gradient against
one process; the full list runs with ``python -m tplower.run.derive_table``. GPT-2's ``Conv1D`` projections
(weight ``[in, out]``, query/key/value packed in ``c_attn``) and BLOOM's alibi (built for all heads outside the
attention module) run in CI too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tplower import TPLowerError
from tplower.cli.main import main as cli_main
from tplower.nn.alibi import local_alibi
from tplower.nn.conv1d import conv1d_forward, is_conv1d
from tplower.nn.derive import derive_plan
from tplower.run.derive_table import run_derived, tiny_family
from tplower.run.hf_table import TOL
from tplower.run.models import MINILM, MINILM_TP_PLAN, skeleton


def test_minilm_derived_plan_is_the_hand_written_one() -> None:
    derived = derive_plan(skeleton(MINILM))
    assert derived.plan == MINILM_TP_PLAN
    rules = {r.key: r.rule for r in derived.rules}
    assert rules["encoder.layer.*.attention.self.query"] == "attention"
    assert rules["encoder.layer.*.output.dense"] == "mlp"
    assert rules["embeddings.word_embeddings"] == "embeddings"  # left whole, and said so
    assert "num_attention_heads" in derived.explain()


def test_a_model_without_known_projections_is_refused() -> None:
    with pytest.raises(TPLowerError, match="no rule matched a module of Sequential"):
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
                                          "local_compute": "tplower.nn.alibi:alibi_heads_forward"}
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
    fc = out[out.index("h.*.mlp.c_fc: region"):]
    assert fc.splitlines()[2:4] == ["  param weight: tp S(1)", "  param bias: tp S(0)"]  # weight [in, out]
    proj = out[out.index("h.*.mlp.c_proj: region"):]
    assert "  param weight: tp S(0)" in proj.splitlines()[1:4]


def test_a_linear_style_on_a_conv1d_names_the_conv1d_style() -> None:
    from tplower.nn.plans import resolve_entry

    with pytest.raises(TPLowerError, match=r"plan\['h.0.mlp.c_fc'\]: style 'colwise'.*takes conv1d_colwise"):
        resolve_entry("colwise", "h.0.mlp.c_fc", kind="other")
    with pytest.raises(TPLowerError, match="takes conv1d_rowwise"):
        resolve_entry("rowwise", "h.0.mlp.c_proj", kind="other")
    entry = resolve_entry({"style": "conv1d_colwise", "packed": {"weight": 3, "bias": 3}}, "c_attn", kind="other")
    assert entry.params == {"weight": {"tp": "S(1)"}, "bias": {"tp": "S(0)"}} and entry.packed == {"weight": 3,
                                                                                                   "bias": 3}
    assert entry.local_compute == "tplower.nn.conv1d:conv1d_forward"
    row = resolve_entry("conv1d_rowwise", "c_proj", kind="other")
    assert row.params == {"weight": {"tp": "S(0)"}, "bias": {"tp": "R"}} and row.deferred_bias == "bias"
