"""The model phase of ``tplower bench``: a real model's step time, and per-rank resident memory.

Timing (:func:`model_rank`): all-MiniLM-L6-v2 (the main job's model and plan,
:data:`tplower.run.models.MINILM_TP_PLAN`) in these copies on every rank of one
``tp`` group, interleaved round by round:

* ``one_process``: the unsharded model (every rank runs its own copy at the
  same time, so the machine is as loaded as in the parallel runs);
* ``tplower``: :func:`tplower.parallelize` (the main job's tplower path);
* ``tplower_no_overlap`` (or ``tplower_overlap``): the same with
  ``parallelize``'s other ``overlap`` setting (:mod:`tplower.runtime.overlap`);
* ``codegen``: the same plan through its generated forwards
  (:func:`tplower.codegen.emit` then :func:`tplower.codegen.install`);
* ``dtensor``: ``parallelize_module`` with Colwise/RowwiseParallel;
* ``megatron``: the same plan written by hand in Megatron's style
  (:func:`megatronize`: plain autograd Functions with the collectives in);
* ``<variant>_floor``: each parallel copy but ``codegen`` again on a ``fake``
  group of the same ranks, every collective a no-op of the same shape: the
  communication floor, so a row reads as ``(step - floor) / floor``, the
  share of the step spent communicating (:mod:`tplower.bench.floor`).

Memory (:func:`rss_phase`): per-rank resident set size of the tplower path
at ``tp=2`` against one process, with the runtime's fixed cost (imports,
process group) measured before any model is loaded.
"""

from __future__ import annotations

import gc
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ..conformance import quiet_dtensor_logs
from ..testing import run_processes
from .floor import FLOOR, FLOOR_AXIS, floor_group, with_shares
from .megatron import megatronize  # re-exported: it lived here

__all__ = ["megatronize", "model_phase", "model_rank", "rss_phase", "rss_rank"]


