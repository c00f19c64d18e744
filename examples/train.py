"""Train a tensor-parallel model with tplower, checkpoint it with DCP, reload it in one process.

A model sharded by ``tplower.parallelize`` has DTensor parameters (as ``parallelize_module``
makes them), so AdamW, ``clip_grad_norm_``, ``state_dict`` and DCP work unchanged. After
training, rank 0 loads the checkpoint into a fresh unparallelized model and checks that it
computes the parallel model's output. Launch (gloo on CPU, nccl when CUDA is available)::

    torchrun --nproc-per-node 2 examples/train.py [--steps 5] [--checkpoint DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import tplower

D, H, BATCH, TOL, MAX_NORM = 16, 64, 32, 1e-5, 0.25
# Every parameter is placed (the norms replicated), so clip_grad_norm_ sees only DTensor grads.
PLAN = {"*.norm": "replicate", "*.up": "colwise", "*.down": "rowwise"}


class Block(nn.Module):
    """x + down(gelu(up(norm(x)))): a pre-norm MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def build_model(seed: int = 0) -> nn.Sequential:
    """The unparallelized model: two blocks (modules 0.norm, 0.up, ..., 4,320 parameters), seeded."""
    torch.manual_seed(seed)  # the same weights on every rank
    return nn.Sequential(Block(), Block())


def batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data, the same on every rank: learn y = sin(x) + 0.1 * x.roll(1)."""
    x = torch.randn(BATCH, D, generator=torch.Generator().manual_seed(1000 + step))
    return x.to(device), (torch.sin(x) + 0.1 * x.roll(1, dims=-1)).to(device)


def step_line(step: int, steps: int, loss: float, norm: float) -> str:
    """What rank 0 prints for a step: the loss, the gradient norm before clipping, and whether clipping scaled it
    down to MAX_NORM (only when the norm was above it)."""
    clip = f"clipped to {MAX_NORM:g}" if norm > MAX_NORM else f"not clipped (max {MAX_NORM:g})"
    return f"step {step}/{steps}  loss {loss:.6f}  grad-norm {norm:.6f}, {clip}"


def main() -> int:
    parser = argparse.ArgumentParser(description="Train with tplower, save a DCP checkpoint, reload it in one process.")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--checkpoint", default=None, help="DCP directory (default: a temp dir, removed at the end)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device_type = "cuda" if cuda else "cpu"
    if cuda:  # one GPU per process
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("tp",))

    # Shard in place: up is Shard(0) (colwise), down's weight Shard(1) (rowwise), norms Replicate.
    # The model takes and returns this rank's local tensors; with this plan both are full (replicated).
    model = tplower.parallelize(build_model().to(device), mesh, PLAN)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    for step in range(args.steps):
        x, y = batch(step, device)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # grads are DTensors with the parameters' placements
        # The global norm over all shards (a Replicate DTensor: every grad is a DTensor), then scaled to MAX_NORM.
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)
        norm = (total.full_tensor() if isinstance(total, DTensor) else total).item()
        opt.step()
        if rank == 0:
            print(step_line(step + 1, args.steps, loss.item(), norm), flush=True)

    # Every rank names the same directory: rank 0 picks the temp dir and broadcasts it.
    ckpt: list[str | None] = [args.checkpoint or (tempfile.mkdtemp(prefix="tplower-train-") if rank == 0 else None)]
    dist.broadcast_object_list(ckpt, src=0)
    ckpt_dir = str(ckpt[0])
    dcp.save(model.state_dict(), checkpoint_id=ckpt_dir)  # each rank writes its shards; global shapes recorded

    model.eval()
    with torch.no_grad():
        x_fixed = torch.randn(8, D, generator=torch.Generator().manual_seed(7)).to(device)
        parallel_out = model(x_fixed).cpu()
    dist.barrier()  # the checkpoint is complete before rank 0 reads it

    ok = True
    if rank == 0:
        plain = build_model(seed=123)  # other weights: everything must come from the checkpoint
        sd = plain.state_dict()
        with warnings.catch_warnings():  # no_dist=True warns that it loads in a single process: intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, checkpoint_id=ckpt_dir, no_dist=True)  # one process, full tensors, no process group
        plain.load_state_dict(sd)
        with torch.no_grad():
            diff = (plain.eval()(x_fixed.cpu()) - parallel_out).abs().max().item()
        ok = diff <= TOL
        print(f"checkpoint: {ckpt_dir} ({sum(p.numel() for p in plain.parameters())} parameters, tp={world})\n"
              f"{'OK' if ok else 'MISMATCH'}: one-process reload vs parallel model, "
              f"max abs diff {diff:.3g} (tolerance {TOL:g})", flush=True)
        if args.checkpoint is None:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
    result = [ok]
    dist.broadcast_object_list(result, src=0)  # every rank exits with rank 0's verdict
    dist.barrier()  # no rank tears its gloo connections down while a peer still uses them
    dist.destroy_process_group()
    return 0 if result[0] else 1


if __name__ == "__main__":
    sys.exit(main())
