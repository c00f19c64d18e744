"""Compiled and eager train step and forward: tplower against ``parallelize_module``, interleaved, medians.

Feeds docs/compile.md ("Step times against parallelize_module", the ``--rounds 40`` run; "The first
compiled step", ``--first-compile``).

    python benchmarks/compiled_steps.py                          # llama-tiny and MiniLM, inductor, 3 runs
    python benchmarks/compiled_steps.py --models llama-tiny --runs 1 --rounds 10
    python benchmarks/compiled_steps.py --first-compile --runs 2     # time to the first compiled step, fairly

Each run spawns 2 fresh gloo ranks (a cold process: empty caches) that build
the model four times: tplower (:func:`tplower.parallelize`, ``"auto"`` for
llama-tiny, the shipped plan for MiniLM) and ``parallelize_module`` on the
same plan, each eager and ``torch.compile``'d (``fullgraph=True``). After a
tiny compile that starts the backend, the first two compiled train steps are
timed on their own (compile, then any recompile; inductor's on-disk caches
are as earlier runs left them); then ``--rounds`` rounds time every copy's forward (no grad) and
AdamW train step in turn (in reverse order every other round), each after a barrier; the slower rank's median
counts. The table gives per run and the median over runs the ratio
tplower / ``parallelize_module``. In that table the first compiled steps are
not a fair race: the first copy compiled in a process warms what the second
reuses. ``--first-compile`` times them fairly: each library alone in fresh
processes with an empty inductor cache, the two taking turns to go first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tplower.testing import run_processes


def build(model_name: str, mesh: Any, variant: str) -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)``: ``model_name`` parallelized by ``variant`` on ``mesh``'s ``tp`` axis.

    ``tplower``: :func:`tplower.parallelize` (``"auto"`` for llama-tiny, else the model's shipped plan);
    ``dtensor``: ``parallelize_module`` on the same plan (:func:`tplower.run.paths.parallelize_dtensor`).
    """
    import tplower
    from tplower.run.models import load_model, model_spec
    from tplower.run.paths import parallelize_dtensor

    spec = model_spec(model_name)
    model, tok = load_model(model_name)
    if variant == "tplower":
        tplower.parallelize(model, mesh, "auto" if model_name == "llama-tiny" else spec.plan)
    else:
        parallelize_dtensor(model, mesh, spec.plan)
    return model, tok


