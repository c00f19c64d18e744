"""A/B of the model step before landing a change: this tree against REV, alternating, as a ratio of ratios.

Feeds docs/benchmarks.md (comparing with ``main`` before landing) and the eager-step history in
benchmarks/README.md ("The eager step"): ratios of ratios against earlier revisions.

Not run in CI; a developer runs it before landing anything that could slow the step::

    python benchmarks/ab.py REV [--pairs 3] [--reps 20] [--model NAME] [--compile [BACKEND]]

REV is any git revision (``main``, ``9718b6f``, ``HEAD~3``): it is checked out
detached in a temporary ``git worktree`` (removed at the end, also on Ctrl-C
or a failure). Then, ``--pairs`` times, the bench's model phase
(:func:`tplower.bench.model.model_rank`: MiniLM at tp=2 on 2 spawned gloo
ranks, the copies interleaved round by round, ``--reps`` timed rounds, no
communication floors) runs once on this tree's ``src`` and once on REV's
(``PYTHONPATH`` pointing at it), the order turning every pair so that neither
always goes first. Each run gives, from medians within that run,

* ``tplower / hand``: tplower's train step over the hand-written
  Megatron-style one (for ``--model`` other than MiniLM, which has no
  hand-written copy: over ``parallelize_module``'s);
* ``dtensor / tplower``: ``parallelize_module``'s step over tplower's;

and each pair the **ratio of ratios**: this tree's ``tplower / hand`` over
REV's, below 1 when this tree's step is faster. A ratio taken within one
run cancels most of the machine's load, which moves every copy of that run
alike; ``hand this / REV`` (the reference copy's step in the two runs) shows
how much the load moved between the two runs of a pair. The summary gives the
median and range over the pairs, and the load average (``os.getloadavg``) at
the start of every run: on a shared machine read the spread, not one number.

With ``--compile`` the compiled rows are timed too (``tplower_compiled`` over
``dtensor_compiled`` per run); compiling takes minutes per run on a few CPU
cores.

With ``--fake`` each run is ``benchmarks/step_overhead.py`` instead (this
tree's script, on either side's tplower): the same copies in one process on a
``fake`` group, no communication, so the ratios are CPU work alone, far less
disturbed by a shared machine's scheduling than two real ranks; a change to
tplower's per-call work shows there first. ``--reps`` is then its rounds; ``--clock cpu`` times
this thread's CPU time instead of the wall clock (steadier still on a shared machine) and
``--sentences 2`` shrinks the batch so that the per-call overhead dominates.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARK = "AB-ROWS "


def _driver(reps: int, model: str | None, compile_backend: str | None) -> None:
    """In a child process: run the model phase of whichever tplower ``PYTHONPATH`` names; print its rows."""
    import tplower
    from tplower.bench.model import model_rank
    from tplower.testing import run_processes

    args: list[Any] = [reps, 1, compile_backend, model]
    if "floor" in inspect.signature(model_rank).parameters:  # older revisions have no floors to skip
        args.append(False)
    rows = run_processes(2, model_rank, *args, timeout=3600)[0]
    keep = ("variant", "forward_ms", "train_step_ms")
    print(MARK + json.dumps({"tplower": tplower.__file__, "rows": [{k: r[k] for k in keep} for r in rows]}))


def _run(src: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One model phase (or fake-group step, ``--fake``) on the tplower under ``src``, in a fresh process."""
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    load = os.getloadavg()[0]
    if args.fake:
        cmd = [sys.executable, str(ROOT / "benchmarks" / "step_overhead.py"), "--rounds", str(args.reps),
               "--copies", "tplower,megatron,dtensor", "--json", "--clock", args.clock,
               "--sentences", str(args.sentences)]
    else:
        cmd = [sys.executable, __file__, "--driver", "--reps", str(args.reps)]
        cmd += ["--model", args.model] if args.model else []
        cmd += ["--compile", args.compile] if args.compile else []
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    mark = "STEP-JSON " if args.fake else MARK
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith(mark)), None)
    if done.returncode or line is None:
        raise SystemExit(f"ab.py: the run on {src} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    got = json.loads(line[len(mark):])
    if args.fake:
        return {"load": load, "rows": {k: {"train_step_ms": v["step"]} for k, v in got.items()}}
    if not Path(got["tplower"]).resolve().is_relative_to(src.resolve()):
        raise SystemExit(f"ab.py: the run meant for {src} imported tplower from {got['tplower']}")
    return {"load": load, "rows": {r["variant"]: r for r in got["rows"]}}


def _ratios(run: dict[str, Any]) -> dict[str, float]:
    rows = run["rows"]
    step = {k: r["train_step_ms"] for k, r in rows.items()}
    ref = "megatron" if "megatron" in step else "dtensor"
    out = {"ref_ms": step[ref], "tplower / hand": step["tplower"] / step[ref],
           "dtensor / tplower": step["dtensor"] / step["tplower"]}
    if "tplower_compiled" in step:
        out["compiled tplower / dtensor"] = step["tplower_compiled"] / step["dtensor_compiled"]
    return out


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def _worktree(rev: str, where: Path) -> Path:
    """REV checked out detached under ``where``; its ``src`` folder."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True,
                         text=True, check=False)
    if sha.returncode:
        raise SystemExit(f"ab.py: {rev!r} is not a revision of this repository: {sha.stderr.strip()}")
    tree = where / "rev"
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), sha.stdout.strip()], cwd=ROOT,
                   check=True)
    return tree / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", nargs="?", help="the git revision to compare this tree with (e.g. main, 9718b6f)")
    parser.add_argument("--pairs", type=int, default=3, help="runs of each side, alternating (default 3)")
    parser.add_argument("--reps", type=int, default=20, help="timed rounds of the model phase per run (default 20)")
    parser.add_argument("--model", default=None, help="a model of tplower run (default all-MiniLM-L6-v2)")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="also time the compiled copies (backend, default inductor)")
    parser.add_argument("--fake", action="store_true",
                        help="time benchmarks/step_overhead.py (one process, fake group: CPU work alone) instead")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="with --fake: wall time (default) or this thread's CPU time (steadier when shared)")
    parser.add_argument("--sentences", type=int, default=16,
                        help="with --fake: the batch (default 16; 2 leaves mostly the per-call overhead)")
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver:
        _driver(args.reps, args.model, args.compile)
        return
    if args.rev is None:
        parser.error("REV is required")
    with tempfile.TemporaryDirectory(prefix="tplower-ab-") as tmp:
        rev_src = _worktree(args.rev, Path(tmp))
        try:
            _compare(ROOT / "src", rev_src, args)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(rev_src.parent)], cwd=ROOT, check=False)


def _compare(this: Path, rev: Path, args: argparse.Namespace) -> None:
    sides = {"this": this, args.rev: rev}
    what = "fake-group step (CPU work alone)" if args.fake else "model step"
    print(f"{what}, tp=2, {args.reps} rounds a run, {args.pairs} pairs; this tree vs {args.rev}", flush=True)
    pairs: list[dict[str, dict[str, float]]] = []
    for i in range(args.pairs):
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        pair: dict[str, dict[str, float]] = {}
        for side in order:
            run = _run(sides[side], args)
            pair[side] = {**_ratios(run), "load": run["load"]}
            cells = "  ".join(f"{k} {v:.3f}" for k, v in pair[side].items() if k not in ("load", "ref_ms"))
            print(f"  pair {i + 1} {side:>10s}: load {run['load']:.1f}  hand {pair[side]['ref_ms']:.1f} ms  {cells}",
                  flush=True)
        pairs.append(pair)
    this_k, rev_k = list(sides)
    print(f"summary over {args.pairs} pairs, median (min-max):")
    print(f"  ratio of ratios (tplower / hand, this / {args.rev}): "
          f"{_spread([p[this_k]['tplower / hand'] / p[rev_k]['tplower / hand'] for p in pairs])}")
    print(f"  hand this / {args.rev} (load drift within a pair): "
          f"{_spread([p[this_k]['ref_ms'] / p[rev_k]['ref_ms'] for p in pairs])}")
    for key in pairs[0][this_k]:
        if key not in ("load", "ref_ms"):
            for side in sides:
                print(f"  {key:28s} {side:>10s}: {_spread([p[side][key] for p in pairs])}")
    loads = [p[s]["load"] for p in pairs for s in sides]
    print(f"  load average at the runs' starts: {min(loads):.1f}-{max(loads):.1f}")


if __name__ == "__main__":
    main()
