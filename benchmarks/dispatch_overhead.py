"""The cost of ``redistribute_local``'s convenience call against a hand-written autograd Function, per call.

On the ``fake`` backend (collectives return at once, no data moves), one
process pretending to be rank 0 of ``--world`` ranks, three callables run the
same collective on the same local tensor:

* ``hand``: a minimal hand-written ``torch.autograd.Function`` around the raw
  collective (:mod:`tplower.bench.megatron`, Megatron's ``mappings.py`` style);
* ``seed op``: :meth:`tplower.TPExecutionOp.execute` (``replicated_grad="replicate"``);
* ``redistribute_local``: ``tplower.redistribute_local(x, mesh, src, dst)`` with
  the placements as strings (``"S(0)"``, ``"R"``), the convenience call;
* ``redistribute_local (objects)``: the same with PyTorch placement tuples.

Each call is timed on its own (``perf_counter_ns``), the callables interleaved
in a rotating order, ``--calls`` rounds after ``--warmup``; the table gives
the median per call in microseconds and the ratio to ``hand``::

    python benchmarks/dispatch_overhead.py [--world 4] [--calls 3000] [--mode fwd_grad] [--cases "S(0)->R" ...]

``--mode``: ``fwd`` (no grad), ``fwd_grad`` (the input requires grad: a
training forward) or ``fwd_bwd`` (forward and backward). Nothing here is
asserted by a test; the numbers swing with the machine's load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

Call = Callable[[], object]


def _interleave(calls: dict[str, Call], rounds: int, warmup: int) -> dict[str, float]:
    """Median microseconds per call of each callable, timed one call at a time in a rotating order."""
    names = list(calls)
    samples: dict[str, list[int]] = {n: [] for n in names}
    clock = time.perf_counter_ns
    for i in range(warmup + rounds):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            fn = calls[name]
            t0 = clock()
            fn()
            t1 = clock()
            if i >= warmup:
                samples[name].append(t1 - t0)
    return {n: statistics.median(v) / 1e3 for n, v in samples.items()}


def _calls(case_name: str, mesh: object, mode: str) -> dict[str, Call]:
    from tplower.bench.cases import CASES, _autograd_call, _leaf, build, setup
    from tplower.core.lower.redistribute import redistribute_local

    case = next(c for c in CASES if c.name == case_name)
    s = setup(case, mesh, 16 * 16 * 4 * mesh.size(), torch.device("cpu"))  # type: ignore[attr-defined]
    out: dict[str, Call] = {}
    for label, impl in (("hand", "megatron"), ("seed op", "seed_op")):
        fn = build(impl, case, s, mode)
        if fn is not None:
            out[label] = fn
    src_s, dst_s, src_p, dst_p = case.src, case.dst, s.src, s.dst
    out["redistribute_local"] = _autograd_call(
        lambda t: redistribute_local(t, mesh, src_s, dst_s), _leaf(s.local, mode), s.grad_out, mode
    )
    out["redistribute_local (objects)"] = _autograd_call(
        lambda t: redistribute_local(t, mesh, src_p, dst_p), _leaf(s.local, mode), s.grad_out, mode
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="ranks the fake group pretends to have (default 4)")
    parser.add_argument("--calls", type=int, default=3000, help="timed rounds, one call of each per round")
    parser.add_argument("--warmup", type=int, default=300, help="untimed rounds first (default 300)")
    parser.add_argument("--mode", default="fwd_grad", choices=("fwd", "fwd_grad", "fwd_bwd"))
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["S(0)->R", "P(sum)->R", "S(0)->S(1)"],
        help="1-D transitions of tplower.bench.cases.CASES (default: S(0)->R P(sum)->R S(0)->S(1))",
    )
    args = parser.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (args.world,), mesh_dim_names=("tp",))
    print(f"fake backend, world {args.world}, mode {args.mode}, median of {args.calls} interleaved calls (us)")
    for case_name in args.cases:
        got = _interleave(_calls(case_name, mesh, args.mode), args.calls, args.warmup)
        hand = got.get("hand")
        cells = "  ".join(
            f"{k} {v:6.2f}" + (f" ({v / hand:.2f}x)" if hand and k != "hand" else "") for k, v in got.items()
        )
        print(f"  {case_name:12s} {cells}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
