"""Plots of a ``tplower bench`` run: latency against size per transition, and the dispatch overhead bars.

PNG files through matplotlib's ``Agg`` backend; nothing is drawn where matplotlib is missing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .cases import IMPLS, size_label
from .phases import BenchResult
from .report import _LABEL, _index, _med

__all__ = ["write_plots"]

_COLOR = {"raw": "tab:blue", "raw_packed": "tab:cyan",
          "tplower": "tab:orange", "seed_op": "tab:green", "megatron": "tab:purple",
          "funcol": "tab:brown", "dtensor": "tab:red"}


def write_plots(res: BenchResult, folder: Path) -> list[Path]:
    """PNG plots into ``folder``: latency vs size per transition (one per mode), dispatch overhead bars.

    Returns the paths written (none when matplotlib is missing or there is nothing to plot).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written: list[Path] = []
    panels = sorted({(r["world"], r["case"]) for r in res.micro}, key=lambda t: (t[0], _case_order(res, t[1])))
    for mode in dict.fromkeys(r["mode"] for r in res.micro):
        cols = min(3, len(panels))
        rows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
        for ax, (world, case) in zip(axes.flat, panels, strict=False):
            for impl in IMPLS:
                pts = sorted((r["size"], _med(r)) for r in res.micro
                             if r["world"] == world and r["case"] == case and r["mode"] == mode and r["impl"] == impl)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=_LABEL[impl],
                            color=_COLOR[impl])
            ax.set_xscale("log", base=2)
            sizes = sorted({r["size"] for r in res.micro})
            ax.set_xticks(sizes, [size_label(x) for x in sizes])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_title(f"{case} (world {world})", fontsize=9)
            ax.set_xlabel("global tensor (float32)", fontsize=8)
            ax.set_ylabel("µs per call", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="both", alpha=0.3)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        fig.suptitle(f"latency vs size, {mode} ({res.meta.get('backend')}, torch {res.meta.get('torch')})",
                     fontsize=10)
        fig.tight_layout()
        path = folder / f"latency_{mode}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    if res.fake:
        written.append(_overhead_plot(res, folder, plt))
    return written


def _case_order(res: BenchResult, case: str) -> int:
    from .cases import CASES

    names = [c.name for c in CASES]
    return names.index(case) if case in names else len(names)


def _overhead_plot(res: BenchResult, folder: Path, plt: Any) -> Path:
    modes = list(dict.fromkeys(r["mode"] for r in res.fake))
    cases = list(dict.fromkeys(r["case"] for r in res.fake))
    impls = [i for i in IMPLS if any(r["impl"] == i for r in res.fake)]
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.6), squeeze=False)
    fake = _index(res.fake, "case", "mode")
    width = 0.8 / len(impls)
    for ax, mode in zip(axes.flat, modes, strict=True):
        for j, impl in enumerate(impls):
            ys = [_med(fake[(c, mode)][impl]) if impl in fake.get((c, mode), {}) else 0.0 for c in cases]
            ax.bar([i + j * width for i in range(len(cases))], ys, width, label=_LABEL[impl], color=_COLOR[impl])
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
        ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("µs per call", fontsize=8)
        ax.set_title(f"dispatch overhead, {mode} (fake backend)", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    path = folder / "overhead.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
