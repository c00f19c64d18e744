"""Whole tensors in and out of a parallelized model: a full state dict, ``save_pretrained``, one rank's slices.

A parallelized parameter is a DTensor (:mod:`tplower.runtime.params`); users' checkpoints mostly are not. This
module turns between the two without ever building a whole tensor on a rank that does not need it:

* :func:`local_boxes`: the boxes of the global tensor that this rank's local tensor holds, and where each
  sits in the local tensor. One box for a ``Shard``/``Replicate`` DTensor (``torch.chunk`` pieces, as
  ``distribute_tensor`` cuts them, uneven ones too); ``k`` boxes for a packed ``_StridedShard(d, k)`` one
  (:func:`tplower.state.packed_checkpoint.packed_boxes`). Everything that reads a rank's share of a whole
  tensor (a full state dict, a safetensors file) reads these boxes and nothing else.
* :func:`register_full_load`: ``model.load_state_dict(full)`` of an unsharded state dict (the values a
  one-process model's ``state_dict()`` gives) works on a parallelized model: a load pre-hook on each module
  that owns a DTensor parameter replaces each plain value of global shape by a DTensor of this rank's boxes.
  DTensor values (``torch.save(model.state_dict())`` read back, DCP) pass through.
* :func:`full_state_dict`: every DTensor gathered whole (``full_tensor``, one tensor at a time), kept on
  the writing rank only; :func:`patch_save_pretrained` makes a transformers model's ``save_pretrained``
  write that, from rank 0, reloadable by ``from_pretrained`` in one process (as transformers' own
  tensor-parallel save does). Both are collectives: call them on every rank.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..core.support.errors import TPLowerError
from .packed_checkpoint import PackedLocal, packed_boxes

__all__ = ["Box", "full_state_dict", "local_boxes", "patch_save_pretrained", "placed_by_tplower",
           "register_full_load", "shard_of"]

#: one box: (global offsets, sizes, offsets of the box in the local tensor)
Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]

#: ``module.__dict__`` key: the module owns a DTensor parameter tplower placed (see :func:`register_full_load`)
_FULL_LOAD = "_tplower_full_load"


def local_boxes(dt: DTensor) -> list[Box]:
    """The boxes of ``dt``'s global tensor that this rank holds, with where each sits in its local tensor.

    Args:
        dt: a DTensor of ``Shard``/``Replicate`` placements (``torch.chunk`` pieces in mesh-coordinate order,
            as ``distribute_tensor``), or one packed ``_StridedShard(d, k)`` placement as
            :func:`tplower.parallelize` makes packed parameters.

    Returns:
        ``[(global offsets, sizes, local offsets)]``, each a tuple of ``dt.ndim`` ints; a box of size 0
        along some dim holds nothing (an empty ``torch.chunk`` piece). Copying each box of the global
        tensor to its local offsets builds the local tensor.

    Raises:
        TPLowerError: a placement this module cannot describe as boxes (a ``Partial``, a ``_StridedShard``
            other than a packed parameter's); ``dt``'s rank is not in its mesh.
    """
    if dt.device_mesh.get_coordinate() is None:
        raise TPLowerError("local_boxes: this rank is not in the DTensor's mesh")
    packed = packed_boxes(dt)
    if packed is not None:
        d, boxes = packed
        out = []
        for off, size, start in boxes:
            local = [0] * len(size)
            local[d] = start
            out.append((tuple(int(o) for o in off), tuple(int(s) for s in size), tuple(local)))
        return out
    if any(not (p.is_shard() or p.is_replicate()) or type(p).__name__ == "_StridedShard" for p in dt.placements):
        raise TPLowerError(f"local_boxes: placements {tuple(dt.placements)} are not Shard/Replicate (nor one "
                           "packed parameter's _StridedShard); gather it with full_tensor() instead")
    sizes, offsets = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return [(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes), (0,) * dt.ndim)]


def _box(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
        t = t.narrow(d, o, s)
    return t


def fill_local(local: torch.Tensor, boxes: list[Box], read: Callable[[tuple[int, ...], tuple[int, ...]],
                                                                      torch.Tensor]) -> int:
    """Copy each box ``read(global offsets, sizes)`` gives into ``local`` at its local offsets.

    Returns:
        Elements copied (the local tensor's numel when the boxes cover it).
    """
    n = 0
    for off, size, at in boxes:
        if 0 in size:
            continue
        _box(local, at, size).copy_(read(off, size))
        n += int(torch.Size(size).numel())
    return n


def shard_of(full: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's share of the whole tensor ``full``, as a DTensor of ``like``'s mesh, placements and shape.

    Args:
        full: the global tensor (shape ``like.shape``; any dtype and device: copied to ``like``'s).
        like: the DTensor whose layout to take (a parallelized parameter).

    Returns:
        A DTensor whose local tensor is a fresh copy of this rank's boxes (no collective runs). A parameter
        FSDP2 sharded over ``dp`` on top of a tensor-parallel ``Shard`` of the same dim (placements
        ``_StridedShard`` over ``dp``, ``Shard`` over ``tp``) takes DTensor's own local cut of ``full``
        (``distribute_tensor`` with ``src_data_rank=None``: no collective either).

    Raises:
        TPLowerError: ``full``'s shape is not ``like``'s global shape.
    """
    if tuple(full.shape) != tuple(like.shape):
        raise TPLowerError(f"shard_of: a whole tensor of shape {tuple(full.shape)} for a parameter of global "
                           f"shape {tuple(like.shape)}")
    ref = like._local_tensor
    if packed_boxes(like) is None and any(type(p).__name__ == "_StridedShard" for p in like.placements):
        cut = distribute_tensor(full.to(ref.device), like.device_mesh, like.placements, src_data_rank=None)
        local = cut.to_local().to(ref.dtype).contiguous()
    else:
        local = torch.empty(ref.shape, dtype=ref.dtype, device=ref.device)
        fill_local(local, local_boxes(like), lambda off, size: _box(full, off, size))
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def _load_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    for name, p in module._parameters.items():
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            if tuple(value.shape) == tuple(p.shape):
                state_dict[key] = shard_of(value, p)


def register_full_load(model: nn.Module) -> int:
    """Let ``load_state_dict`` take whole (unsharded) tensors for ``model``'s DTensor parameters.

    Registers, once per module that owns a DTensor parameter, a ``load_state_dict`` pre-hook that replaces
    each plain tensor of the parameter's global shape by :func:`shard_of` it (each rank takes its boxes;
    no collective). Called by :func:`tplower.parallelize`.

    Returns:
        The number of modules newly registered.
    """
    n = 0
    for module in model.modules():
        if _FULL_LOAD in module.__dict__:
            continue
        if any(isinstance(p, DTensor) for p in module._parameters.values()):
            module.register_load_state_dict_pre_hook(_load_hook)
            module.__dict__[_FULL_LOAD] = True
            n += 1
    return n


def plain_dtensor(value: DTensor) -> DTensor:
    """``value`` with a packed local tensor as a plain one (what ``full_tensor`` gathers in the parts' order)."""
    local = value._local_tensor
    if isinstance(local, PackedLocal):
        local = local.as_subclass(torch.Tensor)
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())
    return value


def iter_full(model: nn.Module, *, keep_vars: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.state_dict()``'s items, each DTensor gathered whole (a collective per DTensor: every rank)."""
    for key, value in model.state_dict(keep_vars=keep_vars).items():
        if isinstance(value, DTensor):
            whole: torch.Tensor = plain_dtensor(value).full_tensor().detach()
            yield key, whole
        else:
            yield key, value


def full_state_dict(model: nn.Module, *, rank0_only: bool = True, cpu: bool = True) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every DTensor gathered into its whole tensor, as one process would hold it.

    Gathers one tensor at a time (``DTensor.full_tensor``: an ``all_gather``, packed parameters put back in
    their parts' order). A collective: call it on every rank of the model's meshes, in the same order.

    Args:
        model: a parallelized model (plain parameters pass as they are).
        rank0_only: keep the gathered tensors on global rank 0 only (every other rank returns ``{}`` and
            never holds more than one whole tensor at a time).
        cpu: move each gathered tensor to CPU as it is gathered.

    Returns:
        ``{key: whole tensor}`` with the keys of ``model.state_dict()`` (on rank 0 only, with ``rank0_only``).
    """
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    for key, value in iter_full(model):
        if keep:
            out[key] = value.cpu() if cpu else value
    return out


def _save_pretrained(self: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    main = not dist.is_initialized() or dist.get_rank() == 0
    if kwargs.get("state_dict") is None:
        kwargs["state_dict"] = full_state_dict(self, rank0_only=True)
    kwargs["is_main_process"] = bool(kwargs.get("is_main_process", True)) and main
    result = type(self).save_pretrained(self, save_directory, *args, **kwargs) if main else None  # type: ignore[attr-defined]
    if dist.is_initialized():
        dist.barrier()
    return result


def patch_save_pretrained(model: nn.Module) -> bool:
    """Make ``model.save_pretrained(dir, ...)`` write whole weights from rank 0 (transformers and PEFT models).

    A transformers model: the instance's ``save_pretrained`` (the class is not touched; a bound method, so
    ``copy.deepcopy`` of the model binds its copy) gathers :func:`full_state_dict` when no ``state_dict`` is
    given, writes on global rank 0 only (``is_main_process``), and waits at a barrier so no rank reads the
    folder before it is written (a PEFT ``PeftModel``: :func:`tplower.adapters.peft_save.collective_peft_save`,
    whole adapters). A collective: call it on every rank, as transformers' own tensor-parallel save.
    Without it, transformers' and PEFT's save of DTensor parameters fails ("invalid python storage").

    Returns:
        ``True`` when ``model``'s class has a ``save_pretrained`` method and the instance now writes whole
        weights.
    """
    if not callable(getattr(type(model), "save_pretrained", None)) or "save_pretrained" in model.__dict__:
        return False
    model.__dict__["save_pretrained"] = types.MethodType(_save_pretrained, model)
    return True


def placed_by_tplower(model: nn.Module) -> bool:
    """Whether ``model`` holds a parameter :func:`tplower.parallelize` placed (:func:`register_full_load` saw it)."""
    return any(_FULL_LOAD in m.__dict__ for m in model.modules())
