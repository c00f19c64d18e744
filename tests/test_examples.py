"""Every file under ``examples/`` is exercised: plans explained and checked on the model they are written for,
Python examples launched as their docstrings say (torchrun, 2 processes).

:data:`EXERCISED` names, for each example file, the tests that run it; a file
added without a test fails :func:`test_every_example_file_is_exercised`.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tplower.cli import main
from tplower.plans.entries import load_plan

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SUCCESS = "OK: tplower matches one process and DTensor, forward and backward, on every rank"

#: example file -> the tests (module::function) that exercise it
EXERCISED: dict[str, tuple[str, ...]] = {
    "plans/bert_tp.yaml": ("test_examples::test_plan_files_explain",
                           "test_examples::test_bert_plan_is_the_minilm_plan_the_default_run_checks",
                           "test_parallelize::test_transformers_models_threaded_world2"),
    "plans/block_sp.yaml": ("test_examples::test_plan_files_explain", "test_parallelize::test_parity_threaded_world4"),
    "plans/llama_tp.yaml": ("test_examples::test_plan_files_explain",
                            "test_examples::test_llama_plan_is_transformers_own_for_llama_tiny",
                            "test_examples::test_llama_plan_file_runs_with_llama_tiny"),
    "train.py": ("test_examples_train::test_train_example_runs_under_torchrun_and_leaves_a_trained_checkpoint",
                 "test_examples_train::test_train_example_says_clipped_only_when_the_norm_was_over_the_max"),
    "redistribute.py": ("test_examples::test_redistribute_example_runs_under_torchrun",),
    "load_pretrained.py": ("test_examples::test_load_pretrained_example_reads_slices_and_saves_whole",),
    "gathered.py": ("test_docs_examples::test_gathered_example_plans_verify_as_the_pages_say",
                    "test_docs_examples::test_output_block_is_what_the_command_prints"),
    "plans/gathered.json": ("test_docs_examples::test_gathered_example_plans_verify_as_the_pages_say",),
    "plans/gathered_wrong.json": ("test_docs_examples::test_gathered_example_plans_verify_as_the_pages_say",
                                  "test_docs_examples::test_output_block_is_what_the_command_prints"),
}


def test_every_example_file_is_exercised() -> None:
    files = {p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*") if p.is_file()
             and "__pycache__" not in p.parts}
    assert files == set(EXERCISED), f"examples without a test: {sorted(files - set(EXERCISED))}"
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        for tests in EXERCISED.values():
            for test in tests:
                module, name = test.split("::")
                assert hasattr(importlib.import_module(module), name), f"{test} does not exist"
    finally:
        sys.path.remove(str(Path(__file__).parent))


# per plan file: (the form of each key on tp=2, the number of all_reduce boundaries), written from the plan:
# colwise Linear: identity forward, all_reduce of the input gradient; rowwise: all_reduce of the output
EXPLAINED = {
    "bert_tp.yaml": ({"encoder.layer.*.attention.self": "identity",
                      **{f"encoder.layer.*.{k}": "tp_collective" for k in (
                          "attention.self.query", "attention.self.key", "attention.self.value",
                          "attention.output.dense", "intermediate.dense", "output.dense")}}, 6),
    "llama_tp.yaml": ({f"model.layers.*.{k}": "tp_collective" for k in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")}, 7),
    # sequence parallel: q/k/v gather the sequence once at attn; mlp.up gathers, attn.o and mlp.down reduce-scatter
    "block_sp.yaml": ({"ln*": "identity", "attn": "tp_collective", "attn.*": "identity", "attn.o": "tp_collective",
                       "mlp.up": "tp_collective", "mlp.down": "tp_collective"}, 0),
}


@pytest.mark.parametrize("name", sorted(EXPLAINED))
def test_plan_files_explain(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--plan", str(EXAMPLES / "plans" / name), "--mesh", "tp=2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    forms = dict(ln.split(": ", 1) for ln in lines if not ln.startswith(" "))
    want, all_reduces = EXPLAINED[name]
    assert forms == want
    assert sum("all_reduce(op=sum)" in ln for ln in lines) == all_reduces


def test_llama_plan_is_transformers_own_for_llama_tiny() -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from tplower.run import RunConfig, check_config
    from tplower.run.models import LLAMA_TINY, check_plan_modules, skeleton

    plan = load_plan(EXAMPLES / "plans" / "llama_tp.yaml")
    # transformers' own plan for LlamaModel, each key under LlamaForCausalLM's "model." attribute
    assert plan == {f"model.{k}": v for k, v in (LlamaConfig.base_model_tp_plan or {}).items()}
    matched = check_plan_modules(skeleton(LLAMA_TINY), plan)
    assert all(len(names) == 2 for names in matched.values())  # llama-tiny has 2 layers
    check_config(RunConfig(model=LLAMA_TINY, plan=plan))  # what `tplower run --plan` checks before it starts


@pytest.mark.slow  # the same decoder-layer entries run under plan='auto' in test_run's llama test
def test_llama_plan_file_runs_with_llama_tiny(tmp_path: Path) -> None:
    """The command of the field report, which exited 2 ("names no module of LlamaForCausalLM"), on 8 sentences."""
    pytest.importorskip("transformers")
    from tplower.run.models import LLAMA_TINY, load_model, sentences
    from tplower.run.tasks import make_batch, training_loss

    texts, report = tmp_path / "in.txt", tmp_path / "report.json"
    texts.write_text("\n".join(sentences()[:8]) + "\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "tplower.cli", "run", "--model", LLAMA_TINY, "--plan",
           str(EXAMPLES / "plans" / "llama_tp.yaml"), "--steps", "1", "--repeat", "1", "--batch-size", "8",
           "--input", str(texts), "--no-progress", "--json", str(report)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env | {"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS: tplower matches one process within 1e-05" in p.stdout
    info = json.loads(report.read_text())
    assert info["plan"] == load_plan(EXAMPLES / "plans" / "llama_tp.yaml")
    # 2 layers x (q, k, v, gate, up inputs; o, down outputs), every one lowered by tplower
    assert len(info["boundaries"]) == 14 and {b["form"] for b in info["boundaries"]} == {"tp_collective"}
    model, _ = load_model(LLAMA_TINY)  # the one-process loss, recomputed here
    with torch.no_grad():
        loss = training_loss("causal_lm", model, make_batch(LLAMA_TINY, None, sentences()[:8]))
    assert info["losses"]["reference"][0] == pytest.approx(float(loss), abs=1e-5)


def test_bert_plan_is_the_minilm_plan_the_default_run_checks() -> None:
    pytest.importorskip("transformers")
    from tplower.run import RunConfig, check_config
    from tplower.run.models import MINILM, MINILM_TP_PLAN

    plan = load_plan(EXAMPLES / "plans" / "bert_tp.yaml")
    assert plan == MINILM_TP_PLAN  # the plan test_run's default run checks against one process
    check_config(RunConfig(model=MINILM, plan=plan))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_redistribute_example_runs_under_torchrun() -> None:
    root = tempfile.mkdtemp(prefix="tplower-test-redistribute-")
    try:
        # TMPDIR: torchrun's agent leaves its torchelastic_* log dir there; it goes with the rest
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": root}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), "examples/redistribute.py"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output  # no exit-time abort either (tplower.core.support.teardown)
        assert proc.stdout.count(SUCCESS) == 1, output  # rank 0 prints it after every check passed on every rank
        # the plans it prints: one collective each way, by name (the table in the README)
        assert "forward [S(0)->R on axis 0: all_gather(dim=0)], backward [R->S(0) on axis 0: chunk(dim=0)]" in output
        assert "forward [P(sum)->S(0) on axis 0: reduce_scatter(dim=0, op=sum)]" in output
        assert "backward [S(1)->S(0) on axis 0: all_to_all(dim=1->0)]" in output
        assert "Traceback" not in output and "does not support alltoall" not in output
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow  # tests/test_hf_workflow.py checks the same loading and saving in-process
def test_load_pretrained_example_reads_slices_and_saves_whole() -> None:
    from transformers import AutoModelForCausalLM

    root = tempfile.mkdtemp(prefix="tplower-test-load-pretrained-")
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": root}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), "examples/load_pretrained.py", "--save", f"{root}/out"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output
        assert "OK: loaded from safetensors, each rank its slices; logits and one step equal one process" in output
        reads = [line for line in proc.stdout.splitlines() if "(its shards)" in line]
        assert len(reads) == 2, output
        saved = AutoModelForCausalLM.from_pretrained(f"{root}/out")  # whole weights, one process
        assert saved.config.vocab_size == 256 and tuple(saved.model.embed_tokens.weight.shape) == (256, 64)
        assert torch.equal(saved.lm_head.weight, saved.model.embed_tokens.weight)  # tied, written once
    finally:
        shutil.rmtree(root, ignore_errors=True)
