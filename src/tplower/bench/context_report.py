"""The context phase's tables and target lines (:mod:`tplower.bench.context`'s rows), in Markdown.

Memory is compared with one process's **plain** causal step at the same
length (the floor: O(S) on every batch kind once no ``[S, S]`` mask is left);
step time with one process's step on the same batch where one process ran it
(padded and packed up to :data:`~tplower.bench.context.ONE_PROCESS_MASKED`
tokens) and on the plain batch, each as the median of round-by-round ratios
with their lowest and highest (the rounds interleave every variant, so a busy
machine slows them alike).

Compiled rows (``tplower bench --compile``) are read against the eager row of
the same mode, batch and length: time round by round, and the peak from the
profiler's memory events on both sides (the live-tensor peak of the steps
table does not see the buffers inductor's code allocates).
"""

from __future__ import annotations

from typing import Any

__all__ = ["context_table", "context_targets"]

#: the issue's targets: peak per rank / one process's plain step, by mode and cp size (all-gather at every size)
PEAK_TARGETS = {("ulysses", 2): 0.6, ("ulysses", 4): 0.35, ("allgather", 2): 0.7, ("allgather", 4): 0.7}
#: step time / one process at cp=2 in the default mode: plain (against plain), packed (against packed)
TIME_TARGETS = {"plain": 0.6, "packed": 1.0}
#: the longest sequence within the budget, / cp=1's, by cp size
GROWTH_TARGETS = {2: 1.8, 4: 3.5}
#: the loss alone in chunks / with the whole logits
LOSS_TARGET = 0.25
#: a compiled step / the eager step of the same mode and batch: time, and peak (the profiler's on both sides)
COMPILED_TARGET = 1.0


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _spread(r: dict[str, float] | None) -> str:
    return "-" if r is None else f"{r['median']:.2f} ({r['low']:.2f}-{r['high']:.2f})"


def _verdict(value: float, side: str, bound: float) -> str:
    ok = value <= bound if side == "<=" else value >= bound
    return f"{value:.2f} (target {side} {bound:g}: {'met' if ok else 'missed'})"


def _floors(rows: list[dict[str, Any]]) -> dict[int, int]:
    """One process's plain step's peak, by length (the first measured; it is deterministic)."""
    out: dict[int, int] = {}
    for r in rows:
        if r.get("table") == "steps" and r["variant"] == "one process" and r["batch"] == "plain":
            out.setdefault(r["seq"], r["peak_bytes"])
    return out


def _step_lines(rows: list[dict[str, Any]]) -> list[str]:
    floors = _floors(rows)
    head = ["tokens", "cp", "mode", "batch", "train step ms", "/ one process, same batch", "/ one process, plain",
            "peak MiB per rank", "/ one process, plain", "collectives per step per rank", "sent MiB per rank",
            "explain --context predicts"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    seen: set[tuple[Any, ...]] = set()
    order = {"one process": 0, "ulysses": 1, "allgather": 2, "hybrid": 3, "tp": 4}
    for r in sorted((r for r in rows if r.get("table") == "steps"),
                    key=lambda r: (r["seq"], r["cp"] * r["tp"], order[r["variant"]])):
        key = (r["seq"], r["cp"], r["tp"], r["variant"], r["batch"])
        if r["variant"] == "one process" and key in seen:  # one process again in a later spawn: its time is
            continue  # that spawn's own ratios' reference; its memory is the same
        seen.add(key)
        mode = "tp=2" if r["variant"] == "tp" else r["variant"]
        floor = floors.get(r["seq"])
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r["counts"].items())) or "-"
        pred = _mb(r["predicted_bytes"]) if r.get("predicted_bytes") is not None else "-"
        lines.append(f"| {r['seq']} | {r['cp']} | {mode} | {r['batch']} | {r['train_step_ms']:.0f} | "
                     f"{_spread(r['vs_same'])} | {_spread(r['vs_plain'])} | {_mb(r['peak_bytes'])} | "
                     f"{r['peak_bytes'] / floor:.2f} | {calls} | {_mb(r['sent_bytes'])} | {pred} |"
                     if floor else f"| {r['seq']} | {r['cp']} | {mode} | {r['batch']} | {r['train_step_ms']:.0f} | "
                     f"{_spread(r['vs_same'])} | {_spread(r['vs_plain'])} | {_mb(r['peak_bytes'])} | - | {calls} | "
                     f"{_mb(r['sent_bytes'])} | {pred} |")
    return lines


