"""Where tplower's time goes beyond the bare collective, for ``P(sum)->R`` and ``S(0)->S(1)`` on 2 gloo ranks.

Each row is timed interleaved with the others in the same two processes
(each round in a fresh random order, the same on both ranks, so no row
always follows the same neighbour; a barrier before each call, rank 0's clock), so machine
noise hits every row alike. The rows split tplower's call into what any
correct implementation must do and what is tplower's own:

* ``P(sum)->R``: the bare in-place ``all_reduce`` of a preallocated buffer
  (the practical limit, but it overwrites its input), ``clone`` then
  ``all_reduce`` (the floor for an op that must not modify its input: a fresh
  output is unavoidable), and ``redistribute_local``.
Both also time tplower's bound collective step alone (the program looked
up beforehand), which separates the per-call dispatch from the data path.

* ``S(0)->S(1)``: the bare ``all_to_all_single`` of preallocated buffers, the
  unavoidable layout copy alone (``movedim(...).contiguous()`` of the send
  blocks), both together as a hand-written call would run them, and
  ``redistribute_local``.

A last row per transition runs the floor after 10 µs of pure Python work,
about tplower's per-call dispatch (``profile_dispatch.py``): on a machine
whose cores the ranks and gloo's threads share, it shows what that much CPU
time before a collective costs in wall time.

Prints medians and 10th percentiles in microseconds and each row's ratio to
its floor::

    python benchmarks/profile_gap.py [--rows 512] [--cols 512] [--reps 400]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import start_processes


def _calls(rows: int, cols: int) -> dict[str, Callable[[], object]]:
    from torch.distributed.device_mesh import init_device_mesh

    from tplower import mesh_lowerer, redistribute_local

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    group = mesh.get_group("tp")
    x = torch.randn(rows, cols)
    buf = x.clone()
    half = torch.randn(rows // 2, cols)
    ar = mesh_lowerer(mesh).program("P(sum)", "R", x.shape, "cpu").forward[0]
    a2a = mesh_lowerer(mesh).program("S(0)", "S(1)", half.shape, "cpu").forward[0]
    send, recv = torch.empty(2, rows // 2, cols // 2), torch.empty(2, rows // 2, cols // 2)

    def clone_all_reduce() -> object:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    def layout_copy() -> object:
        return half.unflatten(1, (2, cols // 2)).movedim(1, 0).contiguous()

    def copy_all_to_all() -> object:
        s = half.unflatten(1, (2, cols // 2)).movedim(1, 0).contiguous()
        r = torch.empty_like(s)
        dist.all_to_all_single(r, s, group=group)
        return r.flatten(0, 1)

    def spin(fn: Callable[[], object]) -> Callable[[], object]:
        def call() -> object:  # the floor after 10 µs of pure CPU work: what dispatch time alone costs here
            end = time.perf_counter() + 10e-6
            while time.perf_counter() < end:
                pass
            return fn()
        return call

    return {
        "P(sum)->R  all_reduce in place (preallocated)": lambda: dist.all_reduce(buf, group=group),
        "P(sum)->R  clone + all_reduce (floor)": clone_all_reduce,
        "P(sum)->R  10 µs CPU + floor": spin(clone_all_reduce),
        "P(sum)->R  tplower's bound step alone": lambda: ar(x),
        "P(sum)->R  redistribute_local": lambda: redistribute_local(x, mesh, "P(sum)", "R"),
        "S(0)->S(1) all_to_all_single (preallocated)": lambda: dist.all_to_all_single(recv, send, group=group),
        "S(0)->S(1) layout copy alone": layout_copy,
        "S(0)->S(1) layout copy + all_to_all_single (floor)": copy_all_to_all,
        "S(0)->S(1) 10 µs CPU + floor": spin(copy_all_to_all),
        "S(0)->S(1) tplower's bound step alone": lambda: a2a(half),
        "S(0)->S(1) redistribute_local": lambda: redistribute_local(half, mesh, "S(0)", "S(1)"),
    }


def _rank(rank: int, init: str, rows: int, cols: int, reps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        calls = _calls(rows, cols)
        samples: dict[str, list[float]] = {k: [] for k in calls}
        order = list(calls.items())
        rng = random.Random(0)  # the same order on both ranks
        with torch.no_grad():
            for i in range(reps + 20):
                rng.shuffle(order)
                for name, fn in order:
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    dt = time.perf_counter() - t0
                    if i >= 20:
                        samples[name].append(dt * 1e6)
        if rank == 0:
            _report(samples, rows, cols, reps)
    finally:
        dist.destroy_process_group()


def _report(samples: dict[str, list[float]], rows: int, cols: int, reps: int) -> None:
    def p10(v: list[float]) -> float:
        return sorted(v)[len(v) // 10]

    floors = {"P(sum)->R ": "P(sum)->R  clone + all_reduce (floor)",
              "S(0)->S(1)": "S(0)->S(1) layout copy + all_to_all_single (floor)"}
    print(f"{rows}x{cols} float32 global, 2 gloo ranks, {reps} interleaved rounds, no grad")
    print(f"{'call':52s} {'median µs':>10s} {'p10 µs':>8s} {'/floor':>7s} {'/floor p10':>10s}")
    for name, v in samples.items():
        floor = samples[floors[name[:10]]]
        print(f"{name:52s} {statistics.median(v):10.0f} {p10(v):8.0f} "
              f"{statistics.median(v) / statistics.median(floor):7.2f} {p10(v) / p10(floor):10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512, help="global rows (default 512)")
    parser.add_argument("--cols", type=int, default=512, help="global columns, even (default 512)")
    parser.add_argument("--reps", type=int, default=400, help="timed rounds (default 400)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        start_processes(_rank, args=(init, args.rows, args.cols, args.reps), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
