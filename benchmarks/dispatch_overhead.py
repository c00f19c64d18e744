"""The cost of ``redistribute_local``'s convenience call, in every placement spelling, against a hand-written Function.

Feeds benchmarks/README.md ("Reaching the program: the call cache", "Every placement spelling at the
fast path"), indexed in docs/benchmarks.md ("Where each number comes from").

On the ``fake`` backend (collectives return at once, no data moves), one
process pretending to be rank 0 of ``--world`` ranks, these callables run the
same collective on the same local tensor:

* ``hand``: a minimal hand-written ``torch.autograd.Function`` around the raw
  collective (:mod:`tplower.bench.megatron`, Megatron's ``mappings.py`` style);
* ``seed op``: :meth:`tplower.TPExecutionOp.execute` (``replicated_grad="replicate"``);
* ``redistribute_local`` with the placements spelled each way a caller writes
  them (:data:`SPELLINGS`): strings (``"S(0)"``, ``"R"``), tuples and lists of
  PyTorch placements made beforehand, lists written in the call
  (``[Shard(0)]``, DTensor's idiom: new objects every call), and
  ``{axis: ...}`` mappings made beforehand or in the call.

Each call is timed on its own (``perf_counter_ns``), the callables interleaved
in a rotating order, ``--calls`` rounds after ``--warmup``; a run gives the
median per call in microseconds and the ratio to ``hand``. ``--runs N``
repeats the whole measurement N times in the same process and prints each
run's ratios and, per spelling, the median and range of the N ratios::

    python benchmarks/dispatch_overhead.py [--world 4] [--calls 3000] [--runs 5] [--mode fwd_grad] \
        [--cases "S(0)->R" ...]

``--mode``: ``fwd`` (no grad), ``fwd_grad`` (the input requires grad: a
training forward) or ``fwd_bwd`` (forward and backward). Nothing here is
asserted by a test; the numbers swing with the machine's load (run ``uptime``
beside it): read the ratios, which are measured within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

Call = Callable[[], object]

#: label -> how the placements are passed (``{p}`` is one placement's source text, ``{s}`` its string).
SPELLINGS: dict[str, str] = {
    "str": "{s!r}",
    "tuple": "ready",
    "list": "ready",
    "list in call": "[{p}]",
    "dict": "ready",
    "dict in call": "{{'tp': {s!r}}}",
}


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


def _source(p: Placement) -> str:
    """The Python a caller writes for ``p`` (``Shard(0)``, ``Replicate()``, ``Partial('sum')``)."""
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op!r})"
    return "Replicate()"


def _call_source(label: str, src: tuple[Placement, ...], dst: tuple[Placement, ...]) -> str:
    """The source of ``lambda t: redistribute_local(t, mesh, SRC, DST)``, placements spelled as ``label`` says."""
    from tplower.core.language.placements import format_placements

    def one(ps: tuple[Placement, ...], name: str) -> str:
        (p,) = ps  # one mesh axis
        if SPELLINGS[label] == "ready":
            return name
        return SPELLINGS[label].format(p=_source(p), s=format_placements(ps))

    return f"lambda t: redistribute_local(t, mesh, {one(src, 'SRC')}, {one(dst, 'DST')})"


def _ready(label: str, ps: tuple[Placement, ...]) -> object:
    """The placements made beforehand in spelling ``label`` (tuple, list or mapping)."""
    from tplower.core.language.placements import format_placements

    return {"tuple": ps, "list": list(ps), "dict": {"tp": format_placements(ps)}}.get(label)


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
    for label in SPELLINGS:
        names = {"redistribute_local": redistribute_local, "mesh": mesh, "Shard": Shard, "Replicate": Replicate,
                 "Partial": Partial, "SRC": _ready(label, s.src), "DST": _ready(label, s.dst)}
        fn = eval(_call_source(label, s.src, s.dst), names)  # the call as a caller writes it
        out[label] = _autograd_call(fn, _leaf(s.local, mode), s.grad_out, mode)
    return out


def _report(case_name: str, runs: list[dict[str, float]]) -> None:
    names = list(runs[0])
    for i, got in enumerate(runs):
        hand = got["hand"]
        cells = "  ".join(f"{k} {v:6.2f}" + ("" if k == "hand" else f" ({v / hand:.2f}x)") for k, v in got.items())
        print(f"  {case_name:12s} run {i + 1}: {cells}")
    if len(runs) > 1:
        print(f"  {case_name:12s} ratio to hand over {len(runs)} runs, median (min-max):")
        for k in names[1:]:
            ratios = [r[k] / r["hand"] for r in runs]
            print(f"    {k:14s} {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="ranks the fake group pretends to have (default 4)")
    parser.add_argument("--calls", type=int, default=3000, help="timed rounds, one call of each per round")
    parser.add_argument("--warmup", type=int, default=300, help="untimed rounds first (default 300)")
    parser.add_argument("--runs", type=int, default=1, help="repeat the measurement this many times (default 1)")
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
    load = os.getloadavg()[0]
    print(f"fake backend, world {args.world}, mode {args.mode}, median of {args.calls} interleaved calls (us), "
          f"load {load:.1f} at start")
    for case_name in args.cases:
        calls = _calls(case_name, mesh, args.mode)
        _report(case_name, [_interleave(calls, args.calls, args.warmup) for _ in range(args.runs)])
    print(f"load {os.getloadavg()[0]:.1f} at end")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
