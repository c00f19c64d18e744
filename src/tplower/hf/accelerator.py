"""An ``accelerate.Accelerator`` that treats a tplower model as one model: no DDP, batches cut over ``dp``.

:func:`patch_accelerator` replaces four public methods on the accelerator *instance* (its class is not
touched; :func:`unpatch_accelerator` deletes the instance attributes and the class's methods apply again):

* ``prepare_model``: a model :func:`tplower.parallelize` placed is prepared as accelerate prepares a model for
  evaluation (``evaluation_mode=True``: mixed precision and ``torch.compile`` as configured, never the
  ``DistributedDataParallel`` wrap); its parameters' gradients are reduced by tplower over tp/cp and by FSDP2 over
  ``dp``. Any other model is prepared as before.
* ``prepare_data_loader``: :func:`tplower.hf.batches.dp_data_loader`, the ``dp`` axis as accelerate's processes.
* ``gather_for_metrics``: gathers over ``dp`` only (the ranks of one tp/cp group hold the same samples, so a
  world-wide gather would repeat each one) and drops the samples the last batch repeated to even out the ``dp``
  ranks, as accelerate's own does.
* ``gather``: over ``dp`` only too (transformers' ``Trainer`` counts ``num_input_tokens_seen`` with it).

:func:`pieces_gathered` changes ``gather_for_metrics`` for a while: inside, each rank holds its own piece of a
``cp``-cut batch, and every ``dp`` and ``cp`` rank's value is gathered.

``Accelerator.prepare(model, optimizer, data_loader)`` calls these through the instance, so a user's loop and
transformers' ``Trainer`` (which prepares through its ``accelerator``) both get them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.lower.redistribute import redistribute_local
from ..core.support.errors import TPLowerError
from ..state.full_state import placed_by_tplower
from .batches import dp_data_loader
from .layout import DataLayout

__all__ = ["PATCHED", "check_accelerator", "count_data_processes", "dp_gather", "gather_over", "one_process",
           "patch_accelerator", "pieces_gathered", "training_batches", "unpatch_accelerator"]

#: the Accelerator methods :func:`patch_accelerator` replaces on the instance (the first four; the last four
#: :func:`tplower.hf.prepare_accelerator` replaces too)
PATCHED = ("prepare_model", "prepare_data_loader", "gather_for_metrics", "gather", "prepare_optimizer",
           "prepare_scheduler", "save_state", "load_state")


def check_accelerator(accelerator: Any, where: str) -> None:
    """Refuse an accelerator that would shard or wrap the model its own way (before anything is changed).

    Raises:
        TPLowerError: a ``ParallelismConfig``, FSDP or DeepSpeed plugin, or Megatron-LM on ``accelerator``
            (tplower parallelizes the model itself; the stack's own parallelism would shard it again).
    """
    from accelerate.utils import DistributedType

    pc = getattr(accelerator, "parallelism_config", None)
    if pc is not None:
        raise TPLowerError(f"{where}: the accelerator has a ParallelismConfig ({pc}); tplower parallelizes the model "
                           "itself on the mesh you pass: drop parallelism_config (TrainingArguments or Accelerator)")
    kind = accelerator.distributed_type
    if kind in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise TPLowerError(f"{where}: the accelerator runs {kind.value}, which would shard or wrap the model "
                           "tplower parallelizes; drop its fsdp/deepspeed configuration (tplower applies FSDP2 over "
                           "the mesh's 'dp' axis itself)")


def gather_over(value: Any, layout: DataLayout, axes: tuple[str, ...]) -> Any:
    """``value`` (a tensor or nested tuples/lists/dicts of them) concatenated on dim 0 over the mesh axes ``axes``
    (the first axis outermost); a 0-d tensor counts as one element. Other objects are gathered with
    ``all_gather_object`` into one list (a list's items concatenated). Collective over ``axes``; every rank passes
    tensors of equal shapes (as accelerate's ``gather`` asks). With no axes: the tensor (0-d ones as 1-d), or the
    object in a list."""
    if isinstance(value, torch.Tensor):
        t = value.detach().reshape(1) if value.dim() == 0 else value.detach()
        if not axes:
            return t
        names = tuple(layout.mesh.mesh_dim_names or ())
        n = math.prod(layout.mesh.size(names.index(a)) for a in axes)
        return redistribute_local(t.contiguous(), layout.mesh, {a: "S(0)" for a in axes}, {a: "R" for a in axes},
                                  global_shape=(t.shape[0] * n, *t.shape[1:]))
    if isinstance(value, dict):
        return type(value)({k: gather_over(v, layout, axes) for k, v in value.items()})
    if isinstance(value, (tuple, list)) and all(isinstance(v, (torch.Tensor, tuple, list, dict)) for v in value):
        return type(value)(gather_over(v, layout, axes) for v in value)
    items = value if isinstance(value, list) else [value]
    for axis in reversed(axes):  # the innermost axis first: the first axis ends outermost, as for tensors
        every: list[Any] = [None] * layout.mesh.size(tuple(layout.mesh.mesh_dim_names or ()).index(axis))
        dist.all_gather_object(every, items, group=layout.mesh.get_group(axis))
        items = [x for part in every for x in part]
    return items


def dp_gather(value: Any, layout: DataLayout) -> Any:
    """``value`` concatenated on dim 0 over ``dp`` (:func:`gather_over` with the ``dp`` axis, none without it)."""
    return gather_over(value, layout, (layout.dp,) if layout.dp else ())


def _truncate(value: Any, keep: int) -> Any:
    if isinstance(value, (torch.Tensor, list)):
        return value[:keep]
    if isinstance(value, dict):
        return type(value)({k: _truncate(v, keep) for k, v in value.items()})
    if isinstance(value, tuple):
        return tuple(_truncate(v, keep) for v in value)
    return value


def _gather_for_metrics(accelerator: Any, layout: DataLayout) -> Any:
    def gather_for_metrics(input_data: Any, use_gather_object: bool = False) -> Any:
        """``Accelerator.gather_for_metrics`` over the ``dp`` axis (see :mod:`tplower.hf.accelerator`)."""
        data = dp_gather(input_data, layout)
        state = accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:  # the samples the last batch repeated
            return _truncate(data, state.remainder)
        return data

    return gather_for_metrics


@contextlib.contextmanager
def _instead(accelerator: Any, name: str, value: Any) -> Iterator[None]:
    """Inside, the instance attribute ``name`` of ``accelerator`` is ``value``; on exit it is what it was (or,
    where the instance had none, the class's applies again)."""
    missing = object()
    before = accelerator.__dict__.get(name, missing)
    accelerator.__dict__[name] = value
    try:
        yield
    finally:
        if before is missing:
            accelerator.__dict__.pop(name, None)
        else:
            accelerator.__dict__[name] = before


@contextlib.contextmanager
def training_batches(accelerator: Any, layout: DataLayout) -> Iterator[None]:
    """Inside, ``accelerator.prepare_data_loader`` reads a trainer's training batches in
    :class:`~tplower.hf.batches.Rounds` (:func:`~tplower.hf.batches.dp_data_loader` with ``examples=True``); on
    exit the method is what it was."""
    def prepare_data_loader(data_loader: Any, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """``Accelerator.prepare_data_loader`` over ``dp``, in rounds (:func:`training_batches`)."""
        return dp_data_loader(accelerator, layout, data_loader, device_placement, slice_fn_for_dispatch,
                              examples=True)

    with _instead(accelerator, "prepare_data_loader", prepare_data_loader):
        yield


@contextlib.contextmanager
def pieces_gathered(accelerator: Any, layout: DataLayout) -> Iterator[None]:
    """Inside, ``accelerator.gather_for_metrics(value)`` concatenates every ``dp`` and ``cp`` rank's ``value``
    (:func:`gather_over` over :attr:`DataLayout.split`, nothing dropped): for values each rank computed from its
    own piece of a ``cp``-cut batch (a count of its tokens, a sum over them), whose sum over the gathered values
    is the whole global batch's. On exit the method is what it was. Not re-entrant across threads."""
    def gather_pieces(input_data: Any, use_gather_object: bool = False) -> Any:
        """``Accelerator.gather_for_metrics`` of per-piece values: over ``dp`` and ``cp``."""
        return gather_over(input_data, layout, layout.split)

    with _instead(accelerator, "gather_for_metrics", gather_pieces):
        yield


def patch_accelerator(accelerator: Any, layout: DataLayout, model: nn.Module | None = None) -> None:
    """Make ``accelerator`` prepare tplower models without DDP and read batches over ``layout``'s ``dp`` axis.

    ``model``: the model parallelized for it (one with nothing placed by a plan, data parallelism alone, is
    recognized by identity; any model :func:`tplower.parallelize` placed is recognized by its parameters).

    Replaces :data:`PATCHED` on the instance (see the module docstring); calling it again re-patches with the
    new layout.

    Raises:
        TPLowerError: as :func:`check_accelerator`.
    """
    check_accelerator(accelerator, "prepare_accelerator")
    unpatch_accelerator(accelerator)
    prepare_model = accelerator.prepare_model

    def prepare_tplower_model(candidate: nn.Module, device_placement: bool | None = None,
                              evaluation_mode: bool = False) -> nn.Module:
        """``Accelerator.prepare_model``; a tplower model is never wrapped in DDP (``evaluation_mode=True``)."""
        ours = placed_by_tplower(candidate) or candidate is model
        prepared: nn.Module = prepare_model(candidate, device_placement=device_placement,
                                            evaluation_mode=evaluation_mode or ours)
        return prepared

    def prepare_data_loader(data_loader: Any, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """``Accelerator.prepare_data_loader`` over the ``dp`` axis (:func:`tplower.hf.batches.dp_data_loader`)."""
        return dp_data_loader(accelerator, layout, data_loader, device_placement, slice_fn_for_dispatch)

    def gather(tensor: Any) -> Any:
        """``Accelerator.gather`` over the ``dp`` axis (:func:`dp_gather`): the ranks of a tp/cp group count once."""
        return dp_gather(tensor, layout)

    accelerator.prepare_model = prepare_tplower_model
    accelerator.prepare_data_loader = prepare_data_loader
    accelerator.gather_for_metrics = _gather_for_metrics(accelerator, layout)
    accelerator.gather = gather


def count_data_processes(accelerator: Any, layout: DataLayout) -> None:
    """Make ``accelerator.num_processes`` the ``dp`` size: the processes that read different data.

    Trainers size and normalize their data by it (TRL's GRPO divides its token count by it, its distillation
    trainer sizes batches with it); a tp/cp/ep group is one such process. ``process_index`` stays the global
    rank: TRL slices tensors it gathered over every process (``accelerate.utils.gather``) by it. The property is
    the class's, so the instance's class becomes a subclass that overrides it alone, reading the instance's
    ``_tplower_processes`` (:func:`one_process` sets it to 1 for a while; :func:`unpatch_accelerator` restores the
    class). Nothing changes in a job of one process.
    """
    base = type(accelerator).__dict__.get("_tplower_base", type(accelerator))
    accelerator.__dict__["_tplower_processes"] = layout.dp_size
    if layout.mesh.size() == 1:
        accelerator.__class__ = base
        return
    accelerator.__class__ = type(base.__name__, (base,), {
        "__module__": base.__module__, "_tplower_base": base,
        "__doc__": f"{base.__name__} whose num_processes is the data-parallel size "
                   "(tplower.hf.accelerator.count_data_processes)",
        "num_processes": property(lambda self: self.__dict__["_tplower_processes"])})


@contextlib.contextmanager
def one_process(accelerator: Any) -> Iterator[None]:
    """Inside, ``accelerator.num_processes`` is 1 (after :func:`count_data_processes`): data code sized as one
    process's (a trainer building its training ``DataLoader`` with ``dp`` times the batch)."""
    with _instead(accelerator, "_tplower_processes", 1):
        yield


def unpatch_accelerator(accelerator: Any) -> None:
    """Undo :func:`patch_accelerator` (and :func:`tplower.hf.prepare_accelerator`, :func:`count_data_processes`):
    the class's methods apply again (a no-op on an unpatched accelerator)."""
    for name in PATCHED:
        accelerator.__dict__.pop(name, None)
    accelerator.__class__ = type(accelerator).__dict__.get("_tplower_base", type(accelerator))
    accelerator.__dict__.pop("_tplower_processes", None)
