"""``tplower demo``: lower a few transitions on local gloo processes, check each against DTensor."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from ..core.support.errors import TPLowerError
from ..core.support.words import count
from .errors import positive_int
from .explain import parse_shape

if TYPE_CHECKING:
    from ..conformance import Case

#: (src, dst, grad) on a 1-D ``tp`` mesh; ``None`` grad is DTensor's default.
DEMO_TRANSITIONS: tuple[tuple[str, str, str | None], ...] = (
    ("S(0)", "R", None),
    ("S(0)", "R", "P(sum)"),
    ("P(sum)", "R", None),
    ("P(sum)", "S(0)", None),
    ("R", "S(1)", None),
    ("S(0)", "S(1)", None),
    ("P(avg)", "R", None),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--nproc`` ranks (default 2) and ``--shape`` of the global tensor."""
    parser.add_argument("--nproc", type=positive_int, default=2, help="local processes (gloo), default 2")
    parser.add_argument("--shape", default="7,6", help="global shape, comma separated (default 7,6: uneven)")


def _rank_body(rank: int, world: int, cases: list[Case]) -> list[dict[str, Any]]:
    from ..conformance import check_case, make_mesh, quiet_dtensor_logs
    from ..core.language.placements import parse_placements
    from ..core.lower.redistribute import mesh_lowerer

    quiet_dtensor_logs()
    mesh = make_mesh((world,))
    rows = []
    for case in cases:
        result = check_case(case, mesh)
        nd = len(case.global_shape)
        prog = mesh_lowerer(mesh).program(case.src, case.dst, _local_shape(case, rank, world), "cpu",
                                          grad=case.grad, global_shape=case.global_shape)
        plan = prog.plan
        label = f"{case.src}->{case.dst}" + (f" g={case.grad}" if case.grad else "")  # world, shape: in the title
        rows.append({"case": case.id, "transition": label, "status": result.status, "ok": result.ok,
                     "lowered": result.lowered,
                     "forward": "; ".join(s.op_str() for s in plan.forward) if plan else "dtensor",
                     "backward": "; ".join(s.op_str() for s in plan.backward) if plan else "dtensor",
                     "grad": ",".join(map(str, parse_placements(case.grad or "R", ("tp",), tensor_ndim=nd)))})
    return rows


def _local_shape(case: Case, rank: int, world: int) -> tuple[int, ...]:
    from ..core.language.placements import parse_placements
    from ..core.language.transitions import local_shape

    src = parse_placements(case.src, ("tp",), tensor_ndim=len(case.global_shape))
    return local_shape(case.global_shape, src, (world,), (rank,))


def demo_shape(text: str) -> tuple[int, ...]:
    """The global shape of ``--shape``: at least 2 dims (the demo shards dim 1), each at least 1.

    Raises:
        TPLowerError: anything else; the message names ``--shape`` and the fix.
    """
    shape = parse_shape(text, example="7,6")
    if len(shape) < 2 or min(shape) < 1:
        raise TPLowerError(f"--shape {text!r}: the demo shards dims 0 and 1, so it needs at least 2 dims of at "
                           "least 1 each, e.g. 7,6")
    return shape


def main(args: argparse.Namespace) -> int:
    """Run the demo; exit code 0 when every transition matched DTensor on every rank.

    Raises:
        TPLowerError: a bad ``--shape``, or an ``--nproc`` above what this machine allows (both checked before
            torch is imported and any process starts).
    """
    from ..run.checks import check_local_world

    shape = demo_shape(args.shape)
    check_local_world("--nproc", args.nproc)
    from ..conformance import Case
    from ..testing import run_processes

    cases = [Case((args.nproc,), shape, s, d, g) for s, d, g in DEMO_TRANSITIONS]
    procs = count(args.nproc, "gloo process", "gloo processes")
    print(f"tplower demo: {len(cases)} transitions of a {shape} float32 tensor on {procs}")
    t0 = time.perf_counter()
    per_rank = run_processes(args.nproc, _rank_body, cases)
    oks = [all(rows[i]["ok"] for rows in per_rank) for i in range(len(cases))]
    print("\n".join(demo_table(per_rank[0], oks)))
    all_ok = all(oks)
    print(f"{'all' if all_ok else 'NOT all'} {len(cases)} transitions match DTensor forward and backward on every "
          f"rank ({time.perf_counter() - t0:.1f} s)")
    return 0 if all_ok else 1


def demo_table(rows: list[dict[str, Any]], oks: list[bool]) -> list[str]:
    """The demo's table as lines: a header, then one line per transition of ``rows`` (rank 0's dicts with
    ``transition``, ``forward``, ``backward``, ``status``), its verdict failed where ``oks[i]`` (every rank) is false.
    Each column is as wide as its longest cell, so a long op such as ``reduce_scatter(dim=0, op=sum)`` keeps the
    next column aligned."""
    cells = [(r["transition"], r["forward"] or "identity", r["backward"] or "identity",
              r["status"] if ok else f"FAIL ({r['status']})") for r, ok in zip(rows, oks, strict=True)]
    head = ("transition", "forward", "backward", "vs DTensor")
    widths = [max(len(c[j]) for c in (head, *cells)) for j in range(3)]
    return [f"{c[0]:<{widths[0]}}  {c[1]:<{widths[1]}}  {c[2]:<{widths[2]}}  {c[3]}".rstrip() for c in (head, *cells)]