def _task() -> Any:
    """The main job's task functions (``make_batch``, ``model_output``, ``training_loss``), wherever they live."""
    import importlib

    for name in ("tplower.run.tasks", "tplower.run.models"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if all(hasattr(mod, f) for f in ("make_batch", "model_output", "training_loss")):
            return mod
    raise ImportError("tplower has no make_batch/model_output/training_loss (tplower.run.tasks or tplower.run.models)")


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _overlap_default() -> bool:
    """What :func:`tplower.parallelize` does by default with ``overlap``."""
    import inspect

    from ..nn.parallelize import parallelize

    default: bool = inspect.signature(parallelize).parameters["overlap"].default
    return default


def _copies(name: str, mesh: DeviceMesh, group: ProcessGroup, load: Callable[[], nn.Module],
            suffix: str = "", axis: str = "tp") -> dict[str, nn.Module]:
    """The parallel copies of ``name`` on ``mesh`` (its ``axis``, ``group`` that axis's group), keyed variant+suffix.

    ``tplower`` (``parallelize``'s default), ``tplower_overlap`` or ``tplower_no_overlap`` (the other setting of
    ``overlap``), and for MiniLM ``codegen`` (real copies only) and ``megatron``; ``dtensor`` always.
    """
    from ..codegen.emit import emit, install
    from ..nn.parallelize import parallelize
    from ..run.models import MINILM, model_spec
    from ..run.paths import parallelize_dtensor

    plan = model_spec(name).plan
    other = not _overlap_default()
    out: dict[str, nn.Module] = {"tplower" + suffix: parallelize(load(), mesh, plan, axis=axis)}
    out[("tplower_overlap" if other else "tplower_no_overlap") + suffix] = parallelize(load(), mesh, plan, axis=axis,
                                                                                        overlap=other)
    if name == MINILM and not suffix:
        out["codegen"] = install(load(), mesh, emit(load(), mesh, plan))
    out["dtensor" + suffix] = load()
    parallelize_dtensor(out["dtensor" + suffix], mesh, plan, axis=axis)
    if name == MINILM:
        out["megatron" + suffix] = megatronize(load(), dict(plan), group)
    return out


def model_rank(rank: int, world: int, rounds: int, warmup: int = 1,
               compile_backend: str | None = None, model_name: str | None = None,
               floor: bool = True, device: str = "cpu") -> list[dict[str, Any]]:
    """Time forward and training step of the copies on this rank (``tp = world``); rank 0 returns rows.

    ``model_name``: a model of ``tplower run`` (default all-MiniLM-L6-v2 and its shipped plan, in the copies
    above; another, e.g. ``llama-tiny`` with its transformers plan, in ``one_process``, the two ``tplower``
    copies and ``dtensor``, as the code generator and the hand-written copy are written for MiniLM's plan).

    ``floor``: also each parallel copy but ``codegen`` on a ``fake`` group of the same ranks, named
    ``<variant>_floor`` (:mod:`tplower.bench.floor`): the same step with every collective moving nothing.
    ``device``: ``cpu`` (the ranks' group is gloo) or ``cuda`` (NCCL, one GPU per rank, ``rank % count``).

    With ``compile_backend`` (e.g. ``"inductor"``), also ``tplower_compiled``
    and ``dtensor_compiled``: ``torch.compile`` of those two copies (sharing
    their parameters and optimizers), timed in the same rounds; the warm-up
    round compiles them. Each round runs the copies in turn, in the reverse
    order every other round; each copy's timed forward follows an untimed one
    of its own, so it does not pay for the copy before it.

    Rows: ``model``, ``tp``, ``variant``, ``forward_ms`` and
    ``train_step_ms`` (medians) and their samples.
    """
    from ..run.models import MINILM, load_model, model_spec, sentences

    task = _task()
    make_batch, model_output, training_loss = task.make_batch, task.model_output, task.training_loss
    name = model_name or MINILM
    kind = model_spec(name).task
    dev = torch.device("cpu")
    if device == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)

    def load() -> nn.Module:
        return load_model(name, device=dev)[0]

    quiet_dtensor_logs()
    torch.manual_seed(0)
    mesh = init_device_mesh(device, (1, world), mesh_dim_names=("dp", "tp"))
    models: dict[str, nn.Module] = {}
    models["one_process"], tok = load_model(name, device=dev)
    real = _copies(name, mesh, mesh.get_group("tp"), load)
    floors: dict[str, nn.Module] = {}
    if floor:
        fake, fake_mesh = floor_group(device)
        floors = _copies(name, fake_mesh, fake, load, FLOOR, FLOOR_AXIS)
    for key, model in real.items():  # each floor copy right after its real one: a round's pair runs back to back
        models[key] = model
        if key + FLOOR in floors:
            models[key + FLOOR] = floors[key + FLOOR]
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    if compile_backend is not None:
        for key in ("tplower", "dtensor"):
            models[f"{key}_compiled"] = torch.compile(models[key], backend=compile_backend)  # type: ignore[assignment]
            opts[f"{key}_compiled"] = opts[key]
    batch = make_batch(name, tok, sentences()[:16], device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def forward(key: str) -> Callable[[], object]:
        def go() -> object:
            with torch.no_grad():
                return model_output(kind, models[key], batch)
        return go

    def step(key: str) -> Callable[[], object]:
        def go() -> object:
            opts[key].zero_grad(set_to_none=True)
            loss = training_loss(kind, models[key], batch)
            loss.backward()
            opts[key].step()
            return loss
        return go

    samples: dict[str, dict[str, list[float]]] = {k: {"forward": [], "step": []} for k in models}
    for r in range(warmup + rounds):
        # the order turns round every round: what runs first after the barrier pays for it (measured: a compiled
        # forward first of a pair took 5% longer than the same forward second), so no copy always goes first
        for key in list(models) if r % 2 == 0 else list(models)[::-1]:
            # An untimed forward first: a call right after another copy's step pays for the caches and the
            # allocator that step left (measured, MiniLM compiled forward after an eager copy's step: 1.05-1.14
            # of parallelize_module's; after an untimed call of its own: 0.91-0.96). The step follows this
            # copy's own forward, so it starts as warm.
            forward(key)()
            for what, fn in (("forward", forward(key)), ("step", step(key))):
                sync()
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                sync()
                if r >= warmup:
                    samples[key][what].append(time.perf_counter() - t0)
    if rank != 0:
        return []
    return with_shares([{"model": name, "tp": world, "variant": k, "forward_ms": _median_ms(v["forward"]),
                         "train_step_ms": _median_ms(v["step"]), "forward_samples_ms": [s * 1e3 for s in v["forward"]],
                         "step_samples_ms": [s * 1e3 for s in v["step"]]} for k, v in samples.items()])


def _rss_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB (``/proc/self/status``; peak from getrusage)."""
    cur = peak = 0.0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    cur = int(line.split()[1]) / 1024
                elif line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) / 1024
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return cur, peak


def _trim() -> None:
    """Return freed heap pages to the OS (glibc ``malloc_trim``), so RSS shows live memory; no-op elsewhere."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def live_tensor_mib() -> float:
    """MiB of distinct tensor storages still referenced in this process (what a kept full copy would show in)."""
    import warnings

    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                if isinstance(obj, DTensor):  # a wrapper: its memory is its local tensor's
                    obj = obj._local_tensor
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) / 2**20


