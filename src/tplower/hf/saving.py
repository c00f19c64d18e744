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
* :func:`load_whole_optimizer`: a one-process optimizer file (transformers' ``optimizer.pt``, whole tensors keyed
  by the parameters' positions) read into an optimizer of DTensor parameters, each rank taking its shards: a run
  checkpointed by one process resumes on a mesh.
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
from torch.distributed.tensor import DTensor

from ..adapters.peft_save import is_peft_model, plain_peft_save, whole_adapter_state
from ..core.support.errors import TPLowerError
from ..state.full_state import full_state_dict, shard_of

__all__ = ["OPTIMIZER_FILE", "OPTIMIZER_FOLDER", "SCHEDULER_FILE", "load_optimizer", "load_scheduler",
           "load_whole_optimizer", "optimizer_format", "save_optimizer", "save_scheduler", "writes_whole"]

#: the DCP folder of the optimizer's state inside a checkpoint folder
OPTIMIZER_FOLDER = "optimizer_dcp"
#: a one-process optimizer's state inside a checkpoint folder (transformers' own file name)
OPTIMIZER_FILE = "optimizer.pt"
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

    On entry every rank gathers what the save writes, kept on global rank 0: :func:`tplower.full_state_dict`, or
    for a PEFT ``PeftModel`` the adapters alone (:func:`~tplower.adapters.peft_save.whole_adapter_state`: never
    the whole base model). Inside, the instance's ``save_pretrained`` writes that state with the model class's
    own writer (PEFT's unwrapped one for a ``PeftModel``: its collective wrapper would wait at a barrier the
    other ranks never reach, as transformers calls ``save_pretrained`` on the writing rank alone); a
    ``state_dict`` the caller passes still wins. On exit the instance's ``save_pretrained`` is what it was
    before, and every rank waits at one barrier, so none reads the folder before rank 0 has written it.
    A collective: enter it on every rank.

    Yields:
        The gathered state dict (empty on every rank but 0).
    """
    peft = is_peft_model(model)
    if peft:
        adapters = whole_adapter_state(model, None, list(getattr(model, "peft_config", {})))
        state = adapters if _main() else {}
    else:
        state = full_state_dict(model, rank0_only=True)
    before = model.__dict__.get("save_pretrained")

    def save_pretrained(self: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("state_dict") is None:
            kwargs["state_dict"] = state
        if peft:
            return plain_peft_save(self, save_directory, *args, **kwargs)
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


def optimizer_format(checkpoint: str) -> str | None:
    """Which optimizer state the checkpoint folder holds, as every rank sees it: ``"dcp"`` (:data:`OPTIMIZER_FOLDER`,
    tplower's), ``"whole"`` (:data:`OPTIMIZER_FILE` alone, a one-process run's) or ``None`` (neither).

    A collective over the default group (every rank's view is compared), so a folder some rank cannot see is
    refused on every rank alike before any rank starts DCP's collective read.

    Raises:
        TPLowerError: the ranks see different contents (a folder not shared between the ranks' machines).
    """
    here = ("dcp" if os.path.isdir(os.path.join(checkpoint, OPTIMIZER_FOLDER))
            else "whole" if os.path.isfile(os.path.join(checkpoint, OPTIMIZER_FILE)) else None)
    if not dist.is_initialized():
        return here
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, here)
    if len(set(every)) > 1:
        raise TPLowerError(f"resume_from_checkpoint={checkpoint!r}: the ranks see different optimizer states in it "
                           f"({dict(enumerate(every))}: 'dcp' is {OPTIMIZER_FOLDER}/, 'whole' {OPTIMIZER_FILE}); "
                           "pass a folder every rank reads alike (a shared file system)")
    return here


def _shard(value: Any, param: torch.Tensor, where: str) -> Any:
    """A whole state tensor of ``param`` as this rank's shard of it (``param`` a DTensor), else ``value``."""
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if tuple(value.shape) != tuple(param.shape):
        raise TPLowerError(f"{where}: a state tensor of shape {tuple(value.shape)} for a parameter of global shape "
                           f"{tuple(param.shape)}; tplower reads a one-process optimizer's per-parameter states of "
                           "the parameter's shape (Adam's moments, SGD's momentum), or its own optimizer_dcp/ folder")
    return shard_of(value, param)


def load_whole_optimizer(optimizer: torch.optim.Optimizer, path: str) -> None:
    """Read a one-process optimizer's file (``torch.save(optimizer.state_dict())``, transformers' ``optimizer.pt``)
    into ``optimizer``, whose parameters may be DTensors: each rank takes its shards; no collective.

    The file's states are keyed by each parameter's position in its parameter groups (torch's own format), so
    ``optimizer`` must be built as the one that wrote it (the same groups, in the same order: a trainer's own
    ``create_optimizer`` is). A state tensor of a DTensor parameter's global shape becomes this rank's shard of it
    (:func:`tplower.state.full_state.shard_of`); the rest (``step``, the groups' hyperparameters) loads as it is.

    Raises:
        TPLowerError: the file's parameter groups differ from the optimizer's in number or sizes; a state tensor
            of a DTensor parameter whose shape is not the parameter's (a factored state such as Adafactor's).
    """
    inner = _inner(optimizer)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    groups = saved.get("param_groups", [])
    have, want = [len(g["params"]) for g in groups], [len(g["params"]) for g in inner.param_groups]
    if have != want:
        raise TPLowerError(f"load_whole_optimizer: {path!r} holds parameter groups of {have} parameters, the "
                           f"optimizer {want}; build the optimizer as the run that wrote it did (its trainer's "
                           "optimizer settings)")
    state: dict[Any, dict[str, Any]] = {}
    for group, own in zip(groups, inner.param_groups, strict=True):
        for key, param in zip(group["params"], own["params"], strict=True):
            if key in saved["state"]:
                state[key] = {k: _shard(v, param, f"load_whole_optimizer: {path!r}")
                              for k, v in saved["state"][key].items()}
    inner.load_state_dict({"state": state, "param_groups": groups})


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
