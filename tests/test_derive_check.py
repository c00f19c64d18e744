"""A derived plan proves itself: ``verify_derived`` accepts GPT-2's derived plan and refuses planted bad ones.

The threaded process group runs 2 ranks in this process (models built outside the threads: they share the
global generator). A planted bad derived plan, GPT-2's fused ``c_attn`` split as one block instead of three
parts (each rank gets query and half the keys instead of its own heads of all three), installs and runs but
diverges: it is refused, naming the first module whose input is wrong, and the model is left untouched.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tplower import TPLowerError
from tplower.cli.main import main as cli_main
from tplower.plans.derive import DerivedPlan, derive_plan
from tplower.run.derive_table import tiny_family
from tplower.run.quiet import quiet_transformers
from tplower.testing import run_threaded
from tplower.verification.derived import DerivedPlanRefused, parallelize_verified, tiny_inputs, verify_derived


@pytest.fixture(scope="module")
def gpt2() -> nn.Module:
    with quiet_transformers():
        return tiny_family("gpt2")[0]


def _verify(rank: int, world: int, model: nn.Module, derived: DerivedPlan) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    try:
        _, report = verify_derived(model, mesh, derived=derived)
    except DerivedPlanRefused as exc:
        first = exc.report.first_divergence if exc.report is not None else None
        return {"ok": False, "message": str(exc), "module": None if first is None else first.module}
    return {"ok": True, "boundaries": len(report.boundaries),
            "grads": sum(c.phase == "param_grad" for c in report.checks)}


def test_gpt2_derived_plan_verifies(gpt2: nn.Module) -> None:
    out = run_threaded(2, _verify, gpt2, derive_plan(gpt2))
    assert out[0] == out[1] == {"ok": True, "boundaries": 8, "grads": len(list(gpt2.parameters()))}


def test_a_planted_unpacked_qkv_split_is_refused(gpt2: nn.Module) -> None:
    bad = derive_plan(gpt2)
    bad.plan["h.*.attn.c_attn"] = "conv1d_colwise"  # one block, not query, key and value each split
    out = run_threaded(2, _verify, gpt2, bad)
    assert out[0]["ok"] is False and out[0]["module"] == "h.0.attn.c_proj"
    assert "does not match one process at 2 ranks" in out[0]["message"]
    assert not any(isinstance(p, DTensor) for p in gpt2.parameters())  # verify ran on copies


def test_a_planted_plan_that_does_not_run_is_refused(gpt2: nn.Module) -> None:
    bad = derive_plan(gpt2)
    del bad.plan["h.*.attn"]  # head counts and split_size left whole: c_attn's local output does not split in 3
    out = run_threaded(2, _verify, gpt2, bad)
    assert out[0]["ok"] is False and out[0]["module"] is None
    assert "does not run on it" in out[0]["message"]


def _parallelized(rank: int, world: int, model: nn.Module, ids: torch.Tensor) -> float:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize_verified(model, mesh)
    with torch.no_grad():
        return float(model(input_ids=ids).last_hidden_state.sum())


def test_parallelize_verified_installs_the_plan(gpt2: nn.Module) -> None:
    import copy

    ids = tiny_inputs(gpt2, seed=3)["input_ids"]
    with torch.no_grad():
        want = float(gpt2(input_ids=ids).last_hidden_state.sum())
    models = [copy.deepcopy(gpt2), copy.deepcopy(gpt2)]
    got = run_threaded(2, lambda r, w: _parallelized(r, w, models[r], ids))
    assert got[0] == pytest.approx(want, rel=1e-5, abs=1e-4) and got[1] == got[0]
    assert isinstance(models[0].h[0].attn.c_attn.weight, DTensor)


def test_tiny_inputs_are_of_the_models_kind() -> None:
    with quiet_transformers():
        vit, whisper, t5 = (tiny_family(f)[0] for f in ("vit", "whisper_encoder", "t5_encoder"))
    assert tiny_inputs(vit)["pixel_values"].shape == (2, 3, 8, 8)
    assert tiny_inputs(whisper)["input_features"].shape == (2, 8, 16)  # Whisper wants 2 * max_source_positions
    ids = tiny_inputs(t5)["input_ids"]
    assert ids.shape == (2, 8) and int(ids.max()) < t5.config.vocab_size
    torch.testing.assert_close(ids, tiny_inputs(t5)["input_ids"])  # seeded: every rank draws the same
    assert tiny_inputs(nn.Sequential(nn.Linear(5, 3)))["input"].shape == (2, 8, 5)
    with pytest.raises(TPLowerError, match="cannot tell which input ReLU takes"):
        tiny_inputs(nn.ReLU())


def test_a_meta_model_is_refused_before_verifying() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(TPLowerError, match="on the meta device"):
        verify_derived(model, None, derived=DerivedPlan({"0": "colwise"}))  # type: ignore[arg-type]


def test_tplower_plan_verify_refusal_writes_nothing(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    import tplower.cli.plan as plan_cli

    monkeypatch.setattr(plan_cli, "verify_in_processes", lambda *a, **k: (False, "DIVERGES first at 'x'"))
    out = tmp_path / "plan.yaml"
    assert cli_main(["plan", "--model", "gpt2", "--verify", "-o", str(out)]) == 1
    assert not out.exists()
    assert "refused: the derived plan does not verify" in capsys.readouterr().err


@pytest.mark.slow
def test_tplower_plan_verify_on_gloo_ranks(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "plan.yaml"
    assert cli_main(["plan", "--model", "bloom", "--verify", "-o", str(out)]) == 0
    assert out.exists() and "parameter gradients match one process" in capsys.readouterr().err
