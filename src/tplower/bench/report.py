"""Tables, target checks and plots of a ``tplower bench`` run (:class:`tplower.bench.BenchResult`).

All times are medians in microseconds per call; the spread shown is the
10th-90th percentile half-width relative to the median. Targets are reported,
never asserted.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from ..core.language.explain import format_bytes
from ..core.support.words import count
from .cases import IMPLS, size_label
from .context_report import context_table, context_targets
from .phases import BenchResult, summarize

__all__ = ["context_table", "fake_table", "format_markdown", "loss_table", "memory_table", "micro_table",
           "model_table", "moe_table", "plan_cache_table", "rss_table", "share_line", "target_lines"]

_LABEL = {"raw": "raw", "raw_packed": "raw packed",
          "tplower": "tplower", "seed_op": "seed op", "megatron": "hand-written",
          "funcol": "funcol", "dtensor": "DTensor"}


def _med(row: dict[str, Any]) -> float:
    return summarize(row["samples_us"])["median"]


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    s = summarize(row["samples_us"])
    spread = (s["p90"] - s["p10"]) / 2 / s["median"] * 100 if s["median"] else 0.0
    return f"{_fmt_us(s['median'])} ±{spread:.0f}%"


def _fmt_us(us: float) -> str:
    return f"{us:.1f}" if us < 100 else f"{us:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or not b else f"{a / b:.2f}"


def _index(rows: Iterable[dict[str, Any]], *keys: str) -> dict[tuple[Any, ...], dict[str, dict[str, Any]]]:
    out: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        out[tuple(r[k] for k in keys)][r["impl"]] = r
    return out


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f}"


_SIDES: dict[str, Callable[[float, float], bool]] = {"<=": operator.le, ">=": operator.ge, ">": operator.gt}


def _against(value: float, side: str, bound: float, digits: int = 2) -> str:
    """``value`` and its verdict: ``_against(1.058, "<=", 1, 3)`` -> ``"1.058 (target <= 1: missed)"``."""
    return f"{value:.{digits}f} (target {side} {bound:g}: {'met' if _SIDES[side](value, bound) else 'missed'})"


def _tally(met: int, total: int, noun: str = "row") -> str:
    """How many of ``total`` met a target: ``"all 3 rows met"``, ``"2 of 3 rows met, 1 missed"``."""
    if met == total:
        return f"all {count(total, noun)} met"
    return f"{met} of {count(total, noun)} met, {total - met} missed"


def micro_table(res: BenchResult) -> list[str]:
    """Markdown rows of the micro phase, one per (world, transition, size, mode)."""
    impls = [i for i in IMPLS if any(r["impl"] == i for r in res.micro)]
    packed = "raw_packed" in impls
    head = ["world", "transition", "size", "mode", *(_LABEL[i] + " µs" for i in impls), "tplower/raw",
            *(["tplower/raw packed"] if packed else []), "DTensor/tplower", "tplower/raw at p10"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (world, case, size, mode), got in _index(res.micro, "world", "case", "size", "mode").items():
        med = {k: _med(v) for k, v in got.items()}
        cells = [str(world), f"`{case}`", size_label(size), mode, *(_cell(got.get(i)) for i in impls),
                 _ratio(med.get("tplower"), med.get("raw")),
                 *([_ratio(med.get("tplower"), med.get("raw_packed"))] if packed else []),
                 _ratio(med.get("dtensor"), med.get("tplower")),
                 _ratio(_p10(got.get("tplower")), _p10(got.get("raw")))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _p10(row: dict[str, Any] | None) -> float | None:
    return None if row is None else summarize(row["samples_us"])["p10"]


def fake_table(res: BenchResult) -> list[str]:
    """Markdown rows of the fake-backend dispatch overhead."""
    impls = [i for i in IMPLS if any(r["impl"] == i for r in res.fake)]
    head = ["transition", "mode", *(_LABEL[i] + " µs" for i in impls), "tplower/hand-written", "DTensor/tplower"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (case, mode), got in _index(res.fake, "case", "mode").items():
        med = {k: _med(v) for k, v in got.items()}
        cells = [f"`{case}`", mode, *(_fmt_us(med[i]) if i in med else "-" for i in impls),
                 _ratio(med.get("tplower"), med.get("megatron")), _ratio(med.get("dtensor"), med.get("tplower"))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plan_cache_table(res: BenchResult) -> list[str]:
    """Markdown rows of the plan cache: a miss (plan and bind one transition) next to a hit, µs per call."""
    head = ["transition", "miss µs (plan + bind)", "hit µs (lookup)", "miss/hit", "KiB per program"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res.plan_cache:
        miss, hit = summarize(r["miss_us"])["median"], summarize(r["hit_us"])["median"]
        lines.append(f"| `{r['case']}` | {_fmt_us(miss)} | {hit:.2f} | {f'{miss / hit:.0f}' if hit else '-'} | "
                     f"{r['program_kib']:.1f} |")
    return lines


def memory_table(res: BenchResult) -> list[str]:
    """Markdown rows of the per-op memory phase (MiB)."""
    head = ["transition", "impl", "out MiB", "fwd peak MiB", "fwd target MiB", "bwd peak MiB", "bwd target MiB",
            "within target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res.memory:
        ok = r["fwd_peak"] <= r["fwd_target"] and r["bwd_peak"] <= r["bwd_target"]
        lines.append("| " + " | ".join([f"`{r['case']}`", _LABEL[r["impl"]], _mb(r["out_bytes"]), _mb(r["fwd_peak"]),
                                        _mb(r["fwd_target"]), _mb(r["bwd_peak"]), _mb(r["bwd_target"]),
                                        "yes" if ok else "**no**"]) + " |")
    return lines


def model_table(res: BenchResult) -> list[str]:
    """Markdown rows of the model phase (milliseconds), with each parallel copy's communication floor and share."""
    head = ["model", "tp", "variant", "forward ms", "train step ms", "step / hand-written", "floor ms",
            "comm share"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {(r["model"], r["variant"]): r for r in res.model}
    for r in res.model:
        ref = by.get((r["model"], "megatron"))
        ratio = _ratio(r["train_step_ms"], ref["train_step_ms"]) if ref else "-"
        floor = f"{r['floor_ms']:.1f}" if "floor_ms" in r else "-"
        share = f"{r['comm_share']:+.3f}" if "comm_share" in r else "-"
        lines.append(f"| {r['model']} | {r['tp']} | {r['variant']} | {r['forward_ms']:.1f} | "
                     f"{r['train_step_ms']:.1f} | {ratio} | {floor} | {share} |")
    return lines


def share_line(res: BenchResult) -> list[str]:
    """One target line per model: the communication share of each library's eager step, and tplower's without
    its other ``overlap`` setting (target: tplower's the smallest)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in res.model):
        shares = {r["variant"]: r["comm_share"] for r in res.model if r["model"] == model and "comm_share" in r}
        libs = {k: v for k, v in shares.items() if k in ("tplower", "dtensor", "megatron")}
        if "tplower" not in libs or len(libs) < 2:
            continue
        other = next((k for k in shares if k.startswith("tplower_")), None)
        text = ", ".join(f"{k} {v:+.3f}" for k, v in shares.items())
        met = "met" if libs["tplower"] <= min(libs.values()) else "missed"
        out.append(f"- {model} communication share of the eager train step, (step - floor) / floor: {text}; "
                   f"tplower's the smallest of {', '.join(libs)}: {met}" +
                   (f" ({other}: {shares[other]:+.3f})" if other else ""))
    return out


def moe_table(res: BenchResult) -> list[str]:
    """Markdown rows of the MoE phase: step time, difference from one process, collectives and bytes per rank;
    for a compiled row its first step (the compile), its graphs and its graph breaks."""
    head = ["variant", "train step ms", "step / transformers' same kind", "loss diff", "collectives per step",
            "sent per rank per step", "compile s, graphs, breaks"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {r["variant"]: r for r in res.moe}
    for r in res.moe:
        if r.get("error"):
            lines.append(f"| {r['variant']} | error: {r['error']} | | | | | |")
            continue
        kind = r["variant"].partition("_")[2]  # ep, tp, ep_compiled
        peer = by.get(f"transformers_{kind}") if r["variant"].startswith("tplower_") else None
        ratio = _ratio(r["train_step_ms"], peer["train_step_ms"]) if peer and not peer.get("error") else "-"
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r["collectives"].items())) or "none"
        comp = f"{r['compile_s']:.0f}, {r['graphs']}, {r['breaks']}" if "compile_s" in r else "-"
        lines.append(f"| {r['variant']} | {r['train_step_ms']:.1f} | {ratio} | {r['loss_diff']:.1e} | {calls} | "
                     f"{format_bytes(r['sent_bytes'])} | {comp} |")
    return lines


def loss_table(res: BenchResult) -> list[str]:
    """Markdown rows of the loss phase: step time, rank 0's bytes saved for backward, difference from one process."""
    head = ["variant", "train step ms", "peak MiB (rank 0)", "saved for backward MiB (rank 0)", "loss diff"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res.loss:
        lines.append(f"| {r['variant']} | {r['train_step_ms']:.1f} | {_mb(r['peak_bytes'])} | "
                     f"{_mb(r['saved_bytes'])} | {r['loss_diff']:.1e} |")
    return lines


def target_lines(res: BenchResult) -> list[str]:
    """One line per measured figure; a figure with a target says, by which side of it the figure falls, whether
    the target was met or missed (a line of many rows counts both)."""
    out: list[str] = []
    micro = _index(res.micro, "world", "case", "size", "mode")
    ratios = [(_med(g["tplower"]) / _med(g["raw"]), k) for k, g in micro.items() if "tplower" in g and "raw" in g
              and k[1] != "R->S(0)"]
    if ratios:
        worst = max(ratios)
        met = sum(r <= 1.10 for r, _ in ratios)
        out.append(f"- tplower/raw <= 1.10 (communicating transitions): {_tally(met, len(ratios))}; worst "
                   f"{worst[0]:.2f} at world {worst[1][0]} `{worst[1][1]}` {size_label(worst[1][2])} {worst[1][3]}; "
                   f"median of ratios {sorted(r for r, _ in ratios)[len(ratios) // 2]:.2f}")
        p10 = [summarize(g["tplower"]["samples_us"])["p10"] / summarize(g["raw"]["samples_us"])["p10"]
               for k, g in micro.items() if "tplower" in g and "raw" in g and k[1] != "R->S(0)"]
        out.append(f"- the same on 10th percentiles (the least disturbed calls): "
                   f"{_tally(sum(r <= 1.10 for r in p10), len(p10))}; median of ratios "
                   f"{sorted(p10)[len(p10) // 2]:.2f}")
    packed = [(_med(g["tplower"]) / _med(g["raw_packed"]), k) for k, g in micro.items()
              if "tplower" in g and "raw_packed" in g]
    if packed:
        worst = max(packed)
        out.append(f"- tplower/raw packed <= 1.10 (transitions that lay pieces out): "
                   f"{_tally(sum(r <= 1.10 for r, _ in packed), len(packed))}; worst {worst[0]:.2f} at world "
                   f"{worst[1][0]} `{worst[1][1]}` {size_label(worst[1][2])} {worst[1][3]}")
    s2s = [(_med(g["dtensor"]) / _med(g["tplower"]), k) for k, g in micro.items()
           if k[1] == "S(0)->S(1)" and "dtensor" in g and "tplower" in g]
    if s2s:
        low = min(s2s)
        out.append(f"- S(0)->S(1) DTensor/tplower >= 2 on gloo: {_tally(sum(r >= 2 for r, _ in s2s), len(s2s))}; "
                   f"lowest {low[0]:.2f} at world {low[1][0]} {size_label(low[1][2])} {low[1][3]}")
    fake = _index(res.fake, "case", "mode")
    hw = [(_med(g["tplower"]) / _med(g["megatron"]), k) for k, g in fake.items() if "megatron" in g and "tplower" in g]
    if hw:
        worst = max(hw)
        out.append(f"- fake backend tplower/hand-written <= 1.2: {_tally(sum(r <= 1.2 for r, _ in hw), len(hw))}; "
                   f"worst {worst[0]:.2f} (`{worst[1][0]}` {worst[1][1]})")
    dt = [(_med(g["dtensor"]) / _med(g["tplower"]), k) for k, g in fake.items() if "dtensor" in g and "tplower" in g]
    if dt:
        low = min(dt)
        out.append(f"- fake backend DTensor/tplower >= 5: {_tally(sum(r >= 5 for r, _ in dt), len(dt))}; lowest "
                   f"{low[0]:.2f} (`{low[1][0]}` {low[1][1]})")
    nograd = [(_med(g["fwd"]["tplower"]), _med(g["fwd_grad"]["tplower"]), c) for c in {k[0] for k in fake}
              if (g := {m: fake[(c, m)] for m in ("fwd", "fwd_grad") if (c, m) in fake}) and len(g) == 2]
    if nograd:
        out.append("- calls without grad skip autograd, tplower forward without grad <= with grad: "
                   f"{_tally(sum(a <= b for a, b, _ in nograd), len(nograd), 'transition')}; µs without vs with: " +
                   ", ".join(f"`{c}` {a:.1f} vs {b:.1f} ({'met' if a <= b else 'missed'})"
                             for a, b, c in sorted(nograd, key=lambda t: t[2])))
    if res.plan_cache:
        miss = sorted(summarize(r["miss_us"])["median"] for r in res.plan_cache)
        hit = sorted(summarize(r["hit_us"])["median"] for r in res.plan_cache)
        kib = max(r["program_kib"] for r in res.plan_cache)
        out.append(f"- plan cache (bound {res.plan_cache[0]['cache_size']} programs per cache): a miss costs "
                   f"{_fmt_us(miss[0])}-{_fmt_us(miss[-1])} µs, a hit {hit[0]:.2f}-{hit[-1]:.2f} µs; a program "
                   f"holds up to {kib:.1f} KiB, so a full cache {kib * res.plan_cache[0]['cache_size'] / 1024:.0f} MiB")
    if res.memory:
        rows = [r for r in res.memory if r["impl"] == "tplower"]
        ok = [r for r in rows if r["fwd_peak"] <= r["fwd_target"] and r["bwd_peak"] <= r["bwd_target"]]
        over = [f"`{r['case']}` fwd {_mb(r['fwd_peak'])}/{_mb(r['fwd_target'])}, bwd {_mb(r['bwd_peak'])}/"
                f"{_mb(r['bwd_target'])} MiB" for r in rows if r not in ok]
        out.append("- per-op memory within output + one staging buffer (tplower): "
                   f"{_tally(len(ok), len(rows), 'transition')}" + ("; over: " + ", ".join(over) if over else ""))
    by = {(r["model"], r["variant"]): r for r in res.model}
    for model in dict.fromkeys(r["model"] for r in res.model):
        t, m, d = by.get((model, "tplower")), by.get((model, "megatron")), by.get((model, "dtensor"))
        if t and m and d:
            out.append(f"- {model} train step: tplower/hand-written "
                       f"{_against(t['train_step_ms'] / m['train_step_ms'], '<=', 1.05, 3)}, DTensor/tplower "
                       f"{_against(d['train_step_ms'] / t['train_step_ms'], '>', 1)}; forward tplower/hand-written "
                       f"{t['forward_ms'] / m['forward_ms']:.3f} (no target)")
        gen = by.get((model, "codegen"))
        if t and gen:
            out.append(f"- {model} generated forwards (tplower codegen) / hooks: forward "
                       f"{_against(gen['forward_ms'] / t['forward_ms'], '<=', 1, 3)}, train step "
                       f"{_against(gen['train_step_ms'] / t['train_step_ms'], '<=', 1, 3)}")
        tc, dc = by.get((model, "tplower_compiled")), by.get((model, "dtensor_compiled"))
        if tc and dc:
            out.append(f"- {model} compiled (torch.compile): train step DTensor/tplower "
                       f"{dc['train_step_ms'] / tc['train_step_ms']:.2f}, forward DTensor/tplower "
                       f"{dc['forward_ms'] / tc['forward_ms']:.2f} (tplower {tc['train_step_ms']:.1f} ms, "
                       f"parallelize_module {dc['train_step_ms']:.1f} ms per step)")
    out += share_line(res)
    moe = {r["variant"]: r for r in res.moe if not r.get("error")}
    for kind, what in (("ep", "expert parallelism"), ("tp", "tensor parallelism inside the experts"),
                       ("ep_compiled", "expert parallelism compiled")):
        t, h = moe.get(f"tplower_{kind}"), moe.get(f"transformers_{kind}")
        if t and h:
            ratio = t["train_step_ms"] / h["train_step_ms"]
            out.append(f"- MoE layer train step, {what}: tplower/transformers {ratio:.2f}"
                       f" ({t['train_step_ms']:.1f} vs {h['train_step_ms']:.1f} ms); bytes sent per rank "
                       f"{format_bytes(t['sent_bytes'])} vs {format_bytes(h['sent_bytes'])}")
    tc, te = moe.get("tplower_ep_compiled"), moe.get("tplower_ep")
    if tc and te:
        out.append(f"- MoE layer train step, tplower expert parallelism compiled/eager "
                   f"{tc['train_step_ms'] / te['train_step_ms']:.2f} ({tc['train_step_ms']:.1f} vs "
                   f"{te['train_step_ms']:.1f} ms; {count(tc['graphs'], 'graph')}, {count(tc['breaks'], 'break')}, "
                   f"compile {tc['compile_s']:.0f} s)")
    by_loss: dict[str, dict[str, Any]] = {r["variant"]: r for r in res.loss}
    lg, lv = by_loss.get("gathered"), by_loss.get("vocab_parallel")
    if lg and lv:
        share = lg["logits_bytes"] * (1 - 1 / lg["tp"])
        out.append(f"- vocabulary-parallel loss (tp={lg['tp']}): peak {_mb(lv['peak_bytes'])} MiB per rank vs "
                   f"{_mb(lg['peak_bytes'])} MiB with gathered logits, kept for backward {_mb(lv['saved_bytes'])} vs "
                   f"{_mb(lg['saved_bytes'])} MiB (the logits beyond this rank's 1/tp: {_mb(share)} MiB); train step "
                   f"{lv['train_step_ms'] / lg['train_step_ms']:.2f}x the gathered one")
    out += context_targets(res.context)
    if res.rss:
        r = res.rss
        out.append(f"- tensors alive per rank after sharding (tp={r['tp']}): {r['tp_live_tensor_mib']:.0f} MiB vs "
                   f"{r['one_live_tensor_mib']:.0f} MiB in one process (no full copy kept when this is well under "
                   "the one-process figure; replicated embeddings stay whole)")
        out.append(f"- per-rank RSS at tp={r['tp']}: {r['tp_rank_mib']:.0f} MiB after sharding and a step "
                   f"(peak {r['tp_peak_mib']:.0f} MiB) vs one process {r['one_mib']:.0f} MiB; fixed runtime cost "
                   f"{r['fixed_mib']:.0f} MiB; parameter memory {r['param_mib']:.0f} MiB one process, "
                   f"{r['tp_param_mib']:.0f} MiB per tp rank; target rank <= fixed + 60% of one process's "
                   f"model memory = {r['target_mib']:.0f} MiB: "
                   f"{'met' if r['tp_rank_mib'] <= r['target_mib'] else 'missed'}")
    return out


def format_markdown(res: BenchResult, command: str = "tplower bench") -> str:
    """The whole report as Markdown: machine, targets, then one table per phase."""
    m = res.meta
    where = (f"{m.get('processor')} x{m.get('cpus')} CPUs, {m.get('platform')}, torch {m.get('torch')}, "
             f"backend {m.get('backend')}" + (f", GPU {m['gpu']}" if m.get("gpu") else "") +
             (", glibc keeps freed memory (--keep-freed-memory)" if m.get("keep_freed_memory") else ""))
    parts = [f"# tplower bench ({m.get('date')})", "", f"Command: `{command}`  ", f"Machine: {where}  ",
             f"Elapsed: {m.get('elapsed_s', '?')} s. Times: median µs per call, ± the 10th-90th percentile "
             "half-spread; timed on rank 0, implementations interleaved in the same processes.", ""]
    tl = target_lines(res)
    if tl:
        parts += ["## Targets", "", *tl, ""]
    if res.micro:
        parts += ["## Micro benchmark (real collectives)", "", *micro_table(res), ""]
    if res.fake:
        parts += ["## Dispatch overhead (fake backend, no data moves)", "",
                  f"World {res.fake[0]['world']}; `fwd` without grad, `fwd_grad` forward of an input that requires "
                  "grad, `fwd_bwd` forward and backward.", "", *fake_table(res), ""]
    if res.plan_cache:
        parts += [f"## Plan cache: miss vs hit (fake backend, world {res.plan_cache[0]['world']})", "",
                  "A miss plans and binds one transition (`MeshLowerer.program` for a new local shape); a hit "
                  "finds it. KiB per program: Python memory one cached program holds (tracemalloc).", "",
                  *plan_cache_table(res), ""]
    if res.memory:
        parts += [f"## Memory per call ({size_label(res.memory[0]['size'])} global tensor, "
                  f"world {res.memory[0].get('world', 2)})", "",
                  *memory_table(res), ""]
    if res.model:
        parts += ["## Model (all-MiniLM-L6-v2, batch of 16 sentences, interleaved)", "",
                  "Floor: the same copy on a `fake` process group of the same ranks, every collective a no-op of "
                  "the same shape, run right after it in every round; comm share: the median over rounds of "
                  "(step - floor) / floor, the time the step spends communicating per unit of its own work.", "",
                  *model_table(res), ""]
    if res.rss:
        parts += ["## Resident memory per rank (MiB)", "", *rss_table(res), ""]
    if res.context:
        r0 = res.context[0]
        parts += [f"## Context parallelism: tiny Llama, {r0['layers']} layers, sdpa, float32, one row", "",
                  "One train step (forward, backward, SGD), median of interleaved rounds (the slower rank), and "
                  "the median of round-by-round ratios to one process with their range; peak tensor memory over a "
                  "step, per rank, against one process's plain causal step at the same length; collectives and "
                  "bytes counted at the dispatcher beside `tplower explain --context`'s prediction. Padded: the "
                  "last eighth padding; packed: 4 documents. `tp=2`: tensor parallelism on the whole sequence.", "",
                  *context_table(res.context), ""]
    if res.loss:
        parts += ["## Loss on vocabulary shards (Llama, 2 layers, vocabulary 32000, 4x63 tokens, interleaved)", "",
                  "Peak: the tensor storages a train step creates, alive at once on rank 0 (parameters not "
                  "counted). Saved for backward: what autograd keeps from forward to backward (each storage "
                  "once; parameters' local views included).", "", *loss_table(res), ""]
    if res.plan:
        from ..planner.accuracy import CONFIG, SEQ, plan_table

        parts += [f"## Layout planner: predicted against measured step times (Llama {CONFIG['num_hidden_layers']} "
                  f"layers, hidden {CONFIG['hidden_size']}, {SEQ} tokens a row, float32, 2 gloo ranks)", "",
                  "Predicted: `tplower.plan_layout` with the profile `tplower bench --calibrate` measured at the "
                  "start of the phase; measured: the same layout trained for real, median step.", "",
                  *plan_table(res.plan, res.meta["plan"]), ""]
    if res.moe:
        from .moe import MOE_BATCH, MOE_SEQ

        parts += [f"## Mixture of experts (one Qwen3-MoE layer, 8 experts, top-2, {MOE_BATCH}x{MOE_SEQ} tokens, "
                  "interleaved)", "", "Collectives and bytes: one step, forward and backward, counted at the "
                  "dispatcher for every library alike (all_reduce 2(n-1)/n of the tensor, all_gather n-1 pieces, "
                  "all_to_all the rows bound for other ranks).", "", *moe_table(res), ""]
    return "\n".join(parts)


def rss_table(res: BenchResult) -> list[str]:
    """Markdown rows of the RSS phase: one process and each tp rank, at each point measured (MiB)."""
    head = ["process", "fixed (imports, group)", "model loaded", "after a step", "after a step, trimmed", "peak",
            "live tensors", "parameters"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    procs = [("one process", res.rss["one"])] + [(f"tp rank {r['rank']}", r) for r in res.rss["ranks"]]
    for name, r in procs:
        lines.append("| " + " | ".join([name, *(f"{r[k]:.0f}" for k in (
            "fixed_mib", "loaded_mib", "after_step_mib", "after_step_trimmed_mib", "peak_mib", "live_tensor_mib",
            "param_mib"))]) + " |")
    return lines