def _rank(rank: int, world: int, model_name: str, rounds: int, backend: str) -> dict[str, Any]:
    from tplower.conformance import quiet_dtensor_logs
    from tplower.run.models import model_spec, sentences
    from tplower.run.tasks import make_batch, model_output, training_loss

    quiet_dtensor_logs()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    spec = model_spec(model_name)
    models: dict[str, Any] = {}
    for key in ("tplower", "dtensor"):
        for compiled in (False, True):
            model, tok = build(model_name, mesh, key)
            name = f"{key}_compiled" if compiled else key
            models[name] = (torch.compile(model, backend=backend, fullgraph=True) if compiled else model,
                            torch.optim.AdamW(model.parameters(), lr=1e-4))
    batch = make_batch(model_name, tok, sentences()[:16])

    def step(name: str) -> Callable[[], None]:
        model, opt = models[name]

        def go() -> None:
            opt.zero_grad(set_to_none=True)
            training_loss(spec.task, model, batch).backward()
            opt.step()
        return go

    def forward(name: str) -> Callable[[], None]:
        def go() -> None:
            with torch.no_grad():
                model_output(spec.task, models[name][0], batch)
        return go

    def timed(fn: Callable[[], None]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    # The first compile of a process also starts the backend (inductor's workers and caches): pay it here, so
    # that neither copy's first step carries it.
    torch.compile(lambda t: (t * 2).sum(), backend=backend)(torch.ones(3, requires_grad=True)).backward()
    first = {}
    for name in ("tplower_compiled", "dtensor_compiled"):
        first[name] = [timed(step(name)), timed(step(name)), timed(forward(name)), timed(forward(name))]
    for name in ("tplower", "dtensor"):
        timed(step(name)), timed(forward(name))
    samples: dict[str, dict[str, list[float]]] = {k: {"step": [], "forward": []} for k in models}
    for r in range(rounds):
        for name in list(models) if r % 2 == 0 else list(models)[::-1]:  # no copy always first after the barrier
            samples[name]["step"].append(timed(step(name)))
            samples[name]["forward"].append(timed(forward(name)))
    return {"first": first, "median": {k: {w: statistics.median(v) * 1e3 for w, v in d.items()}
                                       for k, d in samples.items()}}


def _first_rank(rank: int, world: int, model_name: str, which: str, backend: str) -> list[float]:
    """One library alone in a fresh process: seconds of the first and second compiled AdamW train steps."""
    from tplower.conformance import quiet_dtensor_logs
    from tplower.run.models import model_spec, sentences
    from tplower.run.tasks import make_batch, training_loss

    quiet_dtensor_logs()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    spec = model_spec(model_name)
    model, tok = build(model_name, mesh, which)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = make_batch(model_name, tok, sentences()[:16])
    torch.compile(lambda t: (t * 2).sum(), backend=backend)(torch.ones(3, requires_grad=True)).backward()
    times = []
    for _ in range(2):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        training_loss(spec.task, compiled, batch).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def first_compile(models: list[str], runs: int, backend: str) -> None:
    """Print the first two compiled steps of each library, each alone in fresh processes with an empty cache.

    The libraries take turns going first, run by run; every spawn gets its own empty inductor cache
    (``TORCHINDUCTOR_CACHE_DIR``), so neither reuses the other's (or an earlier run's) compiled kernels.
    """
    import tempfile

    for m in models:
        rows: dict[str, list[list[float]]] = {"tplower": [], "dtensor": []}
        for run in range(runs):
            for which in ("tplower", "dtensor") if run % 2 == 0 else ("dtensor", "tplower"):
                with tempfile.TemporaryDirectory(prefix="tplower-inductor-") as cache:
                    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
                    ranks = run_processes(2, _first_rank, m, which, backend, timeout=1800)
                    del os.environ["TORCHINDUCTOR_CACHE_DIR"]
                rows[which].append([max(r[i] for r in ranks) for i in range(2)])
        print(f"\n{m}, tp=2 gloo, {backend}, each library alone, fresh processes and cache (slower rank, s)")
        print("| step | " + " | ".join(f"run {i + 1}" for i in range(runs)) + " |")
        print("|---|" + "---|" * runs)
        for i, label in enumerate(("first compiled step (compile)", "second compiled step")):
            cells = [f"{a[i]:.2f} / {b[i]:.2f} s = {a[i] / b[i]:.2f}"
                     for a, b in zip(rows["tplower"], rows["dtensor"], strict=True)]
            print(f"| {label} | " + " | ".join(cells) + " |")


def main() -> None:
    """Run, print one table per model."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama-tiny,all-minilm-l6-v2")
    p.add_argument("--runs", type=int, default=3, help="fresh spawns per model (default 3)")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds per run (default 10)")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--first-compile", action="store_true",
                   help="only the first two compiled steps, each library alone in fresh processes with an empty "
                        "inductor cache, taking turns to go first")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    models = args.models.split(",")
    if args.first_compile:
        first_compile(models, args.runs, args.backend)
        return
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in models}
    for _ in range(args.runs):  # interleaved: run k of every model before run k + 1
        for m in models:
            ranks = run_processes(2, _rank, m, args.rounds, args.backend, timeout=1800)
            slow = {k: {w: max(r["median"][k][w] for r in ranks) for w in ("step", "forward")}
                    for k in ranks[0]["median"]}
            first = {k: [max(r["first"][k][i] for r in ranks) for i in range(4)] for k in ranks[0]["first"]}
            runs[m].append({"median": slow, "first": first})
    for m in models:
        print(f"\n{m}, tp=2 gloo, {args.backend}, {args.runs} runs x {args.rounds} rounds (slower rank's median, ms)")
        print("| row | " + " | ".join(f"run {i + 1}" for i in range(args.runs)) + " | median ratio |")
        print("|---|" + "---|" * (args.runs + 1))
        for what in ("step", "forward"):
            for suffix, label in (("_compiled", "compiled"), ("", "eager")):
                cells, ratios = [], []
                for run in runs[m]:
                    a, b = run["median"]["tplower" + suffix][what], run["median"]["dtensor" + suffix][what]
                    cells.append(f"{a:.1f} / {b:.1f} = {a / b:.2f}")
                    ratios.append(a / b)
                print(f"| {label} {what} | " + " | ".join(cells) + f" | **{statistics.median(ratios):.2f}** |")
        for i, label in enumerate(("first compiled step (compile)", "second compiled step")):
            cells = [f"{run['first']['tplower_compiled'][i]:.2f} / {run['first']['dtensor_compiled'][i]:.2f} s"
                     for run in runs[m]]
            print(f"| {label} | " + " | ".join(cells) + " | |")


if __name__ == "__main__":
    main()