def _budget_lines(rows: list[dict[str, Any]]) -> list[str]:
    found = sorted((r for r in rows if r.get("table") == "budget"), key=lambda r: r["cp"])
    if not found:
        return []
    one = next((r["longest_seq"] for r in found if r["cp"] == 1), None)
    lines = [f"Longest plain sequence whose train step peaks within {_mb(found[0]['budget_bytes'])} MiB per rank "
             f"(Ulysses; a multiple of {found[0]['next_seq'] - found[0]['longest_seq']} tokens):", "",
             "| cp | longest tokens | its peak MiB per rank | next length's peak MiB | / cp=1 |",
             "|---|---|---|---|---|"]
    for r in found:
        grow = f"{r['longest_seq'] / one:.2f}" if one else "-"
        lines.append(f"| {r['cp']} | {r['longest_seq']} | {_mb(r['peak_bytes'])} | {_mb(r['next_peak_bytes'])} | "
                     f"{grow} |")
    return lines


def _loss_lines(rows: list[dict[str, Any]]) -> list[str]:
    found = [r for r in rows if r.get("table") == "loss"]
    if not found:
        return []
    w = found[0]
    lines = [f"The loss at a vocabulary of {w['vocab']}, {w['seq']} tokens, cp={w['cp']} (Ulysses): the whole logits "
             f"against `context_loss_chunk={w['chunk']}`; the loss alone is the output head and the loss, forward and "
             "backward, from a rank's final hidden states:", "",
             "| loss | train step ms | / whole | step peak MiB per rank | / whole | loss alone peak MiB | / whole | "
             "loss diff | gradient diff |", "|---|---|---|---|---|---|---|---|---|"]
    for r in found:
        lines.append(f"| {r['variant']} | {r['train_step_ms']:.0f} | {r['train_step_ms'] / w['train_step_ms']:.2f} | "
                     f"{_mb(r['peak_bytes'])} | {r['peak_bytes'] / w['peak_bytes']:.2f} | "
                     f"{_mb(r['loss_peak_bytes'])} | {r['loss_peak_bytes'] / w['loss_peak_bytes']:.2f} | "
                     f"{r['loss_diff']:.1e} | {r['grad_diff']:.1e} |")
    return lines


def _window_kind(r: dict[str, Any]) -> tuple[bool, str]:
    """A window row's kind: windowed first, then by mode (rows from before the mode was recorded: Ulysses)."""
    return r["window"] is None, r.get("mode", "ulysses")


def _window_lines(rows: list[dict[str, Any]]) -> list[str]:
    found = sorted((r for r in rows if r.get("table") == "window"), key=lambda r: (_window_kind(r), r["seq"]))
    windowed = [r for r in found if r["window"] is not None]
    if not windowed:
        return []
    first = {_window_kind(r): r for r in reversed(found)}  # each kind's shortest length: the growth's base
    lines = [f"A sliding window of {windowed[0]['window']} keys (tiny Mistral, {windowed[0]['layers']} layers, every "
             f"layer windowed), cp={windowed[0]['cp']}, one plain row, against the same model causal over "
             "the whole sequence (no window); growth is against each kind's shortest length:", "",
             "| mode | window | tokens | train step ms | growth | peak MiB per rank | growth |",
             "|---|---|---|---|---|---|---|"]
    for r in found:
        base = first[_window_kind(r)]
        lines.append(f"| {_window_kind(r)[1]} | {r['window'] or 'none'} | {r['seq']} | {r['train_step_ms']:.0f} | "
                     f"{r['train_step_ms'] / base['train_step_ms']:.2f} | {_mb(r['peak_bytes'])} | "
                     f"{r['peak_bytes'] / base['peak_bytes']:.2f} |")
    return lines


def _graphs(r: dict[str, Any]) -> str:
    """A compiled row's graphs: its first call's, then any its second call or the rounds compiled."""
    more = [f"+{r[k]} {what}" for k, what in (("recompiles", "second call"), ("graphs_in_rounds", "in the rounds"))
            if r.get(k)]
    return f"{r['graphs']}" + (f" ({', '.join(more)})" if more else "")


