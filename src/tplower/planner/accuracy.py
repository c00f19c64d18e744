"""The ``plan`` phase of ``tplower bench``: the planner's predicted step times against real runs, on this machine
(here, beside the planner, so ``tplower.bench`` only calls it).

This machine is calibrated first (:func:`tplower.planner.calibrate.calibrate`, 2 gloo ranks), then
:func:`tplower.plan_layout` ranks every 2-rank layout of a small Llama (:data:`CONFIG`, :data:`SEQ` tokens a row,
float32) with that profile, and each layout then trains for real on 2 gloo ranks, placed as the planner places it
(:func:`tplower.planner.trace.place`), each step its micro-steps and one optimizer step, timed in rounds (one step
of every layout a round, in turn; the median of ``steps`` rounds after two of warm-up). The report gives both
times per layout, the Spearman rank correlation of predicted against measured, and how far the predicted best is
from the measured fastest. Timings only: no test asserts them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["CONFIG", "SEQ", "plan_phase", "plan_table", "spearman"]

#: the small Llama the phase plans (transformers ``LlamaConfig`` keywords)
CONFIG: dict[str, Any] = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                          "num_attention_heads": 8, "num_key_value_heads": 4}
SEQ, GLOBAL_BATCH, LOSS_CHUNK = 512, 2, 128


def _config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIG)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equal-length sequences (ties take their average rank); ``nan`` for
    fewer than 2 values or a constant sequence."""
    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    if len(a) != len(b) or len(a) < 2:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else float("nan")


def _time_rank(rank: int, world: int, rows: list[dict[str, Any]], steps: int) -> list[float] | None:
    """Each layout's median step on this rank: every layout placed first, then timed in rounds, one step of each
    per round, in turn (the machine's load falls on all of them alike)."""
    from transformers import AutoModelForCausalLM

    from .trace import _batch, _optimizer, build_mesh, place

    torch.set_num_threads(1)
    runs: list[Callable[..., None]] = []
    for row in rows:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(), dtype=torch.float32)
        model.train()
        placed = place(model, build_mesh(row["mesh"]), context_mode=row["context_mode"], loss_chunk=row["loss_chunk"],
                       checkpointing=row["checkpointing"])
        opt = _optimizer(model, "adamw", None)
        batch = _batch(CONFIG["vocab_size"], row["micro_batch"], SEQ)
        if placed is not None and placed.split is not None:
            batch = placed.split.cut(batch)

        def step(model: Any = model, opt: Any = opt, batch: Any = batch, n: int = row["accumulation"]) -> None:
            for _ in range(n):
                model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append(step)
    times: list[list[float]] = [[] for _ in runs]
    for i in range(steps + 2):
        for k, step in enumerate(runs):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            step()
            torch.distributed.barrier()
            if i >= 2:
                times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times] if rank == 0 else None


def plan_phase(steps: int = 5, *, timeout: float = 900.0,
               progress: Callable[[str], None] = lambda _: None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Calibrate, plan, run every layout for real (see the module docstring).

    Returns:
        ``(rows, summary)``: a row per traced layout (the planner's row as :meth:`LayoutCandidate.as_dict`,
        plus ``measured_step_s``), and ``{"spearman", "best_over_fastest", "profile"}``.
    """
    from ..testing import run_processes
    from .calibrate import calibrate
    from .search import plan_layout

    progress("plan: calibrating this machine (2 gloo ranks)")
    profile = calibrate(2, timeout=timeout)
    progress("plan: tracing every 2-rank layout")
    planned = plan_layout(_config(), 2, memory_per_rank=2**40, seq_len=SEQ, global_batch=GLOBAL_BATCH,
                          dtype=torch.float32, device=profile, loss_chunk=LOSS_CHUNK, workers=1)
    rows = [r.as_dict() for r in planned if r.fits]
    progress(f"plan: timing {len(rows)} layouts on 2 gloo ranks")
    measured = run_processes(2, _time_rank, rows, steps, timeout=timeout)[0]
    assert measured is not None
    for row, seconds in zip(rows, measured, strict=True):
        row["measured_step_s"] = seconds
    pred = [r["predicted_step_s"] for r in rows]
    real = [r["measured_step_s"] for r in rows]
    best = min(range(len(rows)), key=lambda i: pred[i])
    summary = {"spearman": spearman(pred, real), "best_over_fastest": real[best] / min(real),
               "profile": {"flops_fp32": profile.flops_fp32, "op_seconds": profile.op_seconds,
                           "latency_s": profile.intra.latency_s, "bandwidth": profile.intra.bandwidth}}
    return rows, summary


def plan_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    """The Markdown table of :func:`plan_phase` and its two figures."""
    from .search import LayoutCandidate

    out = ["| layout | peak MiB | predicted ms | measured ms |", "|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["measured_step_s"]):
        label = LayoutCandidate(r["mesh"], r["checkpointing"], r["context_mode"], r["loss_chunk"], r["micro_batch"],
                                r["accumulation"]).label()
        out.append(f"| {label} | {r['peak_bytes'] / 2**20:.1f} | {1e3 * r['predicted_step_s']:.1f} | "
                   f"{1e3 * r['measured_step_s']:.1f} |")
    out += ["", f"Spearman (predicted vs measured order, {len(rows)} layouts): {summary['spearman']:.2f} "
                f"(target >= 0.8); the predicted best takes {summary['best_over_fastest']:.2f}x the measured "
                "fastest (target <= 1.10)."]
    return out
