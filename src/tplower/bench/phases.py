"""``tplower bench``: tplower against the raw collective and DTensor, interleaved in the same processes.

Phases (each optional, all written to one JSON file with every sample):

* ``micro``: per transition (:data:`tplower.bench.cases.CASES`), size and
  mode (``fwd``, ``fwd_bwd``), the implementations run in rounds
  ``A B C A B C ...`` after a warm-up, on real ranks (gloo processes, or
  the launcher's ranks under ``torchrun``, NCCL on GPUs). A sample is the
  mean of ``inner`` back-to-back calls, in microseconds, timed on rank 0.
* ``fake``: the same calls on the ``fake`` backend (no data moves) in one
  process: CPU dispatch overhead alone, microseconds per call; and the cost
  of a plan-cache miss (planning and binding one transition) next to a hit,
  with the memory one cached program holds (:func:`plan_cache_rows`).
* ``memory``: extra bytes one call allocates, forward and backward, for
  tplower and DTensor (torch profiler memory events on CPU,
  ``torch.cuda.max_memory_allocated`` on GPU).
* ``model``: :mod:`tplower.bench.model` (per-step time of a real model and
  per-rank resident memory).
* ``loss``: :mod:`tplower.bench.loss` (a train step's peak memory and time
  with the vocabulary-parallel loss against the loss on gathered logits).
* ``moe``: :mod:`tplower.bench.moe` (one mixture-of-experts layer's train
  step: tplower's tensor parallelism inside the experts and its expert
  parallelism against transformers' own, with the bytes each rank sends).
* ``context`` (only when asked for): :mod:`tplower.bench.context` (train
  steps of plain, padded and packed batches under context parallelism, both
  modes, against one process (and tp=2 at cp=2): time, peak memory per rank,
  collectives and bytes beside what ``tplower explain --context`` predicts;
  the longest sequence a per-rank budget trains; the loss of a 32000-token
  vocabulary in chunks against the whole logits). ``context_seqs``,
  ``context_cps``, ``context_batches``, ``context_budget`` and ``context_window`` of the config set its
  sweep; with ``compile_backend``, compiled rows of both modes beside the eager ones.

Timings are never asserted anywhere; they depend on the machine.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..conformance import quiet_dtensor_logs
from ..core.lower.cache import cache_size
from ..core.lower.redistribute import MeshLowerer, mesh_lowerer
from ..testing import run_processes
from .cases import CASES, IMPLS, Case, build, describe, setup
from .config import PHASES, BenchConfig
from .memory import memory_rows, peak_bytes  # peak_bytes re-exported: it lived here

__all__ = ["PHASES", "BenchConfig", "fake_rank", "micro_rank", "peak_bytes", "plan_cache_rows", "run_bench",
           "summarize"]

def _check(cfg: BenchConfig) -> None:
    known = {c.name for c in CASES}
    bad = [c for c in cfg.cases if c not in known]
    if bad:
        raise ValueError(f"cases={bad} are unknown; allowed: {', '.join(sorted(known))}")
    for name, values, allowed in (("impls", cfg.impls, IMPLS), ("modes", cfg.modes, ("fwd", "fwd_bwd")),
                                  ("phases", cfg.phases, PHASES)):
        wrong = [v for v in values if v not in allowed]
        if wrong:
            raise ValueError(f"{name}={wrong} are unknown; allowed: {', '.join(allowed)}")
    if any(w < 2 for w in cfg.worlds):
        raise ValueError(f"worlds={cfg.worlds}: every world size must be at least 2")
    for nbytes in cfg.sizes:
        for w in cfg.worlds:
            if nbytes < 1 or nbytes % (4 * w * w):
                raise ValueError(f"sizes: {nbytes} B does not split into a float32 [a, b] tensor with a and b "
                                 f"divisible by world {w}; give multiples of {4 * w * w} B (e.g. 1KiB, 64KiB, 4MiB)")
    if cfg.reps < 1 or cfg.warmup < 0:
        raise ValueError(f"reps={cfg.reps} must be >= 1 and warmup={cfg.warmup} >= 0")
    if cfg.device not in ("cpu", "cuda"):
        raise ValueError(f"device={cfg.device!r}; allowed: cpu, cuda")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inner(nbytes: int) -> int:
    """Back-to-back calls per sample: enough to lift a small call above the timer's noise."""
    return 10 if nbytes <= 4 << 10 else 5 if nbytes <= 256 << 10 else 1