def _compiled_lines(rows: list[dict[str, Any]]) -> list[str]:
    found = sorted((r for r in rows if r.get("table") == "compiled"), key=lambda r: (r["seq"], r["cp"]))
    if not found:
        return []
    lines = [f"Compiled (`torch.compile`, backend {found[0]['backend']}) against the eager row of the same mode and "
             "batch: time as the median of round-by-round ratios; both peaks from the profiler's memory events (they "
             "count the buffers compiled code allocates, which the live-tensor peak above does not see); the first "
             "step's loss of each; the first compiled call of each batch kind (untimed by the rounds) with the graphs "
             "it compiled (and those its second call compiled, and the mode's compiled in the rounds) and its graph "
             "breaks:", "",
             "| tokens | cp | mode | batch | eager ms | compiled ms | / eager | eager peak MiB (profiler) | "
             "compiled peak MiB (profiler) | / eager | loss diff | first call s | graphs | breaks |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in found:
        lines.append(f"| {r['seq']} | {r['cp']} | {r['variant']} | {r['batch']} | {r['eager_step_ms']:.0f} | "
                     f"{r['train_step_ms']:.0f} | {_spread(r['vs_eager'])} | {_mb(r['eager_profiler_peak_bytes'])} | "
                     f"{_mb(r['profiler_peak_bytes'])} | "
                     f"{r['profiler_peak_bytes'] / r['eager_profiler_peak_bytes']:.2f} | "
                     f"{abs(r['loss'] - r['eager_loss']):.1e} | {r['compile_s']:.1f} | {_graphs(r)} | "
                     f"{r['breaks']} |")
    return lines


def context_table(rows: list[dict[str, Any]]) -> list[str]:
    """The phase's tables (steps; compiled against eager; the longest sequence within the budget; the loss; the
    sliding window), Markdown lines."""
    parts = _step_lines(rows)
    for more in (_compiled_lines(rows), _budget_lines(rows), _loss_lines(rows), _window_lines(rows)):
        if more:
            parts += ["", *more]
    return parts


def context_targets(rows: list[dict[str, Any]]) -> list[str]:
    """One line per target of the phase that its rows measure, with the figure and met/missed."""
    out = []
    floors = _floors(rows)
    steps = [r for r in rows if r.get("table") == "steps" and r["cp"] > 1]
    for (mode, cp), bound in PEAK_TARGETS.items():
        got = [(r["peak_bytes"] / floors[r["seq"]], r) for r in steps
               if (r["variant"], r["cp"]) == (mode, cp) and r["seq"] in floors]
        if got:
            worst, r = max(got, key=lambda g: g[0])
            out.append(f"- context {mode} cp={cp}, peak per rank / one process's plain step, worst of "
                       f"{len(got)} rows ({r['batch']} at {r['seq']} tokens): {_verdict(worst, '<=', bound)}")
    for kind, bound in TIME_TARGETS.items():
        for r in (r for r in steps if (r["variant"], r["cp"], r["batch"]) == ("ulysses", 2, kind)):
            ratio = r["vs_same"] or r["vs_plain"]
            if ratio:
                out.append(f"- context ulysses cp=2 step time / one process ({kind} at {r['seq']} tokens, "
                           f"{'same batch' if r['vs_same'] else 'plain batch'}; rounds "
                           f"{ratio['low']:.2f}-{ratio['high']:.2f}): {_verdict(ratio['median'], '<=', bound)}")
    for r in sorted((r for r in rows if r.get("table") == "compiled"), key=lambda r: (r["seq"], r["cp"])):
        ratio = r["vs_eager"]
        out.append(f"- context {r['variant']} cp={r['cp']} compiled ({r['backend']}), {r['batch']} at {r['seq']} "
                   f"tokens: step / eager (rounds {ratio['low']:.2f}-{ratio['high']:.2f}) "
                   f"{_verdict(ratio['median'], '<=', COMPILED_TARGET)}; profiler peak / eager "
                   f"{_verdict(r['profiler_peak_bytes'] / r['eager_profiler_peak_bytes'], '<=', COMPILED_TARGET)}")
    budget = {r["cp"]: r for r in rows if r.get("table") == "budget"}
    for cp, bound in GROWTH_TARGETS.items():
        if 1 in budget and cp in budget:
            out.append(f"- longest sequence within {_mb(budget[cp]['budget_bytes'])} MiB per rank, cp={cp} / cp=1 "
                       f"({budget[cp]['longest_seq']} / {budget[1]['longest_seq']} tokens): "
                       f"{_verdict(budget[cp]['longest_seq'] / budget[1]['longest_seq'], '>=', bound)}")
    for mode in dict.fromkeys(r.get("mode", "ulysses") for r in rows if r.get("table") == "window"):
        windowed = sorted((r for r in rows if r.get("table") == "window" and r["window"] and
                           r.get("mode", "ulysses") == mode), key=lambda r: r["seq"])
        if len(windowed) >= 2:  # at a fixed window, work grows as the tokens: allow a quarter more than their growth
            lo, hi = windowed[0], windowed[-1]
            more = hi["seq"] / lo["seq"]
            out.append(f"- sliding window of {lo['window']} ({mode}), train step at {hi['seq']} / {lo['seq']} tokens "
                       f"({more:.0f}x the tokens; peak {hi['peak_bytes'] / lo['peak_bytes']:.2f}x): "
                       f"{_verdict(hi['train_step_ms'] / lo['train_step_ms'], '<=', 1.25 * more)}")
    loss = [r for r in rows if r.get("table") == "loss"]
    if len(loss) == 2:
        whole, tiled = loss
        out.append(f"- loss in chunks of {tiled['chunk']} at vocabulary {tiled['vocab']}, {tiled['seq']} tokens: "
                   f"peak of the loss / whole logits "
                   f"{_verdict(tiled['loss_peak_bytes'] / whole['loss_peak_bytes'], '<=', LOSS_TARGET)}; loss "
                   f"{tiled['loss_diff']:.1e}, gradients {tiled['grad_diff']:.1e} from the whole (target <= 1e-5: "
                   f"{'met' if max(tiled['loss_diff'], tiled['grad_diff']) <= 1e-5 else 'missed'})")
    return out
