"""The memory phase of ``tplower bench``: the extra bytes one call allocates, forward and backward.

:func:`peak_bytes` measures one call (the torch profiler's allocation
timeline on CPU, ``max_memory_allocated`` on CUDA); :func:`memory_rows`
measures tplower, DTensor and the raw collective per transition against the
target (the output plus one padded staging buffer; the input gradient plus
one in backward).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree
from torch.distributed.device_mesh import DeviceMesh

from ..planner.memory import LiveTensors
from ..run.quiet import filtered_stderr
from .cases import Case, dtensor_leaf, raw_call, setup

if TYPE_CHECKING:
    from .config import BenchConfig

__all__ = ["memory_rows", "peak_bytes", "peak_tensor_bytes", "profiler_peak_bytes"]


def peak_bytes(fn: Callable[[], object], device: torch.device) -> tuple[int, object]:
    """Peak extra bytes allocated while ``fn()`` runs (its result kept alive), and the result.

    CPU: the running sum of the torch profiler's memory events
    (``profile_memory=True``; its allocation timeline where available),
    ordered by time; CUDA:
    ``max_memory_allocated`` above what was allocated before. The
    profiler's own status lines (``profiler_start``/``profiler_stop``, two
    per call) are kept off the terminal (:func:`tplower.run.quiet.filtered_stderr`);
    everything else on stderr passes.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base), out
    from torch.profiler import ProfilerActivity, profile

    with filtered_stderr():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            out = fn()
        try:  # exact: every allocation and free, in order (the profiler's memory timeline)
            timeline = prof._memory_profile().timeline
            deltas = [(t, size if action.name == "CREATE" else -size) for t, action, _, size in timeline
                      if action.name in ("CREATE", "DESTROY") and t >= 0]
        except (AttributeError, RuntimeError, ValueError):  # coarser: each op's own net bytes at its start
            deltas = [(ev.time_range.start, int(ev.self_cpu_memory_usage)) for ev in prof.events()]
    return _running_peak(deltas), out


def _running_peak(deltas: list[tuple[int, int]]) -> int:
    """The highest running sum of ``(time, bytes allocated or, negative, freed)`` in time order (0 at least)."""
    running = peak = 0
    for _, delta in sorted(deltas, key=lambda d: d[0]):
        running += delta
        peak = max(peak, running)
    return peak


def peak_tensor_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """Peak bytes of the tensor storages created while ``fn()`` runs and alive at once, and its result.

    Every op's new output storage is counted once (views add nothing) until
    it is freed; forward and backward both (the autograd engine carries the
    dispatch mode into backward on CPU). Tensors that existed before (the
    parameters) are not counted. Works where the profiler's memory timeline
    does not (it refuses some backward traces on torch 2.13).
    """
    mode = LiveTensors()  # the layout planner's tracker: every new storage counted once, until freed
    with mode:
        out = fn()
    return mode.peak, out


def profiler_peak_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """Peak bytes allocated on CPU while ``fn()`` runs, above what was allocated before, and its result.

    The running sum, in time order, of the torch profiler's ``[memory]``
    events (``profile_memory=True``: each allocation's and free's bytes, as
    the allocator reports them). Unlike :func:`peak_tensor_bytes`, which
    sees the storages ops create at the dispatcher, it also sees the buffers
    code compiled by inductor allocates itself; unlike :func:`peak_bytes` it
    needs no memory timeline (no shapes or stacks recorded: cheap over a
    long train step). Compare two calls with this function on both sides.
    """
    from torch.profiler import ProfilerActivity, profile

    with filtered_stderr():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
    assert prof.profiler is not None and prof.profiler.kineto_results is not None  # set when the profile stops
    events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return _running_peak(sorted(events)), out  # (at one time, frees before allocations)


def _memory_calls(case: Case, s: Any, impl: str) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """(forward under no grad, backward of a fresh forward's output) of ``impl``."""
    from torch.distributed.tensor import distribute_tensor

    from ..core.lower.redistribute import redistribute_local

    if impl == "raw":
        fwd_raw, bwd_raw = raw_call(s.fwd, s.mesh, s.local.device), raw_call(s.bwd, s.mesh, s.local.device)
        return fwd_raw, lambda _: bwd_raw
    if impl == "tplower":
        x = s.local.detach().clone().requires_grad_(True)

        def fwd() -> Any:
            with torch.no_grad():
                return redistribute_local(x, s.mesh, s.src, s.dst)

        def fwd_graph() -> Any:
            return redistribute_local(x, s.mesh, s.src, s.dst)
        leaf, g = x, s.grad_out
    else:
        dt = dtensor_leaf(torch.zeros(s.gshape, device=s.local.device), s.mesh, s.src, True)
        g = distribute_tensor(torch.zeros(s.gshape, device=s.local.device), s.mesh, s.grad)

        def fwd() -> Any:
            with torch.no_grad():
                return dt.redistribute(s.mesh, s.dst)

        def fwd_graph() -> Any:
            return dt.redistribute(s.mesh, s.dst)
        leaf = dt

    def bwd_of(_: Any) -> Any:
        y = fwd_graph()
        return lambda: torch.autograd.grad(y, leaf, g)
    return fwd, bwd_of


def memory_rows(cfg: BenchConfig, meshes: dict[tuple[int, ...], DeviceMesh], world: int, device: torch.device,
                cases: Sequence[Case]) -> list[dict[str, Any]]:
    """Peak extra bytes per call of tplower and DTensor, forward and backward, at ``cfg.memory_size``.

    ``raw`` (preallocated buffers) shows what the backend itself allocates
    inside the collective. Targets: forward ``out_bytes`` plus one padded
    staging buffer (the largest buffer a step moves); backward the input
    gradient plus one such buffer.
    """
    rows: list[dict[str, Any]] = []
    for case in cases:
        s = setup(case, meshes[case.mesh_shape(world)], cfg.memory_size, device)
        el = s.local.element_size()
        out_bytes = _numel(s.fwd[-1].out_shape if s.fwd else s.local.shape) * el
        in_bytes = s.local.numel() * el
        staging = max([max(_numel(st.in_shape), _numel(st.out_shape)) * el for st in s.fwd] or [0])
        bstaging = max([max(_numel(st.in_shape), _numel(st.out_shape)) * el for st in s.bwd] or [0])
        for impl in ("raw", "tplower", "dtensor"):
            fwd, bwd_of = _memory_calls(case, s, impl)
            fwd()  # warm: plans, caches, DTensor's sharding propagation
            bwd_of(None)()
            f_peak, out = peak_bytes(fwd, device)
            del out
            run_bwd = bwd_of(None)
            b_peak, _ = peak_bytes(run_bwd, device)
            rows.append({"world": world, "case": case.name, "size": cfg.memory_size, "impl": impl, "fwd_peak": f_peak,
                         "bwd_peak": b_peak, "out_bytes": out_bytes, "in_bytes": in_bytes,
                         "fwd_target": out_bytes + staging, "bwd_target": in_bytes + bstaging})
    return rows


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