def rss_rank(rank: int, world: int, shard: bool) -> dict[str, float]:
    """Resident memory of one rank: after imports (fixed cost), after loading (and sharding), after a step.

    ``shard``: run the main job's tplower path (:func:`tplower.parallelize`
    with the MiniLM plan on a ``tp = world`` mesh); otherwise the one-process
    model. Returns MiB figures and the parameter bytes this rank holds;
    ``*_trimmed_mib`` are taken after ``malloc_trim`` (freed heap given back
    to the OS), which tells memory still referenced from memory the
    allocator merely kept.
    """
    from ..nn.parallelize import parallelize
    from ..run.models import MINILM, MINILM_TP_PLAN, load_model, sentences

    task = _task()
    make_batch, training_loss = task.make_batch, task.training_loss

    quiet_dtensor_logs()
    import transformers  # noqa: F401  (part of the fixed cost, as in the main job)

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp")) if shard else None
    gc.collect()
    fixed, _ = _rss_mib()
    model, tok = load_model(MINILM)
    if mesh is not None:
        parallelize(model, mesh, MINILM_TP_PLAN)
    gc.collect()
    loaded, _ = _rss_mib()
    _trim()
    loaded_trimmed, _ = _rss_mib()
    live = live_tensor_mib()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = make_batch(MINILM, tok, sentences()[:16])
    loss = training_loss("embedding", model, batch)
    loss.backward()
    opt.step()
    del loss
    gc.collect()
    after, peak = _rss_mib()
    _trim()
    after_trimmed, _ = _rss_mib()
    params = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    return {"fixed_mib": fixed, "loaded_mib": loaded, "loaded_trimmed_mib": loaded_trimmed, "after_step_mib": after,
            "after_step_trimmed_mib": after_trimmed, "peak_mib": peak, "live_tensor_mib": live,
            "param_mib": params / 2**20, "rank": rank}


def rss_phase(tp: int = 2, timeout: float = 600.0) -> dict[str, Any]:
    """Per-rank RSS of the tplower path at ``tp`` ranks against one process (fresh processes each).

    Target of issue 6: a tp rank's RSS after sharding and a step at most the
    fixed runtime cost plus 60% of the one-process run's model memory (its
    RSS above the fixed cost).
    """
    one = run_processes(1, rss_rank, False, timeout=timeout)[0]
    ranks = run_processes(tp, rss_rank, True, timeout=timeout)
    worst = max(ranks, key=lambda r: r["after_step_mib"])
    fixed = max(r["fixed_mib"] for r in [one, *ranks])
    model_mem = one["after_step_mib"] - one["fixed_mib"]
    return {"tp": tp, "one_mib": one["after_step_mib"], "one_peak_mib": one["peak_mib"],
            "fixed_mib": fixed, "param_mib": one["param_mib"], "tp_param_mib": worst["param_mib"],
            "tp_rank_mib": worst["after_step_mib"], "tp_loaded_mib": worst["loaded_mib"],
            "tp_peak_mib": worst["peak_mib"], "tp_live_tensor_mib": worst["live_tensor_mib"],
            "one_live_tensor_mib": one["live_tensor_mib"], "one_model_mib": model_mem,
            "target_mib": fixed + 0.6 * model_mem,
            "one": one, "ranks": ranks}


def model_phase(rounds: int, *, tp: int = 2, timeout: float = 900.0, compile_backend: str | None = None,
                device: str = "cpu", backend: str | None = None, rss: bool = True,
                progress: Callable[[str], None] = lambda _: None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Model timing rows (:func:`model_rank`: all-MiniLM-L6-v2; with ``compile_backend`` compiled rows, and
    llama-tiny's too) and the RSS figures (:func:`rss_phase`; CPU only).

    ``device="cuda"``: one GPU per rank (``rank % count``), on ``backend`` (default NCCL, which refuses two
    ranks on one GPU; gloo carries CUDA tensors through the host), and no RSS figures (``{}``), as with
    ``rss=False``.

    Raises:
        tplower.run.models.MissingPackageError: transformers or the MiniLM
            package is missing (the model phase needs them).
        ValueError: ``device`` is neither ``cpu`` nor ``cuda``, or ``backend`` neither ``gloo`` nor ``nccl``.
    """
    from ..run.models import LLAMA_TINY, MINILM, model_spec

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}; allowed: cpu, cuda")
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend not in ("gloo", "nccl") or (backend == "nccl" and device == "cpu"):
        raise ValueError(f"backend={backend!r} for device={device!r}; allowed: gloo, nccl (cuda only)")
    model_spec(MINILM)  # a clear error naming the package, before any process starts
    rows: list[dict[str, Any]] = []
    for name in (MINILM, LLAMA_TINY) if compile_backend is not None else (MINILM,):
        progress(f"model: {name} step time and its communication floor, tp={tp}, {device}, {backend}")
        rows += run_processes(tp, model_rank, rounds, 1, compile_backend, name, True, device, backend=backend,
                              timeout=timeout)[0]
    if device == "cuda" or not rss:
        return rows, {}
    progress("model: resident memory per rank")
    return rows, rss_phase(tp, timeout=timeout)
