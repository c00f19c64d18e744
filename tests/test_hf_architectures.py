"""Hugging Face decoders under ``parallelize(model, mesh, "auto")``: logits and every gradient equal one process
at tp=2 on gloo, replicated gradients equal across ranks.

The fast part runs a handful of representative architectures (tiny random
configs from :mod:`tplower.run.hf_table`) and checks that an MoE form tplower does
not lower yet is refused naming its style (MoE models that it lowers are checked,
gradients included, in ``test_moe_tp.py``). The full table, every causal-LM architecture whose
config defines ``base_model_tp_plan`` next to transformers' own TP on the
same weights and the derived plan (``"derive"``), runs with ``TPLOWER_HF_TABLE=1`` (a few minutes on 2 CPUs).
"""

from __future__ import annotations

import os

import pytest

from tplower import TPLowerError
from tplower.run.hf_table import (
    TOL,
    Arch,
    Outcome,
    Row,
    architectures,
    gaps,
    markdown,
    run_table,
    tiny_config,
)

# dense decoders of distinct families: plain, qk-norm, sliding window, gemma norms, fused qkv + gather/split,
# GPT-NeoX's fused qkv and vocab-parallel embedding, OLMo-2's gather/split styles, MiniCPM3's latent attention
# Apertus: a learnable activation parameter between colwise and rowwise layers (covered by tplower.nn.coverage)
FAST = ("llama", "qwen3", "mistral", "gemma3_text", "phi3", "gpt_neox", "olmo2", "minicpm3", "apertus")
MOE = "longcat_flash"  # tensor-parallel experts with identity (zero) experts among them
#: the context-parallel column in CI: grouped-query attention, alternating sliding layers, partial rotary, MoE
CP = ("llama", "gemma3_text", "gpt_neox", MOE)
FULL = os.environ.get("TPLOWER_HF_TABLE") == "1"


@pytest.fixture(scope="module")
def fast_rows() -> dict[str, Row]:
    """One spawn of 2 gloo ranks for every fast architecture (tplower only)."""
    return {r.arch.model_type: r for r in run_table([*FAST, MOE], with_hf=False, with_context=CP)}


@pytest.mark.parametrize("model_type", FAST)
def test_auto_plan_matches_one_process(fast_rows: dict[str, Row], model_type: str) -> None:
    outcome = fast_rows[model_type].tplower
    assert outcome.status == "pass", outcome
    assert outcome.max_diff is not None and outcome.max_diff <= TOL
    # every parameter's gradient and the replicated ones' agreement across ranks, not only the logits
    assert outcome.grad_diff is not None and outcome.grad_diff <= TOL


@pytest.mark.parametrize("model_type", CP)
def test_context_parallel_column_matches_one_process(fast_rows: dict[str, Row], model_type: str) -> None:
    # cp=2, Ulysses and all-gather: the loss, the logits and every gradient (summed over cp) as one process's
    outcome = fast_rows[model_type].context
    assert outcome.status == "pass", outcome
    assert outcome.max_diff is not None and outcome.max_diff <= TOL
    assert outcome.grad_diff is not None and outcome.grad_diff <= TOL


def test_moe_architecture_passes_in_the_table(fast_rows: dict[str, Row]) -> None:
    outcome = fast_rows[MOE].tplower
    assert outcome.status == "pass", outcome
    assert outcome.max_diff is not None and outcome.max_diff <= TOL


def test_architectures_are_the_causal_lms_with_a_plan() -> None:
    found = {a.model_type: a for a in architectures()}
    assert found["llama"].causal_lm == "LlamaForCausalLM"
    assert "gpt2" not in found  # a causal LM without base_model_tp_plan
    with pytest.raises(TPLowerError, match="gpt2"):
        architectures(["gpt2"])


@pytest.mark.parametrize("model_type", ["llama", "gpt_neox", "deepseek_v3", "gemma3n_text"])
def test_tiny_config_is_tiny_and_divides_over_two(model_type: str) -> None:
    config = tiny_config(model_type)
    assert config.hidden_size <= 64 and config.num_hidden_layers == 2
    kv_heads = getattr(config, "num_key_value_heads", config.num_attention_heads)  # GPT-NeoX has none
    assert config.num_attention_heads % 2 == 0 and kv_heads % 2 == 0
    assert config.vocab_size % 2 == 0


