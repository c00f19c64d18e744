"""The model phase of ``tplower bench``: a real model's step time, and per-rank resident memory.

Timing (:func:`model_rank`): all-MiniLM-L6-v2 (the main job's model and plan,
:data:`tplower.run.models.MINILM_TP_PLAN`) in five copies on every rank of one
``tp`` group, interleaved round by round:

* ``one_process``: the unsharded model (every rank runs its own copy at the
  same time, so the machine is as loaded as in the parallel runs);
* ``tplower``: :func:`tplower.parallelize` (the main job's tplower path);
* ``codegen``: the same plan through its generated forwards
  (:func:`tplower.codegen.emit` then :func:`tplower.codegen.install`);
* ``dtensor``: ``parallelize_module`` with Colwise/RowwiseParallel;
* ``megatron``: the same plan written by hand in Megatron's style
  (:func:`megatronize`: plain autograd Functions with the collectives in).

Memory (:func:`rss_phase`): per-rank resident set size of the tplower path
at ``tp=2`` against one process, with the runtime's fixed cost (imports,
process group) measured before any model is loaded.
"""

from __future__ import annotations

import gc
import resource
import statistics
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from ..conformance import quiet_dtensor_logs
from ..testing import run_processes

__all__ = ["megatronize", "model_phase", "model_rank", "rss_phase", "rss_rank"]


class _CopyToTP(torch.autograd.Function):
    """``R -> R``, grad ``P``: identity forward, all_reduce backward (Megatron's ``copy_to_tp_region``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """``P -> R``, grad ``R``: all_reduce forward, identity backward (Megatron's ``reduce_from_tp_region``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return g, None


def _colwise_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(_CopyToTP.apply(x, self._tp_group), self.weight, self.bias)


def _rowwise_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _ReduceFromTP.apply(F.linear(x, self.weight), self._tp_group)
    return out if self.bias is None else out + self.bias


def megatronize(model: nn.Module, plan: dict[str, Any], group: ProcessGroup) -> nn.Module:
    """Shard ``model``'s ``nn.Linear`` modules by ``plan`` (``colwise``/``rowwise``) by hand, in place.

    Column-parallel: rows of the weight and bias, input through ``_CopyToTP``.
    Row-parallel: columns of the weight, output through ``_ReduceFromTP``,
    bias added once after the reduction. Head counts are made local.

    Raises:
        ValueError: a plan value other than ``colwise``, ``rowwise`` or a
            ``local_attrs`` entry, or a module that is not ``nn.Linear``.
    """
    from ..run.models import check_plan_modules, localize_heads

    n, rank = dist.get_world_size(group), dist.get_rank(group)
    for key, names in check_plan_modules(model, plan).items():
        style = plan[key]
        if isinstance(style, dict) and set(style) == {"local_attrs"}:
            continue
        if style not in ("colwise", "rowwise"):
            raise ValueError(f"plan[{key!r}]={style!r}: the hand-written version knows colwise and rowwise")
        for name in names:
            mod = model.get_submodule(name)
            if not isinstance(mod, nn.Linear):
                raise ValueError(f"plan[{key!r}] matches {name} ({type(mod).__name__}), not an nn.Linear")
            dim = 0 if style == "colwise" else 1
            with torch.no_grad():
                mod.weight = nn.Parameter(mod.weight.chunk(n, dim)[rank].contiguous())
                if style == "colwise" and mod.bias is not None:
                    mod.bias = nn.Parameter(mod.bias.chunk(n, 0)[rank].contiguous())
            mod._tp_group = group  # type: ignore[assignment]
            fwd = _colwise_forward if style == "colwise" else _rowwise_forward
            mod.forward = types.MethodType(fwd, mod)  # type: ignore[method-assign]
    localize_heads(model, n)
    return model


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


def model_rank(rank: int, world: int, rounds: int, warmup: int = 1,
               compile_backend: str | None = None, model_name: str | None = None) -> list[dict[str, Any]]:
    """Time forward and training step of the copies on this rank (``tp = world``); rank 0 returns rows.

    ``model_name``: a model of ``tplower run`` (default all-MiniLM-L6-v2 and its shipped plan, in the five
    copies above; another, e.g. ``llama-tiny`` with its transformers plan, in three: ``one_process``,
    ``tplower``, ``dtensor``, as the code generator and the hand-written copy are written for MiniLM's plan).

    With ``compile_backend`` (e.g. ``"inductor"``), also ``tplower_compiled``
    and ``dtensor_compiled``: ``torch.compile`` of those two copies (sharing
    their parameters and optimizers), timed in the same rounds; the warm-up
    round compiles them. Each round runs the copies in turn, in the reverse
    order every other round; each copy's timed forward follows an untimed one
    of its own, so it does not pay for the copy before it.

    Rows: ``model``, ``tp``, ``variant``, ``forward_ms`` and
    ``train_step_ms`` (medians) and their samples.
    """
    from ..codegen.emit import emit, install
    from ..nn.parallelize import parallelize
    from ..run.models import MINILM, load_model, model_spec, sentences
    from ..run.paths import parallelize_dtensor

    task = _task()
    make_batch, model_output, training_loss = task.make_batch, task.model_output, task.training_loss
    name = model_name or MINILM
    spec = model_spec(name)
    plan, kind = spec.plan, spec.task

    quiet_dtensor_logs()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    models: dict[str, nn.Module] = {}
    models["one_process"], tok = load_model(name)
    models["tplower"] = parallelize(load_model(name)[0], mesh, plan)
    if name == MINILM:
        models["codegen"] = install(load_model(name)[0], mesh, emit(models["one_process"], mesh, plan))
    models["dtensor"] = load_model(name)[0]
    parallelize_dtensor(models["dtensor"], mesh, plan)
    if name == MINILM:
        models["megatron"] = megatronize(load_model(name)[0], dict(plan), mesh.get_group("tp"))
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    if compile_backend is not None:
        for key in ("tplower", "dtensor"):
            models[f"{key}_compiled"] = torch.compile(models[key], backend=compile_backend)  # type: ignore[assignment]
            opts[f"{key}_compiled"] = opts[key]
    batch = make_batch(name, tok, sentences()[:16])

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
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                if r >= warmup:
                    samples[key][what].append(time.perf_counter() - t0)
    if rank != 0:
        return []
    return [{"model": name, "tp": world, "variant": k, "forward_ms": _median_ms(v["forward"]),
             "train_step_ms": _median_ms(v["step"]), "forward_samples_ms": [s * 1e3 for s in v["forward"]],
             "step_samples_ms": [s * 1e3 for s in v["step"]]} for k, v in samples.items()]


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
                progress: Callable[[str], None] = lambda _: None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Model timing rows (:func:`model_rank`: all-MiniLM-L6-v2; with ``compile_backend`` compiled rows, and
    llama-tiny's too) and the RSS figures (:func:`rss_phase`).

    Raises:
        tplower.run.models.MissingPackageError: transformers or the MiniLM
            package is missing (the model phase needs them).
    """
    from ..run.models import LLAMA_TINY, MINILM, model_spec

    model_spec(MINILM)  # a clear error naming the package, before any process starts
    rows: list[dict[str, Any]] = []
    for name in (MINILM, LLAMA_TINY) if compile_backend is not None else (MINILM,):
        progress(f"model: {name} step time, tp={tp}")
        rows += run_processes(tp, model_rank, rounds, 1, compile_backend, name, timeout=timeout)[0]
    progress("model: resident memory per rank")
    return rows, rss_phase(tp, timeout=timeout)
