"""Packed parameters in ``torch.distributed.checkpoint``: one chunk per part, so any layout reads them back.

A packed parameter (a fused ``[gate; up]`` weight: ``packed_colwise``, tensor-
parallel expert weights) holds, on each rank, its piece of every part
concatenated along the shard dim: DTensor placement ``_StridedShard(d, k)``.
Its local tensor is not one box of the global tensor, so DCP's single chunk
per rank (``compute_local_shape_and_global_offset``) cannot describe it: a
save fails ("overlapping chunks") and a load into it reads the wrong rows
without an error (torch 2.13).

This module describes it as what it is: ``k`` boxes, part ``j``'s piece at
global offset ``j * G/k + offset_r`` along ``d`` (``torch.chunk`` pieces of
each part, as :func:`tplower.runtime.params.shard_parameter` cuts them). A
``state_dict`` post-hook (:func:`register`) gives DCP the parameter's
DTensor with its local tensor viewed as :class:`PackedLocal`, which answers
DCP's three questions (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``: the protocol DTensor itself implements) with those
boxes. The view shares the parameter's storage, so ``dcp.load`` writes into
the parameter; ``model.load_state_dict`` afterwards copies it onto itself. A
checkpoint saved at one tp then loads at another and into one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from ..core.language.transitions import chunk_size_and_offset

__all__ = ["PackedLocal", "packed_boxes", "register"]

#: one box: (global offsets, sizes, start of its rows along the packed dim in the local tensor)
Box = tuple[torch.Size, torch.Size, int]


def packed_boxes(dt: DTensor) -> tuple[int, list[Box]] | None:
    """The packed dim and this rank's boxes of ``dt``, or ``None`` when it is not one ``_StridedShard`` DTensor.

    Args:
        dt: a DTensor with exactly one ``_StridedShard(d, k)`` placement and
            no other placement sharding ``d``; ``d``'s global size divides by ``k``.

    Returns:
        ``(d, boxes)``: box ``j`` is part ``j``'s piece on this rank, in local order.
    """
    strided = [(i, p) for i, p in enumerate(dt.placements) if isinstance(p, _StridedShard)]
    if len(strided) != 1:
        return None
    axis, sp = strided[0]
    ndim = int(dt.ndim)
    d, k = sp.dim % ndim, int(sp.split_factor)
    other = [getattr(p, "dim", None) for i, p in enumerate(dt.placements) if i != axis]
    if any(o is not None and o % ndim == d for o in other) or int(dt.shape[d]) % k:
        return None
    rest = [Replicate() if i == axis else p for i, p in enumerate(dt.placements)]
    sizes, offsets = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, rest)
    part = int(dt.shape[d]) // k
    coord = dt.device_mesh.get_coordinate()
    if coord is None:
        return None
    size, off = chunk_size_and_offset(part, dt.device_mesh.size(axis), coord[axis])
    boxes = []
    for j in range(k):
        o, s = list(offsets), list(sizes)
        o[d], s[d] = j * part + off, size
        boxes.append((torch.Size(o), torch.Size(s), j * size))
    return d, boxes


class PackedLocal(torch.Tensor):
    """A packed parameter's local tensor (a view of it) that DCP reads and writes as ``k`` boxes.

    Ops on it run as on a plain tensor (no ``__torch_function__``), and
    return plain tensors. Made by :meth:`view_of`.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    _tplower_dim: int
    _tplower_boxes: list[Box]

    @classmethod
    def view_of(cls, local: torch.Tensor, dim: int, boxes: Sequence[Box]) -> PackedLocal:
        """``local`` (sharing its storage) with its boxes attached."""
        t = torch.Tensor._make_subclass(cls, local.detach(), False)
        t._tplower_dim, t._tplower_boxes = dim, list(boxes)
        return t

    def _part(self, offsets: Sequence[int]) -> torch.Tensor:
        for off, size, start in self._tplower_boxes:
            if tuple(off) == tuple(offsets):
                return self.as_subclass(torch.Tensor).narrow(self._tplower_dim, start, size[self._tplower_dim])
        raise ValueError(f"packed parameter: no box at offset {tuple(offsets)}; this rank holds "
                         f"{[tuple(b[0]) for b in self._tplower_boxes]}")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self.as_subclass(torch.Tensor))
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=size),
                                                      properties=props, size=obj.size()))
                for off, size, _ in self._tplower_boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=off, sizes=size) for off, size, _ in self._tplower_boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.offset is None:
            raise ValueError(f"packed parameter {index.fqn!r}: DCP asked for a shard without an offset")
        return self._part(index.offset)


def _as_boxes(value: Any) -> Any:
    if not isinstance(value, DTensor) or isinstance(value, nn.Parameter) or isinstance(value._local_tensor,
                                                                                      PackedLocal):
        return value
    found = packed_boxes(value)
    if found is None:
        return value
    local = PackedLocal.view_of(value._local_tensor, *found)
    return DTensor(local, value._spec, requires_grad=False)


def _hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for name in getattr(module, "_tplower_packed", ()):
        key = prefix + name
        if key in state_dict:
            state_dict[key] = _as_boxes(state_dict[key])


def register(module: nn.Module, name: str) -> None:
    """Have ``module.state_dict()`` give its packed parameter ``name`` as :class:`PackedLocal` boxes (once)."""
    names: set[str] | None = module.__dict__.get("_tplower_packed")
    if names is None:
        names = set()
        module.__dict__["_tplower_packed"] = names
        module.register_state_dict_post_hook(_hook)
    names.add(name)