def test_markdown_and_gaps_on_known_rows() -> None:
    arch = Arch("x", "XConfig", "XForCausalLM")
    moe = Outcome("refused", detail="plan['m.experts']: style 'moe_tp_experts' has no faithful translation: MoE")
    rows = [Row(arch, Outcome("pass", 1e-7), Outcome("pass", 2e-7)),
            Row(arch, moe, Outcome("pass", 1e-7)),
            Row(arch, Outcome("fail", 1e-3, "max diff 1.0e-03 > 1e-05"), Outcome("pass", 1e-7)),
            Row(arch, Outcome("pass", 1e-7), Outcome("pass", 1e-7), Outcome("error", detail="RuntimeError: x"),
                Outcome("pass", 1e-7))]
    table = markdown(rows)
    assert "| `x` (XForCausalLM) | pass (1.0e-07) | pass (2.0e-07) | n/a | n/a |  |" in table
    assert Outcome("pass", 1e-7, grad_diff=3e-7).cell() == "pass (1.0e-07, grads 3.0e-07)"
    assert "`moe_tp_experts` on `m.experts`: MoE" in table
    assert "| error | pass (1.0e-07) | tplower EP: RuntimeError: x |" in table
    assert "tplower: 1 fail, 2 pass, 1 refused" in table and "tplower EP: 1 error" in table
    assert gaps(rows) == [rows[2], rows[3]]  # the second: transformers' EP passes where tplower's errs
    assert gaps(rows, allow_by_design=False) == rows[1:]
    broken = Outcome("error", detail="tiny model: ValueError: x")
    assert "tplower: 3 errors  " in markdown([Row(arch, broken, broken)] * 3).splitlines()


def test_markdown_derive_column_compares_bytes_with_the_shipped_plan() -> None:
    arch = Arch("x", "XConfig", "XForCausalLM")
    rows = [Row(arch, Outcome("pass", 1e-7, sent=400), Outcome("pass", 1e-7),
                derive=Outcome("pass", 2e-7, grad_diff=1e-7, sent=100)),
            Row(arch, Outcome("pass", 1e-7, sent=300), Outcome("pass", 1e-7), derive=Outcome("pass", 1e-7, sent=300)),
            Row(arch, Outcome("pass", 1e-7, sent=300), Outcome("pass", 1e-7),
                derive=Outcome("refused", detail="plan['m']: no"))]
    table = markdown(rows)
    assert "| tplower derive | note |" in table.splitlines()[0]
    assert "| pass (2.0e-07, grads 1.0e-07); 0.25x bytes |  |" in table
    assert "| refused | derive: plan['m']: no |" in table
    assert "tplower derive: 2 pass, 1 refused" in table
    assert "1 fewer, 1 the same, 0 more; 400 against 700 bytes in all (0.57x)" in table
    assert "tplower derive" not in markdown(rows[:0] + [Row(arch, Outcome("pass", 1e-7), Outcome("pass", 1e-7))])


@pytest.mark.skipif(not FULL, reason="the full architecture table runs with TPLOWER_HF_TABLE=1")
def test_full_table_tplower_passes_what_transformers_passes() -> None:
    pytest.importorskip("accelerate")  # transformers' own TP needs it
    rows = run_table(with_derive=True, with_context=True)
    assert rows, "no architecture found"
    missing = gaps(rows, allow_by_design=False)  # every architecture transformers passes, MoE included
    assert not missing, "\n".join(f"{r.arch.model_type}: {r.note()}" for r in missing)
    # the derived plan passes or refuses (naming why): never a wrong answer, never an error at the forward
    wrong = [r for r in rows if r.derive.status not in ("pass", "refused")]
    assert not wrong, "\n".join(f"{r.arch.model_type}: {r.derive}" for r in wrong)
    # context parallelism passes or refuses by layer type: never a wrong answer
    wrong = [r for r in rows if r.context.status not in ("pass", "refused")]
    assert not wrong, "\n".join(f"{r.arch.model_type}: {r.context}" for r in wrong)


def test_context_rows_count_what_their_row_does_not_expect_as_wrong() -> None:
    from tplower.run.hf_context_rows import ROWS, markdown, totals

    outcomes = {"gpt2": Outcome("pass", 1e-7, grad_diff=2e-8), "bart": Outcome("refused", detail="encoder-decoder"),
                "bert-mlm": Outcome("fail", 1e-2, "loss/output 1.0e-02"), "t5": Outcome("pass", 0.0)}
    assert ROWS["bart"].expect == "refused" and ROWS["gpt2"].expect == "pass"
    assert totals(outcomes) == {"pass": 1, "refused": 1, "wrong": 2}  # a fail, and a pass where a refusal is due
    table = markdown(outcomes)
    assert "| `bart` | encoder-decoder (cross-attention) | refused | encoder-decoder |" in table
    assert "4 rows: 1 match one process, 1 refused, 2 otherwise" in table


@pytest.mark.skipif(not FULL, reason="the context-parallel rows run with TPLOWER_HF_TABLE=1")
def test_context_rows_beyond_the_decoders_match_one_process_or_are_refused() -> None:
    from tplower.run.hf_context_rows import ROWS, run_rows

    outcomes = run_rows()
    # every rope type on Llama, encoders with masked-LM and token heads, GPT-2: one process's answer in both modes;
    # encoder-decoders, a CLS head, ALiBi and mask-numbered positions: refused naming the cause
    wrong = {name: o for name, o in outcomes.items() if o.status != ROWS[name].expect}
    assert not wrong, wrong
