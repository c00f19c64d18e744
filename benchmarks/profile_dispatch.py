"""Where tplower's per-call CPU time goes, on the ``fake`` backend (collectives move no data).

Feeds benchmarks/README.md ("Where tplower's per-call time goes") and
benchmarks/results/profile_dispatch.txt, listed in docs/benchmarks.md.

Prints microseconds per call (best of 5 repeats of N calls) for each layer of
``redistribute_local``: the mesh-lowerer lookup, the program cache, the
bound collective step alone, the step under ``LoweredTransition`` (autograd),
forward+backward, and a minimal hand-written ``autograd.Function`` around the
same collective for comparison::

    python benchmarks/profile_dispatch.py [--world 4] [--calls 20000]
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def _time(label: str, fn: Callable[[], object], calls: int) -> None:
    fn()
    best = min(timeit.repeat(fn, number=calls, repeat=5)) / calls * 1e6
    print(f"  {label:52s} {best:7.2f} us")


def _profile_case(case: Any, mesh: Any, calls: int) -> None:
    from tplower import mesh_lowerer, redistribute_local
    from tplower.bench.cases import build, setup

    low = mesh_lowerer(mesh)
    s = setup(case, mesh, 16 * 16 * 4 * mesh.size(), torch.device("cpu"))
    x, xg, g = s.local, s.local.clone().requires_grad_(), s.grad_out
    prog = low.program(case.src, case.dst, x.shape, "cpu")
    fwd_kinds = ", ".join(st.kind for st in s.fwd) or "identity"
    print(f"{case.name}: {fwd_kinds} | bwd {', '.join(st.kind for st in s.bwd) or 'identity'}")
    _time("mesh_lowerer(mesh)", lambda: mesh_lowerer(mesh), calls)
    _time("lowerer.program(...) (cache hit)", lambda: low.program(case.src, case.dst, x.shape, "cpu"), calls)
    _time("bound forward steps alone", lambda: [f(x) for f in prog.forward], calls)
    _time("bound backward steps alone", lambda: [f(g) for f in prog.backward], calls)
    _time("redistribute_local, no grad", lambda: redistribute_local(x, mesh, case.src, case.dst), calls)
    _time("redistribute_local, input requires grad", lambda: redistribute_local(xg, mesh, case.src, case.dst), calls)
    _time("tplower forward + backward", build("tplower", case, s, "fwd_bwd") or (lambda: None), calls)
    hand = build("megatron", case, s, "fwd_bwd")
    if hand is not None:
        _time("hand-written Function forward + backward", hand, calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="ranks the fake group pretends to have (default 4)")
    parser.add_argument("--calls", type=int, default=20000, help="calls per timing (default 20000)")
    args = parser.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    from torch.distributed.device_mesh import init_device_mesh

    from tplower.bench.cases import CASES

    mesh = init_device_mesh("cpu", (args.world,), mesh_dim_names=("tp",))
    for case in [c for c in CASES if c.mesh is None]:
        _profile_case(case, mesh, args.calls)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
