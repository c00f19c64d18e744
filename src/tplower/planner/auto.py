"""``prepare_trainer(trainer, mesh="auto")``: the mesh :func:`tplower.plan_layout` ranks best for the job.

Rank 0 plans (in worker interpreters: the job's process group is up) with the trainer's own arguments, every rank
gets the answer (``broadcast_object_list``), and each makes the mesh. The search is narrowed to what the call
already fixes: ``tp`` only with a plan, ``cp`` only with ``context="cp"`` (in the call's ``context_mode``),
activation checkpointing as ``args.gradient_checkpointing`` says, rows per ``dp`` rank as
``args.per_device_train_batch_size``. Candidates are compared at the same global batch (every rank's rows), so
the fastest predicted step is the highest throughput.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..core.support.errors import TPLowerError

__all__ = ["auto_mesh"]

logger = logging.getLogger("tplower.planner")

_KEYS = ("memory_per_rank", "seq_len", "device", "gpus_per_node", "dtype", "workers", "loss_chunk")


def _seq_len(trainer: Any) -> int:
    args = trainer.args
    for name in ("max_length", "max_seq_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    batch = next(iter(trainer.get_train_dataloader()))
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise TPLowerError("prepare_trainer: mesh='auto' found no sequence length (no args.max_length, and the "
                           "first batch has no [rows, tokens] input_ids); pass layout={'seq_len': N}")
    return int(ids.shape[1])


def _memory(device: str) -> int:
    if device == "cuda":
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local, 1)


def auto_mesh(trainer: Any, plan: Any, context: str | None, context_mode: str,
              layout: Mapping[str, Any] | None) -> tuple[Any, str | None]:
    """The mesh for ``prepare_trainer(trainer, "auto", plan, context=context, ...)``, and the ``context`` to use
    with it (``None`` where the best layout has no ``cp``). Collective: every rank calls it.

    Args:
        layout: options for :func:`tplower.plan_layout` among ``memory_per_rank`` (default: the GPU's memory, or
            this machine's divided by its local ranks), ``seq_len`` (default ``args.max_length``, else the first
            batch's), ``device`` (default ``"h100"``: a datasheet preset), ``gpus_per_node`` (default the local
            world size), ``dtype`` (default the model's), ``workers`` and ``loss_chunk``.

    Raises:
        TPLowerError: no process group, an unknown key in ``layout``, or no layout fits (the best refusal's reason).
    """
    from torch.distributed.device_mesh import init_device_mesh

    from .search import plan_layout

    if not dist.is_initialized():
        raise TPLowerError("prepare_trainer: mesh='auto' needs the job's process group (init_process_group first)")
    layout = dict(layout or {})
    unknown = sorted(set(layout) - set(_KEYS))
    if unknown:
        raise TPLowerError(f"prepare_trainer: layout has {unknown}; the keys are {list(_KEYS)}")
    world = dist.get_world_size()
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    args = trainer.args
    micro = int(args.per_device_train_batch_size)
    choice: list[Any] = [None]
    if dist.get_rank() == 0:
        model = trainer.model
        axes = ["dp"] + (["cp"] if context == "cp" else []) + (["tp"] if plan is not None else [])
        try:
            rows = plan_layout(
                model.config, world, memory_per_rank=layout.get("memory_per_rank") or _memory(device),
                seq_len=layout.get("seq_len") or _seq_len(trainer), global_batch=world * micro, micro_batch=micro,
                dtype=layout.get("dtype") or next(model.parameters()).dtype, device=layout.get("device", "h100"),
                gpus_per_node=layout.get("gpus_per_node") or int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                axes=tuple(axes), checkpointing=(bool(args.gradient_checkpointing),),
                context_modes=(context_mode,), loss_chunk=layout.get("loss_chunk"), workers=layout.get("workers"))
            best = rows[0] if rows and rows[0].fits else None
            choice[0] = (dict(best.mesh), best.label(), best.peak_bytes, best.predicted_step_s) if best else \
                ("none", rows[0].reason if rows else "no layout")
        except Exception as exc:
            choice[0] = ("none", f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(choice, src=0)
    got = choice[0]
    if got[0] == "none":
        raise TPLowerError(f"prepare_trainer: mesh='auto' found no layout of {world} ranks that fits: {got[1]}")
    sizes, label, peak, seconds = got
    if not sizes:
        sizes = {"dp": 1}
    logger.warning("prepare_trainer: mesh='auto' chose %s (predicted peak %.2f GiB a rank, %.3g s a step)",
                   label, peak / 2**30, seconds)
    mesh = init_device_mesh(device, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    return mesh, (context if "cp" in sizes else None)
