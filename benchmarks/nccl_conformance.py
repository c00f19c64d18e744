"""A conformance subset against DTensor on CUDA tensors over NCCL, one torchrun rank per process.

Feeds docs/compile.md ("On a GPU") as the conformance step of ``benchmarks/device_check.sh``, which runs
it; ``tests/test_device_check.py`` runs it on CPU.

    torchrun --standalone --nproc-per-node 2 benchmarks/nccl_conformance.py --out conformance.json

Each rank takes GPU ``LOCAL_RANK % device_count`` and checks (:mod:`tplower.conformance`:
forward and backward against DTensor, every rank):

* every pair of ``R``, ``S(0)``, ``S(1)``, ``P(sum)``, ``P(avg)``, ``P(max)`` with
  every gradient placement, on shapes ``(4, 6)`` (even), ``(5, 3)`` and ``(7,)``
  (uneven), float32, on a 1-D mesh of every rank;
* 40 random cases (float32, float64, bfloat16; some non-contiguous);
* with 4 or more ranks (an even count), 40 random cases on a 2 x N/2 mesh.

Rank 0 writes the counts and every failure as JSON to ``--out``; the exit
status is 1 when a case failed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from tplower.conformance import check_cases, failures, make_mesh, one_axis_cases, random_cases, summarize


def main() -> int:
    """Check the subset on this rank; rank 0 writes the report. Returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="conformance.json", help="JSON report (rank 0)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda: NCCL (default); cpu: gloo, to try the script without a GPU")
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("nccl_conformance: no CUDA device; run it on a GPU machine under torchrun", file=sys.stderr)
        return 2
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    placements = ("R", "S(0)", "S(1)", "P(sum)", "P(avg)", "P(max)")
    one_d = [c for c in one_axis_cases((world,), 0, placements, ((4, 6), (5, 3)))]
    one_d += [c for c in one_axis_cases((world,), 0, ("R", "S(0)", "P(sum)"), ((7,),))]
    suites = {"1d": one_d, "1d_random": random_cases(1, 40, (world,))}
    if world >= 4 and world % 2 == 0:
        suites["2d_random"] = random_cases(2, 40, (2, world // 2))
    report: dict[str, object] = {"world": world, "backend": dist.get_backend(), "torch": torch.__version__,
                                 "gpus": torch.cuda.device_count() if cuda else 0,
                                 "gpu": torch.cuda.get_device_name() if cuda else None}
    failed = 0
    for name, cases in suites.items():
        shape = cases[0].mesh_shape
        meshes = {shape: make_mesh(shape, args.device)}
        mine = check_cases(rank, world, cases, meshes)
        gathered: list[object] = [None] * world
        dist.all_gather_object(gathered, mine)
        results = [list(r) for r in gathered]  # type: ignore[call-overload]
        bad = failures(results)
        failed += len(bad)
        report[name] = {"counts": summarize(results), "failures": bad[:50]}
    report["seconds"] = round(time.perf_counter() - t0, 1)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(json.dumps({k: (v["counts"] if isinstance(v, dict) else v) for k, v in report.items()}, indent=1))
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