def _reps(cfg: BenchConfig, nbytes: int) -> int:
    return cfg.reps if nbytes <= 1 << 20 else max(5, cfg.reps // 2) if nbytes <= 16 << 20 else max(3, cfg.reps // 5)


def interleave(calls: dict[str, Callable[[], object]], rounds: int, warmup: int, inner: int,
               device: torch.device) -> dict[str, list[float]]:
    """Run ``calls`` in rounds ``A B C``, ``B C A``, ``C A B`` ...; per call name the samples in microseconds per call.

    Every rank must pass the same names in the same order (their collectives
    pair up; the rotation is the same on every rank); each sample times
    ``inner`` back-to-back calls. The order turns every round so that no call
    always follows the same neighbour (and pays for what it left: caches, the
    allocator's state, a peer still finishing).
    """
    samples: dict[str, list[float]] = {k: [] for k in calls}
    names = list(calls)
    for r in range(warmup + rounds):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            fn = calls[name]
            _sync(device)
            t0 = time.perf_counter_ns()
            for _ in range(inner):
                fn()
            _sync(device)
            if r >= warmup:
                samples[name].append((time.perf_counter_ns() - t0) / 1e3 / inner)
    return samples


def _meshes(world: int, device: str) -> dict[tuple[int, ...], DeviceMesh]:
    meshes: dict[tuple[int, ...], DeviceMesh] = {(world,): init_device_mesh(device, (world,), mesh_dim_names=("tp",))}
    if world == 4:
        meshes[(2, 2)] = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
    return meshes


def _cases_for(cfg: BenchConfig, world: int) -> list[Case]:
    out = []
    for c in cfg.case_objs():
        if c.mesh is None or (world == 4 and c.mesh == (2, 2)):
            out.append(c)
    return out


def micro_rank(rank: int, world: int, cfg: BenchConfig) -> dict[str, Any]:
    """One rank of the micro phase (and the memory phase at the smallest world); rank 0's rows are returned.

    Returns:
        ``{"micro": [row, ...], "memory": [row, ...]}``; a row holds world,
        case, size (bytes), mode, impl and ``samples_us``.
    """
    quiet_dtensor_logs()
    device = torch.device("cpu")
    if cfg.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    meshes = _meshes(world, cfg.device)
    rows: list[dict[str, Any]] = []
    selected = [c for c in _cases_for(cfg, world) if world not in cfg.multi_axis_only_at or c.mesh is not None]
    for case in selected:
        mesh = meshes[case.mesh_shape(world)]
        for nbytes in cfg.sizes:
            s = setup(case, mesh, nbytes, device)
            for mode in cfg.modes:
                calls = {impl: fn for impl in cfg.impls if (fn := build(impl, case, s, mode)) is not None}
                got = interleave(calls, _reps(cfg, nbytes), cfg.warmup, _inner(nbytes), device)
                rows += [{"world": world, "case": case.name, "plan": describe(case, s), "size": nbytes,
                          "mode": mode, "impl": impl, "samples_us": v} for impl, v in got.items()]
            del s
    on_memory_world = "memory" in cfg.phases and world == min(cfg.worlds)
    memory = memory_rows(cfg, meshes, world, device, _cases_for(cfg, world)) if on_memory_world else []
    dist.barrier()
    return {"micro": rows if rank == 0 else [], "memory": memory if rank == 0 else []}


# ---- fake backend -------------------------------------------------------------------------------


def fake_rank(rank: int, world: int, cfg: BenchConfig) -> list[dict[str, Any]]:
    """Dispatch overhead on the ``fake`` backend, in this (single) process.

    Replaces the harness's process group with a ``fake`` one of
    ``cfg.fake_world`` ranks (collectives return at once, no data moves),
    then times every implementation per call, interleaved.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    quiet_dtensor_logs()
    del rank, world
    dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cfg.fake_world)
    meshes = _meshes(cfg.fake_world, "cpu")
    rows: list[dict[str, Any]] = []
    for case in _cases_for(cfg, cfg.fake_world):
        s = setup(case, meshes[case.mesh_shape(cfg.fake_world)], 1 << 10 if case.mesh is None else 4 << 10,
                  torch.device("cpu"))
        for mode in ("fwd", "fwd_grad", "fwd_bwd"):
            calls = {impl: fn for impl in IMPLS if (fn := build(impl, case, s, mode)) is not None}
            got = interleave(calls, cfg.fake_reps, cfg.warmup, cfg.fake_calls, torch.device("cpu"))
            rows += [{"world": cfg.fake_world, "case": case.name, "mode": mode, "impl": impl, "samples_us": v}
                     for impl, v in got.items()]
    return rows


def plan_cache_rows(cfg: BenchConfig) -> list[dict[str, Any]]:
    """Per transition, the cost of a plan-cache miss next to a hit, on the ``fake`` backend (already initialised).

    A miss is :meth:`~tplower.core.lower.redistribute.MeshLowerer.program` with the
    program dropped from the cache first (planning and binding one
    transition, as a new local shape or an evicted entry costs); a hit is
    the same call with the program cached. Both run interleaved,
    ``cfg.fake_calls`` calls per sample, microseconds per call.

    Returns:
        Rows of world, case, ``miss_us`` and ``hit_us`` (samples),
        ``program_kib`` (Python memory one program holds, from
        ``tracemalloc`` over 200 builds) and ``cache_size`` (the bound).
    """
    import tracemalloc

    meshes = _meshes(cfg.fake_world, "cpu")
    rows: list[dict[str, Any]] = []
    for case in _cases_for(cfg, cfg.fake_world):
        calls = _miss_and_hit(mesh_lowerer(meshes[case.mesh_shape(cfg.fake_world)]), case.src, case.dst)
        got = interleave(calls, cfg.fake_reps, cfg.warmup, cfg.fake_calls, torch.device("cpu"))
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        kept = [calls["miss"]() for _ in range(200)]
        per_program = (tracemalloc.get_traced_memory()[0] - before) / len(kept) / 1024
        tracemalloc.stop()
        rows.append({"world": cfg.fake_world, "case": case.name, "miss_us": got["miss"], "hit_us": got["hit"],
                     "program_kib": per_program, "cache_size": cache_size()})
    return rows


def _miss_and_hit(lowerer: MeshLowerer, src: str, dst: str) -> dict[str, Callable[[], object]]:
    shape = (64, 16)

    def miss() -> object:
        lowerer._cache.clear()  # as if evicted: the next call plans and binds again
        return lowerer.program(src, dst, shape, "cpu")

    return {"miss": miss, "hit": lambda: lowerer.program(src, dst, shape, "cpu")}


def _fake_phase(rank: int, world: int, cfg: BenchConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows = fake_rank(rank, world, cfg)
    return rows, plan_cache_rows(cfg)


# ---- driver -------------------------------------------------------------------------------------


def _torchrun() -> tuple[int, int] | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def machine() -> dict[str, Any]:
    """Where the numbers were taken: host, CPUs, torch, device."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                            "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


@dataclass
class BenchResult:
    """Every sample of one run, and what it ran on."""

    config: dict[str, Any]
    meta: dict[str, Any]
    micro: list[dict[str, Any]] = field(default_factory=list)
    fake: list[dict[str, Any]] = field(default_factory=list)
    plan_cache: list[dict[str, Any]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    model: list[dict[str, Any]] = field(default_factory=list)
    rss: dict[str, Any] = field(default_factory=dict)
    moe: list[dict[str, Any]] = field(default_factory=list)
    loss: list[dict[str, Any]] = field(default_factory=list)
    context: list[dict[str, Any]] = field(default_factory=list)
    plan: list[dict[str, Any]] = field(default_factory=list)


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] = lambda _: None) -> BenchResult | None:
    """Run the selected phases; ``None`` on a ``torchrun`` rank other than 0.

    Without ``torchrun`` each world size is a group of spawned processes on
    ``gloo``; under ``torchrun`` the launcher's ranks run the micro and
    memory phases (NCCL for ``device="cuda"``) and the fake and model phases
    are skipped.

    Raises:
        ValueError: a bad field of ``cfg``.
        tplower.testing.RankFailure: a rank failed.
    """
    _check(cfg)
    t0 = time.time()
    res = BenchResult(config=asdict(cfg), meta=machine() | {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    launched = _torchrun()
    if launched is not None:
        rank, world = launched
        res.meta["launcher"] = "torchrun"
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        dist.init_process_group(backend)
        try:
            got = micro_rank(rank, world, replace(cfg, worlds=(world,), multi_axis_only_at=()))
        finally:
            dist.destroy_process_group()
        if rank != 0:
            return None
        res.micro, res.memory, res.meta["backend"] = got["micro"], got["memory"], backend
        return res
    res.meta["backend"] = "nccl" if cfg.device == "cuda" else "gloo"
    if "micro" in cfg.phases or "memory" in cfg.phases:
        micro_cfg = cfg if "micro" in cfg.phases else replace(cfg, sizes=(), worlds=(2,))
        for world in micro_cfg.worlds:
            progress(f"micro: world {world}")
            got = run_processes(world, micro_rank, micro_cfg, timeout=cfg.timeout)[0]
            res.micro += got["micro"]
            res.memory += got["memory"]
    if "fake" in cfg.phases:
        progress("fake backend: dispatch overhead, plan cache miss and hit")
        res.fake, res.plan_cache = run_processes(1, _fake_phase, cfg, timeout=cfg.timeout)[0]
    if "model" in cfg.phases:
        from .model import model_phase

        rounds = cfg.model_steps if cfg.compile_backend is None else max(cfg.model_steps, cfg.compiled_steps)
        res.model, res.rss = model_phase(rounds, timeout=cfg.timeout, compile_backend=cfg.compile_backend,
                                         device=cfg.device, progress=progress)
    if "moe" in cfg.phases:
        from .moe import moe_phase

        rounds = cfg.model_steps if cfg.compile_backend is None else max(cfg.model_steps, cfg.compiled_steps)
        res.moe = moe_phase(rounds, timeout=cfg.timeout, compile_backend=cfg.compile_backend, progress=progress)
    if "loss" in cfg.phases:
        from .loss import loss_phase

        res.loss = loss_phase(cfg.model_steps, timeout=cfg.timeout, progress=progress)
    if "context" in cfg.phases:
        from .context import ContextSweep, context_phase

        sweep = ContextSweep(seqs=cfg.context_seqs, cps=cfg.context_cps, batches=cfg.context_batches,
                             budget=cfg.context_budget, window=cfg.context_window,
                             compile_backend=cfg.compile_backend)
        res.context = context_phase(max(2, cfg.model_steps // 3), sweep=sweep, timeout=cfg.timeout,
                                    progress=progress)
    if "plan" in cfg.phases:
        from ..planner.accuracy import plan_phase

        res.plan, res.meta["plan"] = plan_phase(max(3, cfg.model_steps // 2), timeout=cfg.timeout,
                                                progress=progress)
    res.meta["elapsed_s"] = round(time.time() - t0, 1)
    return res


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median and spread (10th/90th percentile) of samples, microseconds."""
    xs = sorted(samples)
    if not xs:
        return {"median": float("nan"), "p10": float("nan"), "p90": float("nan")}

    def pct(q: float) -> float:
        return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]
    return {"median": statistics.median(xs), "p10": pct(0.1), "p90": pct(0.9)}


def write_json(res: BenchResult, path: Path) -> None:
    """Every sample of ``res`` to ``path`` as JSON."""
    path.write_text(json.dumps(asdict(res), indent=1))

