"""Saving a parallelized model and its optimizer from a training stack: whole weights for ``from_pretrained``, DCP
for the optimizer's shards.

* :func:`writes_whole`: around a stack's own save call, every rank takes part in gathering the whole weights
  (:func:`tplower.full_state_dict`, a collective), then the writing rank's ``save_pretrained`` writes them
  without a collective of its own. transformers' ``Trainer.save_model`` calls ``save_pretrained`` on rank 0
  only, which alone could not gather (it waited for the others until the process group's timeout).
* :func:`save_optimizer` / :func:`load_optimizer`: the optimizer's state through DCP
  (``torch.distributed.checkpoint``; ``get_optimizer_state_dict`` names each state by its parameter and keeps
  DTensor shards as shards), so every rank writes and reads its own part; a plain ``torch.save`` on rank 0
  would keep rank 0's shards only.
* :func:`save_scheduler` / :func:`load_scheduler`: the learning-rate scheduler's state (the same on every
  rank), one file written by rank 0.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ..state.full_state import full_state_dict

__all__ = ["OPTIMIZER_FOLDER", "SCHEDULER_FILE", "load_optimizer", "load_scheduler", "save_optimizer",
           "save_scheduler", "writes_whole"]

#: the DCP folder of the optimizer's state inside a checkpoint folder
OPTIMIZER_FOLDER = "optimizer_dcp"
#: the scheduler's state inside a checkpoint folder (transformers' own file name)
SCHEDULER_FILE = "scheduler.pt"


def _main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def writes_whole(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Inside: ``model.save_pretrained(dir, ...)`` writes the whole weights gathered on entry, with no collective.

    On entry every rank gathers :func:`tplower.full_state_dict` (kept on global rank 0); a ``state_dict`` the
    caller passes to ``save_pretrained`` still wins. On exit the instance's ``save_pretrained`` is what it was
    before, and every rank waits at a barrier, so none reads the folder before rank 0 has written it.
    A collective: enter it on every rank.

    Yields:
        The gathered state dict (empty on every rank but 0).
    """
    state = full_state_dict(model, rank0_only=True)
    before = model.__dict__.get("save_pretrained")

    def save_pretrained(self: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("state_dict") is None:
            kwargs["state_dict"] = state
        return type(self).save_pretrained(self, save_directory, *args, **kwargs)  # type: ignore[attr-defined]

    model.__dict__["save_pretrained"] = types.MethodType(save_pretrained, model)
    try:
        yield state
    finally:
        if before is None:
            model.__dict__.pop("save_pretrained", None)
        else:
            model.__dict__["save_pretrained"] = before
        _barrier()


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (its public ``optimizer`` attribute)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def save_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, folder: str) -> None:
    """Write ``optimizer``'s state to the DCP folder ``folder`` (every rank its shards); a collective."""
    state = get_optimizer_state_dict(model, _inner(optimizer))
    dcp_save({"optimizer": state}, checkpoint_id=folder)


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, folder: str) -> None:
    """Read ``optimizer``'s state back from :func:`save_optimizer`'s folder (every rank its shards); a collective.

    The mesh and placements must be those it was saved with, or any other DCP reshards to (DCP reads each rank's
    boxes of the global tensors).
    """
    inner = _inner(optimizer)
    state = {"optimizer": get_optimizer_state_dict(model, inner)}
    dcp_load(state, checkpoint_id=folder)
    set_optimizer_state_dict(model, inner, state["optimizer"])


def save_scheduler(scheduler: Any, path: str) -> None:
    """Write a learning-rate scheduler's ``state_dict()`` to ``path`` from global rank 0; a barrier after."""
    if scheduler is not None and _main():
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(scheduler.state_dict(), path)
    _barrier()


def load_scheduler(scheduler: Any, path: str) -> None:
    """Read :func:`save_scheduler`'s file into ``scheduler`` on every rank (nothing when either is missing)."""
    if scheduler is not None and os.path.isfile(path):
        scheduler.load_state_dict(torch.load(path, weights_only=True))
