"""A parallelized model refuses ``DistributedDataParallel``: one ``TPLowerError`` line, not a crash or frozen weights.

DDP treats every rank as a replica holding the whole model: it broadcasts rank 0's parameters, averages every
gradient over all ranks and (through transformers' ``Trainer`` and ``accelerate``) goes with a data loader that
gives each rank its own batches. A model :func:`tplower.parallelize` placed holds DTensor shards that the ranks of
one tp/cp group share, so none of that holds. The two routes by which DDP meets such a model:

* DDP wraps the parallelized model (``Trainer(model=parallelized).train()``, ``Accelerator().prepare(model)``):
  DDP's constructor would fail deep inside with ``aten.cat.default got mixed torch.Tensor and DTensor``;
  :func:`refuse_ddp` makes it raise :data:`MESSAGE` first.
* The model is parallelized inside a DDP wrapper built before (a ``TrainerCallback.on_train_begin``, after the
  optimizer exists): the optimizer and DDP keep the old parameters, so training would run on and change nothing;
  :func:`refuse_ddp`'s forward pre-hook raises :data:`MESSAGE` at the first call under DDP's forward.

Both hooks read DDP attributes that have no public name (:func:`_ddp_reads_ignore_list`,
:func:`_under_ddp_forward`); ``tests/test_hf_stacks.py`` fails loudly if a torch release renames them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..core.support.errors import TPLowerError

__all__ = ["MESSAGE", "refuse_ddp"]

#: the one line both routes raise
MESSAGE = ("tplower: DistributedDataParallel cannot train a model tplower.parallelize placed (its parameters are "
           "DTensor shards that the ranks of one tp/cp group share, not per-rank replicas); with transformers' "
           "Trainer (or a TRL trainer) build the trainer with the model as loaded, then call "
           "tplower.hf.prepare_trainer(trainer, mesh, plan), then train(); in an accelerate loop call "
           "tplower.hf.prepare_accelerator(accelerator, model, mesh, plan) on the model as loaded, then build the "
           "optimizer on model.parameters(), then accelerator.prepare(...); for data "
           "parallelism of your own use FSDP2 (fully_shard) over a dp mesh axis")

#: the module attribute DDP's constructor reads as the names of parameters and buffers it should leave alone
_IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"


class _Refusal:
    """An ignore list that raises when DDP reads it (DDP's constructor iterates it before any collective)."""

    def __iter__(self) -> Iterator[str]:
        raise TPLowerError(MESSAGE)

    def __repr__(self) -> str:
        return "<tplower: refuses DistributedDataParallel>"


def _ddp_reads_ignore_list(model: nn.Module) -> None:
    """Put :class:`_Refusal` where DDP's constructor reads its ignore list.

    torch (checked on 2.13) has no public hook into DDP's constructor; it reads
    ``module._ddp_params_and_buffers_to_ignore`` with ``set(...)`` before it verifies or broadcasts anything,
    which is also what ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` writes.
    """
    model.__dict__[_IGNORE_ATTR] = _Refusal()


def _under_ddp_forward() -> bool:
    """Whether a DDP forward is running (torch 2.13: DDP sets this class attribute around its module's call,
    for TorchDynamo's DDP optimizer; ``_get_active_ddp_module`` is its accessor)."""
    return DistributedDataParallel._get_active_ddp_module() is not None


def _check_not_under_ddp(module: nn.Module, args: tuple[Any, ...]) -> None:
    if _under_ddp_forward():
        raise TPLowerError(MESSAGE)


def refuse_ddp(model: nn.Module) -> None:
    """Make ``model`` refuse DistributedDataParallel on both routes (see the module docstring); idempotent.

    Raises (later, from DDP's constructor or the model's forward):
        TPLowerError: :data:`MESSAGE`, naming ``tplower.hf.prepare_trainer`` and ``prepare_accelerator``.
    """
    if isinstance(model.__dict__.get(_IGNORE_ATTR), _Refusal):
        return
    _ddp_reads_ignore_list(model)
    model.register_forward_pre_hook(_check_not_under_ddp)
