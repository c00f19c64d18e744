"""``tplower bench --calibrate``: this machine's profile for the planner's time model, measured.

:func:`calibrate` measures, on ``world`` spawned ranks of the default backend (gloo on CPU, NCCL with
``device="cuda"``):

* the matmul rate (FLOP/s) of a ``[n, n] @ [n, n]`` product in float32 and in bfloat16, on one rank;
* the cost of one operator call: a loop of tiny ``add``s (their arithmetic is nothing), seconds per call;
* each collective (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``) at two sizes over all the
  ranks: from the two times, bandwidth = extra bytes sent (the ring conventions of
  :class:`tplower.core.lower.traffic.CollectiveTraffic`) / extra seconds, latency = what is left of the small
  size's time per ring step; the :class:`~tplower.planner.profile.Link` is the median over the kinds.

The ranks share one machine, so the link is written as both ``intra`` and ``inter`` (there is no other node to
measure). Each time is the median of ``reps`` calls after a warm-up.
"""

from __future__ import annotations

import datetime
import functools
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .profile import DeviceProfile, Link

__all__ = ["calibrate"]

_SMALL, _LARGE = 4 * 1024, 4 * 1024 * 1024  # bytes of the collectives' float32 tensors


def _median_seconds(fn: Any, reps: int, sync: Any) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(rank: int, world: int, device: str, reps: int) -> dict[str, Any] | None:
    torch.set_num_threads(1)
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(dev)) if device == "cuda" else (lambda: None)
    out: dict[str, Any] = {}
    if rank == 0:
        n = 1024 if device == "cuda" else 256
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
            out[str(dtype)] = 2 * n**3 / _median_seconds(lambda a=a, b=b: a @ b, reps, sync)
        x = torch.zeros(4, device=dev)

        def adds() -> None:
            for _ in range(200):
                torch.add(x, 1)
        out["op_seconds"] = _median_seconds(adds, max(3, reps // 4), sync) / 200
    links: dict[str, tuple[float, float]] = {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        times, sent = [], []
        for nbytes in (_SMALL, _LARGE):
            numel = nbytes // 4
            t = torch.ones(numel, device=dev)
            fn: Callable[[], None]
            if kind == "all_reduce":
                fn = functools.partial(dist.all_reduce, t)
                sent.append(2 * (world - 1) * nbytes / world)
            elif kind == "all_gather":
                outs = torch.empty(numel * world, device=dev)

                gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                fn = functools.partial(gather, outs, t)
                sent.append((world - 1) * nbytes)
            elif kind == "reduce_scatter":
                piece = torch.empty(numel // world, device=dev)
                if dist.get_backend() == "gloo":  # gloo has no reduce_scatter: tplower's remap, all_reduce + chunk
                    def remapped(t: torch.Tensor = t, p: torch.Tensor = piece) -> None:
                        dist.all_reduce(t)
                        p.copy_(t.chunk(world)[rank])
                    fn = remapped
                else:
                    fn = functools.partial(dist.reduce_scatter_tensor, piece, t)
                sent.append((world - 1) * nbytes / world)
            else:
                fn = functools.partial(dist.all_to_all_single, torch.empty_like(t), t)
                sent.append((world - 1) * nbytes / world)
            dist.barrier()
            times.append(_median_seconds(fn, reps, sync))
        steps = 2 * (world - 1) if kind == "all_reduce" else world - 1
        bandwidth = (sent[1] - sent[0]) / max(times[1] - times[0], 1e-9)
        latency = max(times[0] - sent[0] / bandwidth, 0.0) / steps
        links[kind] = (latency, bandwidth)
    out["links"] = links
    return out if rank == 0 else None


def calibrate(world: int = 2, *, device: str = "cpu", reps: int = 20, timeout: float = 600.0) -> DeviceProfile:
    """Measure this machine (see the module docstring) and return its profile.

    Args:
        world: ranks to spawn for the collectives (at least 2).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU a rank).
        reps: timed calls per measurement.

    Raises:
        ValueError: ``world`` below 2 or ``device`` another.
        tplower.testing.RankFailure: a rank failed.
    """
    from ..testing import run_processes

    if world < 2:
        raise ValueError(f"calibrate: world={world} must be at least 2 (the collectives need two ranks)")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"calibrate: device={device!r}: use 'cpu' or 'cuda'")
    got = run_processes(world, _rank, device, reps, backend="nccl" if device == "cuda" else "gloo",
                        timeout=timeout)[0]
    lat = statistics.median(v[0] for v in got["links"].values())
    bw = statistics.median(v[1] for v in got["links"].values())
    link = Link(lat, bw)
    memory = None
    if device == "cuda":
        memory = torch.cuda.get_device_properties(0).total_memory
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return DeviceProfile(
        name=f"calibrated {platform.node() or 'machine'}", flops=got[str(torch.bfloat16)],
        flops_fp32=got[str(torch.float32)], intra=link, inter=link, op_seconds=got["op_seconds"], device=device,
        memory=memory,
        source=f"measured: tplower bench --calibrate on {platform.node()} ({platform.machine()}), {device}, "
               f"{world} ranks, {when}; one machine, so inter = intra",
        extra={"links": {k: {"latency_s": v[0], "bandwidth": v[1]} for k, v in got["links"].items()}})
