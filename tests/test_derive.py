"""``"derive"``: a plan from the module structure, explained per rule, equal to one process at tp=2.

MiniLM's derived plan is the shipped hand-written one (so it moves the same bytes per step); the
families without a shipped plan run in one spawn of 2 gloo ranks (CI: T5's encoder, split attention with
head counts divided and a per-head relative bias; more with TPLOWER_SLOW=1), output and every gradient against
one process; the full list runs with ``python -m tplower.run.derive_table``.
"""

from __future__ import annotations

import pytest
from torch import nn

from tplower import TPLowerError
from tplower.cli.main import main as cli_main
from tplower.nn.derive import derive_plan
from tplower.run.derive_table import run_derived
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


@pytest.mark.parametrize("families", [pytest.param(["t5_encoder"], id="ci"),
                                      pytest.param(["bert", "distilbert", "opt", "gpt_neox", "vit", "whisper_encoder"],
                                                   id="more", marks=pytest.mark.slow)])
def test_derived_families_match_one_process_at_tp2(families: list[str]) -> None:
    rows = {r.family: r for r in run_derived(families)}
    for family, row in rows.items():
        assert row.outcome.status == "pass", (family, row.outcome)
        assert row.outcome.grad_diff is not None and row.outcome.grad_diff <= TOL
        assert row.sharded >= 4, family  # the plan shards attention and MLP, not nothing
