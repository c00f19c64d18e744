"""Move a tensor between layouts with ``tplower.redistribute_local``, and check it against DTensor.

Each rank holds its local piece of a (1001, 64) activation on a 1-D ``tp``
mesh of all ranks (1001 rows: uneven shards, cut as ``torch.chunk`` cuts).
Three transitions, each checked on every rank against the single-process
value and DTensor's ``redistribute``, forward and backward:

* ``S(0) -> R``: all_gather of the row shards (backward: this rank's rows);
* ``P(sum) -> S(0)``: reduce_scatter of partial sums (backward: all_gather);
* ``S(0) -> S(1)``: all_to_all from row shards to column shards.

Launch (gloo on CPU, nccl when CUDA is available)::

    torchrun --nproc-per-node 2 examples/redistribute.py
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard

import tplower

ROWS, COLS = 1001, 64
SUCCESS = "OK: tplower matches one process and DTensor, forward and backward, on every rank"


def dtensor_local(local: torch.Tensor, mesh: DeviceMesh, src: list[Partial | Shard], dst: list[Shard],
                  shape: tuple[int, int]) -> torch.Tensor:
    """DTensor's answer for the same move: ``from_local -> redistribute -> to_local``."""
    dt = DTensor.from_local(local, mesh, src, run_check=False, shape=torch.Size(shape), stride=(shape[1], 1))
    return dt.redistribute(mesh, dst).to_local()


def main() -> int:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)  # DTensor's note on its CPU all_to_all
    try:
        device = "cuda" if cuda else "cpu"
        mesh = init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("tp",))
        world, rank = mesh.size(), mesh.get_local_rank("tp")
        full = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0)).to(device)  # same on all ranks
        rows = full.chunk(world, 0)[rank]  # this rank's piece of S(0)

        # S(0) -> R: gather the rows. Uneven shards need global_shape (else every shard is taken as even).
        x = rows.clone().requires_grad_()
        y = tplower.redistribute_local(x, mesh, {"tp": "S(0)"}, {"tp": "R"}, global_shape=(ROWS, COLS))
        torch.testing.assert_close(y, full)
        weight = torch.arange(ROWS * COLS, dtype=torch.float32, device=device).reshape(ROWS, COLS)
        (y * weight).sum().backward()  # a replicated gradient: backward keeps this rank's rows of it
        assert x.grad is not None
        torch.testing.assert_close(x.grad, weight.chunk(world, 0)[rank])

        # P(sum) -> S(0): rank r holds (r + 1) * full, a partial sum; the total is full * (1 + 2 + ... + world).
        partial = (full * (rank + 1)).requires_grad_()
        z = tplower.redistribute_local(partial, mesh, "P(sum)", "S(0)")
        total = full * (world * (world + 1) // 2)
        torch.testing.assert_close(z, total.chunk(world, 0)[rank])
        torch.testing.assert_close(z, dtensor_local(partial.detach(), mesh, [Partial("sum")], [Shard(0)],
                                                    (ROWS, COLS)))
        z.sum().backward()  # backward: all_gather of the row gradients, the whole gradient on every rank
        assert partial.grad is not None
        torch.testing.assert_close(partial.grad, torch.ones_like(full))

        # S(0) -> S(1): trade row pieces for column pieces (one all_to_all).
        cols = tplower.redistribute_local(rows, mesh, "S(0)", "S(1)", global_shape=(ROWS, COLS))
        torch.testing.assert_close(cols, full.chunk(world, 1)[rank])
        torch.testing.assert_close(cols, dtensor_local(rows, mesh, [Shard(0)], [Shard(1)], (ROWS, COLS)))

        if rank == 0:
            names, shape = tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape)
            for src, dst in (("S(0)", "R"), ("P(sum)", "S(0)"), ("S(0)", "S(1)")):
                plan = tplower.plan_transition(tplower.parse_placements(src, names),
                                               tplower.parse_placements(dst, names), (ROWS, COLS), shape, (0,))
                print(plan)
            print(SUCCESS)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
