"""The end of a run: the boundary table, the summary and the verdict, as text or JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..core.support.words import count
from .config import RunConfig

__all__ = ["boundary_table", "format_report", "full_report", "speed", "verdict", "write_json"]

#: what each difference measures, in report order
CHECKS: tuple[tuple[str, str], ...] = (
    ("forward", "forward outputs"),
    ("loss", "training losses"),
    ("params", "updated parameters (gathered)"),
    ("checkpoint", "DCP reload in one process"),
    ("compiled", "compiled forward (torch.compile)"),
    ("verify", "every boundary (tplower verify)"),
)


_AGAINST = {"checkpoint": "(reloaded vs parallel outputs)", "compiled": "(compiled vs eager tplower)"}


def speed(ratio: float) -> str:
    """``ratio`` (the other's time / tplower's time) in words: ``1.25x faster``; below 1, ``1.12x slower`` (0.89);
    a ratio that prints as 1.00 either way (0.996 .. 1.004) is ``the same speed (1.00x)``."""
    if not ratio > 0:
        return "n/a"
    shown = f"{ratio:.2f}" if ratio >= 1.0 else f"{1 / ratio:.2f}"
    if shown == "1.00":
        return "the same speed (1.00x)"
    return f"{shown}x faster" if ratio >= 1.0 else f"{shown}x slower"


def verdict(report: Mapping[str, Any], tolerance: float) -> bool:
    """Whether tplower's every difference from one process is within ``tolerance`` (absolute)."""
    diffs = report["diffs"]["tplower"]
    return all(float(diffs[k]) <= tolerance for k, _ in CHECKS if k in diffs)


def _bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def boundary_table(rows: list[Mapping[str, Any]]) -> list[str]:
    """Boundary rows grouped by plan pattern: module, form, forward op, backward op, bytes per rank per call."""
    grouped: dict[tuple[str, str, bool], dict[str, Any]] = {}
    for r in rows:
        shared = r.get("shared_with") is not None
        g = grouped.setdefault((r["pattern"], r["side"], shared), dict(r, count=0))
        g["count"] += 1
    head = ("module (plan key)", "form", "tp transition", "forward op", "backward op", "bytes/rank fwd+bwd")

    def moved(g: Mapping[str, Any]) -> str:
        if g.get("shared_with") is not None:  # a sibling's move of the same tensor: tplower.runtime.fanout
            return f"shared with {g['shared_with'].rpartition('.')[2]}'s move"
        return f"{_bytes(g['fwd_bytes'])} + {_bytes(g['bwd_bytes'])}"

    body = [(f"{g['pattern']} [{g['side']}] x{g['count']}", g["form"], g["transition"], g["forward"], g["backward"],
             moved(g)) for g in grouped.values()]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*b) for b in body]


def full_report(report: Mapping[str, Any], cfg: RunConfig) -> dict[str, Any]:
    """``report`` with the run's settings and verdict added: what ``--json`` writes."""
    return dict(report) | {
        "model": cfg.model, "tp": cfg.tp, "dp": cfg.dp, "sentences": len(cfg.texts), "steps": cfg.steps,
        "lr": cfg.lr, "batch_size": cfg.batch_size, "repeat": cfg.repeat, "tolerance": cfg.tolerance,
        "plan": cfg.resolved_plan(), "ok": verdict(report, cfg.tolerance)}


def format_report(report: Mapping[str, Any], cfg: RunConfig) -> str:
    """The table of boundaries and the summary ``tplower run`` prints (verdict line first of the summary)."""
    rows = report["boundaries"]
    shape = "x".join(map(str, report["forward_shape"]))
    lines = [f"tplower run: {cfg.model} on {count(report['world'], 'process', 'processes')} ({report['backend']}, "
             f"{report['device']}), mesh dp={cfg.dp} x tp={cfg.tp}; {count(len(cfg.texts), 'sentence', 'sentences')}, "
             f"{count(cfg.steps, 'SGD step', 'SGD steps')} (lr {cfg.lr})",
             "", f"boundaries installed by tplower ({len(rows)}; bytes at the first batch, tokens {shape}):"]
    lines += ["  " + ln for ln in boundary_table(rows)]
    if cfg.codegen is not None:
        lines += ["", f"tplower's copy ran its generated forwards (tplower codegen): {cfg.codegen}"]
    checked = report.get("verify")
    if checked:
        lines += ["", "boundary by boundary against one process (tplower verify, first batch, on the tp axis"
                  + (f" of dp rank 0 of {cfg.dp}" if cfg.dp > 1 else "") + "; its own per-tensor tolerances):"]
        lines += ["  " + ln for ln in checked["table"].splitlines()]
    else:
        lines += ["", "boundary by boundary check (tplower verify): not run in this report"]
    ok = verdict(report, cfg.tolerance)
    d = report["diffs"]
    lines += ["", f"PASS: tplower matches one process within {cfg.tolerance:g} (max abs difference, float32)"
              if ok else f"FAIL: tplower differs from one process by more than {cfg.tolerance:g} (max abs difference)"]
    for key, what in CHECKS:
        if key not in d["tplower"]:
            continue
        t = d["tplower"][key]
        flag = "ok" if t <= cfg.tolerance else "EXCEEDS"
        if key == "verify":  # 0 or inf: verify judges each tensor by its own tolerance (the table above)
            lines.append(f"  {what:<31} " + ("all within their own tolerance (table above)" if t == 0 else
                                             "DIVERGES (table above)"))
            continue
        dt = f"(DTensor {d['dtensor'][key]:.2e})" if key in d["dtensor"] else _AGAINST.get(key, "")
        lines.append(f"  {what:<31} tplower {t:.2e} {flag:<7}  {dt}")
    lines.append(f"  parameters moved by training up to {report['param_update_max']:.2e}; "
                 f"losses {', '.join(f'{x:.6f}' for x in report['losses']['reference'])} (one process)")
    t = report["timing"]
    lines += ["", f"time, median of {count(cfg.repeat, 'repeat', 'repeats')} (ms)".ljust(33) + "forward   train step"]
    names = (("tplower", "tplower"), ("dtensor", "DTensor parallelize_module"), ("one_process", "one process"),
             ("tplower_compiled", "tplower, compiled"), ("reference_compiled", "one process, compiled"))
    for key, name in names:
        if key in t:
            lines.append(f"  {name:<30} {t[key]['forward_ms']:>8.1f}   {t[key]['train_step_ms']:>10.1f}")
    if "dtensor" in t:
        fwd = t["dtensor"]["forward_ms"] / t["tplower"]["forward_ms"]
        step = t["dtensor"]["train_step_ms"] / t["tplower"]["train_step_ms"]
        lines.append(f"  tplower vs DTensor: forward {speed(fwd)}, train step {speed(step)}")
    return "\n".join(lines)


def write_json(path: str | Path, report: Mapping[str, Any], cfg: RunConfig) -> None:
    """Write :func:`full_report` to ``path`` as JSON."""
    Path(path).write_text(json.dumps(full_report(report, cfg), indent=2, sort_keys=True) + "\n", encoding="utf-8")
