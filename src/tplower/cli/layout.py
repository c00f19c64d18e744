"""``tplower plan --ranks N``: the layouts of a model on N ranks, each traced on fake tensors, ranked (the table, or
``--json``), and the lines that run the best one.

    tplower plan --model llama-tiny --ranks 4 --memory 2GiB --seq 512 --global-batch 8
    tplower plan --model path/to/config.json --ranks 64 --gpus-per-node 8 --memory 80GiB --seq 32768 \\
        --global-batch 256 --device h100 --top 10
    tplower plan --model saved_folder --ranks 8 --profile my_machine.yaml --json

``--model`` is a ``config.json``, a folder holding one (a saved model), or a model of ``tplower run``
(``llama-tiny``, ...). :func:`tplower.plan_layout` does the work; a progress bar on stderr counts the layouts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..core.support.errors import TPLowerError
from .errors import positive_int

__all__ = ["add_arguments", "config_for", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The layout planner's options (read when ``--ranks`` is given)."""
    group = parser.add_argument_group("layout planning (with --ranks)")
    group.add_argument("--ranks", type=positive_int, default=None,
                       help="plan the mesh for this many ranks (the job's world size) instead of deriving a plan")
    group.add_argument("--gpus-per-node", type=positive_int, default=None, help="ranks per node (default: one node)")
    group.add_argument("--memory", default=None, help="memory per rank, e.g. 80GiB (default: the device's)")
    group.add_argument("--seq", type=positive_int, default=None, help="tokens per row")
    group.add_argument("--global-batch", type=positive_int, default=None, help="rows per optimizer step, all dp")
    group.add_argument("--micro-batch", type=positive_int, default=None, help="rows per dp rank per micro-step (1)")
    group.add_argument("--dtype", default="bfloat16", help="parameter dtype (bfloat16, float32; default bfloat16)")
    group.add_argument("--device", default=None, help="a datasheet preset: h100, h200, a100 (default h100)")
    group.add_argument("--profile", default=None, metavar="FILE",
                       help="a profile tplower bench --calibrate wrote (instead of --device)")
    group.add_argument("--top", type=positive_int, default=None, help="print the first N rows (default all)")
    group.add_argument("--json", action="store_true", help="print every row as JSON (a list of objects)")
    group.add_argument("--no-checkpointing", action="store_true", help="leave activation checkpointing out")
    group.add_argument("--axes", default="dp,cp,tp", help="mesh axes to search, comma-separated (default dp,cp,tp)")
    group.add_argument("--workers", type=positive_int, default=None, help="tracing processes (default: by size)")
    group.add_argument("--all", action="store_true", dest="trace_all",
                       help="trace every variant (a model of more than 6 layers: by default a mesh's leanest variant "
                            "first, then only those that could be the pick)")


def config_for(model: str) -> Any:
    """The transformers config of ``--model``: a ``config.json``, a folder with one, or a ``tplower run`` model.

    Raises:
        TPLowerError: none of these (the message lists the ``tplower run`` models).
    """
    from transformers import AutoConfig

    path = Path(model)
    if path.is_file():
        data = json.loads(path.read_text())
        kind = data.get("model_type")
        if not kind:
            raise TPLowerError(f"--model {model!r}: the file has no model_type; give a transformers config.json")
        return AutoConfig.for_model(**data)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TPLowerError(f"--model {model!r}: the folder holds no config.json")
        return AutoConfig.from_pretrained(str(path))
    from ..core.support.words import closest
    from ..run.models import MODELS, skeleton

    if model not in MODELS:
        raise TPLowerError(f"--model {model!r} is neither a config.json, a folder holding one, nor a model of "
                           f"tplower run ({', '.join(sorted(MODELS))}){closest(model, list(MODELS))}")
    return skeleton(model).config


def _table(rows: list[Any], top: int | None) -> str:
    unit, scale = ("GiB", 2**30) if max((r.peak_bytes for r in rows), default=0) >= 2**30 else ("MiB", 2**20)

    def gib(n: int) -> str:
        return f"{n / scale:.2f}" if n else "-"
    head = ("#", "layout", "fits", f"peak {unit}", "params", "grads", "optim", "activ", f"comm {unit}/step",
            "step s", "reason")
    lines = [head]
    for i, r in enumerate(rows[:top] if top else rows, 1):
        s = r.split
        lines.append((str(i), r.label(), "yes" if r.fits else "no", gib(r.peak_bytes), gib(s.get("parameters", 0)),
                      gib(s.get("gradients", 0)), gib(s.get("optimizer", 0)), gib(s.get("activations", 0)),
                      gib(r.collective_bytes), f"{r.predicted_step_s:.3g}" if r.peak_bytes else "-", r.reason))
    widths = [max(len(line[c]) for line in lines) for c in range(len(head))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def main(args: argparse.Namespace) -> int:
    """Plan, print the table (or JSON), and the lines that run the best candidate; exit 1 when none fits.

    Raises:
        TPLowerError: a missing ``--seq``/``--global-batch``, both ``--device`` and ``--profile``, a bad
            ``--model``, and every refusal of :func:`tplower.plan_layout`.
    """
    missing = [o for o, v in (("--seq", args.seq), ("--global-batch", args.global_batch)) if v is None]
    if missing:
        raise TPLowerError(f"tplower plan --ranks: give {' and '.join(missing)}")
    if args.device and args.profile:
        raise TPLowerError("--device and --profile both name the device: give one")
    from ..planner import plan_layout
    from ..run.quiet import quiet_transformers

    with quiet_transformers():
        config = config_for(args.model)
    bar: Any = None
    if not args.json or sys.stderr.isatty():
        from tqdm import tqdm  # type: ignore[import-untyped]

        bar = tqdm(total=None, desc="tracing layouts", unit="layout", file=sys.stderr, leave=False)

    def progress(done: int, total: int, label: str) -> None:
        if bar is not None:
            bar.total = total
            bar.n = done
            bar.set_postfix_str(label[:40])
            bar.refresh()

    from ..planner import load_profile

    profile = load_profile(args.profile or args.device or "h100")
    with quiet_transformers():
        rows = plan_layout(config, args.ranks, memory_per_rank=args.memory, seq_len=args.seq,
                           global_batch=args.global_batch, micro_batch=args.micro_batch, dtype=args.dtype,
                           device=profile, gpus_per_node=args.gpus_per_node,
                           checkpointing=(False,) if args.no_checkpointing else (False, True),
                           axes=tuple(a.strip() for a in args.axes.split(",") if a.strip()),
                           workers=args.workers, prune=False if args.trace_all else None, progress=progress)
    if bar is not None:
        bar.close()
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=1))
    else:
        print(_table(rows, args.top))
        best = rows[0] if rows and rows[0].fits else None
        if best is None:
            print("\nno layout fits; see the reasons above", file=sys.stderr)
        else:
            print(f"\nbest: {best.label()}, peak {best.peak_bytes / 2**30:.2f} GiB, predicted "
                  f"{best.predicted_step_s:.3g} s a step. To run it:\n")
            print(best.code(profile.device))
    return 0 if rows and rows[0].fits else 1
