"""``tplower bench``: time tplower against the raw collective and DTensor; write a table, JSON and plots.

Without ``torchrun`` it spawns gloo processes for each ``--worlds`` size;
under ``torchrun`` the launcher's ranks run the micro and memory phases
(``--device cuda`` uses NCCL). Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..bench.catalog import CASES, IMPLS
from ..bench.config import CONTEXT_BATCHES, PHASES
from ..core.support.errors import TPLowerError
from .errors import closest, positive_int

if TYPE_CHECKING:
    from ..bench.config import BenchConfig

__all__ = ["KEEP_FREED_MEMORY", "add_arguments", "main", "parse_size", "parse_worlds"]

#: glibc settings that keep freed memory in the heap instead of a fresh ``mmap`` per large buffer.
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 32),
                     "MALLOC_TOP_PAD_": str(1 << 30)}

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes of ``"64KiB"``, ``"4M"``, ``"1024"``.

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    t = text.strip().lower().replace(" ", "")
    digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(digits):]
    if not digits.isdigit() or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"size {text!r} is not valid; use e.g. 1KiB, 64KiB, 4MiB, 64MiB")
    return int(digits) * _UNITS[unit]


def parse_worlds(text: str) -> tuple[int, ...]:
    """World sizes of ``--worlds``: ``"2,4"`` -> ``(2, 4)``.

    Raises:
        argparse.ArgumentTypeError: an item that is not a whole number.
    """
    parts = [p.strip() for p in text.split(",")]
    bad = [p for p in parts if not p.isdigit()]
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: {bad[0]!r} is not a whole number; give world sizes of at "
                                         "least 2, comma separated, e.g. 2,4")
    return tuple(int(p) for p in parts)


def _lengths(text: str) -> tuple[int, ...]:
    """Whole numbers of at least 1, comma separated: ``"8192,32768"`` -> ``(8192, 32768)``.

    Raises:
        argparse.ArgumentTypeError: an item that is not a whole number of at least 1.
    """
    parts = [p.strip() for p in text.split(",")]
    bad = [p for p in parts if not p.isdigit() or int(p) < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: {bad[0]!r} is not a whole number of at least 1; give them comma "
                                         "separated, e.g. 8192,32768")
    return tuple(int(p) for p in parts)


def _window(text: str) -> int:
    """A sliding window in keys: a whole number of at least 0 (0: none).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 0 (keys; 0: no window rows), "
                                         "e.g. 1024")
    return int(text)


def _csv(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(";" if "->" in text else ",") if p.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tplower bench``."""
    parser.add_argument("--quick", action="store_true",
                        help="short run (a few minutes on 2 CPU cores, longer when they are busy): world 2 "
                             "(+4 for the 2x2 case), sizes up to 4 MiB")
    parser.add_argument("--out", metavar="DIR", default="bench-out",
                        help="folder for bench.md, bench.json and the PNG plots (default bench-out)")
    parser.add_argument("--phases", type=_csv, default=None,
                        help=f"comma-separated subset of {','.join(PHASES)} (default all but context)")
    parser.add_argument("--worlds", type=parse_worlds, default=None,
                        help="world sizes of spawned gloo runs (default 2,4)")
    parser.add_argument("--sizes", type=lambda s: tuple(parse_size(x) for x in s.split(",")), default=None,
                        help="global tensor sizes (default 1KiB,64KiB,4MiB,64MiB)")
    parser.add_argument("--cases", type=_csv, default=None,
                        help="transitions separated by ';' (default all: " + "; ".join(c.name for c in CASES) + ")")
    parser.add_argument("--impls", type=_csv, default=None,
                        help=f"micro implementations (default raw,raw_packed,tplower,seed_op,dtensor; any of "
                             f"{','.join(IMPLS)})")
    parser.add_argument("--reps", type=positive_int, default=None, help="timed rounds per size (default 30; quick 13)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="tensor device (cuda: run under torchrun, NCCL)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="model, moe and context phases: also time torch.compile of tplower's and "
                             "parallelize_module's model, of expert parallelism, and of both context modes beside "
                             "their eager rows (backend, default inductor; compiling takes minutes on a few CPU "
                             "cores)")
    parser.add_argument("--context-seqs", type=_lengths, default=None, metavar="N,N",
                        help="context phase: sequence lengths in tokens (default 8192; the full sweep 8192,32768)")
    parser.add_argument("--context-cps", type=_lengths, default=None, metavar="N,N",
                        help="context phase: cp sizes, one spawn of that many gloo ranks each (default 2; the full "
                             "sweep 2,4)")
    parser.add_argument("--context-batches", type=_csv, default=None, metavar="KIND,KIND",
                        help="context phase: kinds of batch (default plain,padded,packed)")
    parser.add_argument("--context-budget", type=parse_size, default=None, metavar="SIZE",
                        help="context phase: bytes per rank for the longest sequence that trains within them, at "
                             "cp=1 and each cp size (default 64MiB; 0: no search)")
    parser.add_argument("--context-window", type=_window, default=None, metavar="W",
                        help="context phase: the sliding window of its window rows, in keys, over 8192, 16384 and "
                             "32768 tokens (default 1024; 0: no window rows)")
    parser.add_argument("--timeout", type=positive_int, default=None, metavar="SECONDS",
                        help="seconds each spawned group of ranks may run (default 900; the context phase's full "
                             "sweep at 32768 tokens and cp=4 needs hours on 2 busy cores)")
    parser.add_argument("--calibrate", action="store_true",
                        help="measure this machine's matmul rates, operator cost and collectives (2 ranks) and write "
                             "OUT/profile.yaml for tplower plan --profile; no phase runs")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="spawned ranks run with glibc keeping freed memory (no fresh mmap, so no page faults, "
                             "for each large buffer): what a caching allocator gives; see benchmarks/README.md")


def _config(args: argparse.Namespace) -> BenchConfig:
    from ..bench.config import BenchConfig

    cfg = BenchConfig.quick() if args.quick else BenchConfig()
    changes = {k: v for k, v in (("phases", args.phases), ("worlds", args.worlds), ("sizes", args.sizes),
                                 ("cases", args.cases), ("impls", args.impls), ("reps", args.reps),
                                 ("context_seqs", args.context_seqs), ("context_cps", args.context_cps),
                                 ("context_batches", args.context_batches),
                                 ("context_budget", args.context_budget), ("context_window", args.context_window),
                                 ("timeout", args.timeout))
               if v is not None}
    if args.worlds is not None:
        changes["multi_axis_only_at"] = ()
    return replace(cfg, device=args.device, compile_backend=args.compile, **changes)


def _check_names(option: str, given: tuple[str, ...] | None, allowed: tuple[str, ...], sep: str = ",") -> None:
    """Each of ``given`` (``None``: the option was not given) is one of ``allowed``; at least one is given.

    Raises:
        TPLowerError: an empty list or an unknown name; the message names ``option``, the closest allowed name
            and all of them.
    """
    if given is None:
        return
    if not given:
        raise TPLowerError(f"{option} names none; give one or more of {sep.join(allowed)}")
    for name in given:
        if name not in allowed:
            raise TPLowerError(f"{option}: {name!r} is unknown{closest(name, allowed)}; allowed: {sep.join(allowed)}")


def _check_options(args: argparse.Namespace, cfg: BenchConfig) -> None:
    """The bench's settings, checked with the names of the options that set them, before any rank starts.

    Raises:
        TPLowerError: an unknown phase, case or implementation (with the closest valid one), a world size
            below 2 or above what this machine spawns, or a size that no world splits evenly.
    """
    from ..run.checks import check_local_world, torchrun_env

    _check_names("--phases", args.phases, PHASES)
    _check_names("--cases", args.cases, tuple(c.name for c in CASES), "; ")
    _check_names("--impls", args.impls, IMPLS)
    _check_names("--context-batches", args.context_batches, CONTEXT_BATCHES)
    if small := [w for w in cfg.worlds if w < 2]:
        raise TPLowerError(f"--worlds: {small[0]} is below 2; a world size is at least 2 ranks (e.g. --worlds 2,4)")
    if torchrun_env() is None:  # each world size is spawned here (under torchrun the launcher's ranks run)
        for w in cfg.worlds:
            check_local_world("--worlds", w, f"--worlds {','.join(map(str, cfg.worlds))}", low=2)
        for cp in cfg.context_cps:
            check_local_world("--context-cps", cp, f"--context-cps {','.join(map(str, cfg.context_cps))}", low=2)
    if short := [n for n in cfg.context_seqs if n < 16]:
        raise TPLowerError(f"--context-seqs: {short[0]} tokens is below 16; give lengths of at least 16 (e.g. 8192)")
    if low := [cp for cp in cfg.context_cps if cp < 2]:
        raise TPLowerError(f"--context-cps: {low[0]} is below 2; a cp size is at least 2 ranks (e.g. 2,4)")
    for nbytes in cfg.sizes:
        for w in cfg.worlds:
            unit = 4 * w * w  # float32 bytes of the smallest [w, w] tensor
            if nbytes < 1 or nbytes % unit:
                up = max(1, -(-nbytes // unit)) * unit
                raise TPLowerError(f"--sizes: {nbytes} B does not split into a float32 [a, b] tensor with a and b "
                                   f"divisible by world {w} (--worlds {','.join(map(str, cfg.worlds))}); give "
                                   f"multiples of {unit} B (e.g. {up})")


def _check_device(device: str) -> None:
    """``--device cuda`` needs a CUDA GPU here (checked once, before any rank starts).

    Raises:
        TPLowerError: no GPU is visible.
    """
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise TPLowerError("--device cuda: no CUDA GPU is visible to this process (torch.cuda.is_available() is "
                           "False); run it on a machine with a CUDA GPU (under torchrun for several), or use "
                           "--device cpu")


def main(args: argparse.Namespace) -> int:
    """Run the bench; print the Markdown table; 0 on success, 2 on a bad argument or a failed rank.

    Raises:
        TPLowerError: bad input (checked before any rank starts, named by its option) or a phase that refused
            its settings.
        tplower.testing.RankFailure: a rank died or raised.
    """
    from ..run.checks import check_writable_folder, writing

    cfg = _config(args)
    _check_options(args, cfg)  # before torch is imported: a misspelled option is refused at once
    check_writable_folder("--out", args.out)  # before any rank: a folder that cannot be written costs no run
    _check_device(cfg.device)
    if args.calibrate:
        from ..planner.calibrate import calibrate
        from ..planner.profile import save_profile

        print("[bench] calibrating: matmul rates, operator cost, collectives on 2 ranks", file=sys.stderr)
        profile = calibrate(2, device=cfg.device, timeout=cfg.timeout)
        path = Path(args.out) / "profile.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_profile(profile, path)
        print(f"wrote {path}: {profile.flops_fp32 / 1e9:.1f} GFLOP/s float32, {profile.flops / 1e9:.1f} GFLOP/s "
              f"bfloat16, {profile.op_seconds * 1e6:.1f} us an operator call, link {profile.intra.latency_s * 1e6:.0f} "
              f"us + {profile.intra.bandwidth / 1e9:.2f} GB/s")
        return 0
    from ..bench.phases import run_bench, write_json
    from ..bench.plots import write_plots
    from ..bench.report import format_markdown

    if args.keep_freed_memory:  # read by each spawned rank's C library at start
        os.environ.update(KEEP_FREED_MEMORY)
    try:
        res = run_bench(cfg, progress=lambda what: print(f"[bench] {what}", file=sys.stderr, flush=True))
    except ValueError as exc:  # TPLowerError, and the phases' checks of their settings
        raise TPLowerError(str(exc)) from None
    if res is None:  # a torchrun rank other than 0
        return 0
    res.meta["keep_freed_memory"] = bool(args.keep_freed_memory)
    out = Path(args.out)
    command = "tplower bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 1 and \
        sys.argv[1] == "bench" else "tplower bench" + (" --quick" if args.quick else "")
    text = format_markdown(res, command)
    with writing("--out", out):  # a disk filled during the run: one line, not a traceback
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.md").write_text(text + "\n")
        write_json(res, out / "bench.json")
        plots = [] if args.no_plots else write_plots(res, out)
    print(text)
    print(f"\nwritten: {out / 'bench.md'}, {out / 'bench.json'}" + "".join(f", {p}" for p in plots))
    return 0
