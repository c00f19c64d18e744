"""What a mesh says about this rank, read once: its coordinate, the ranks along each axis, each group's order.

:func:`mesh_facts` is a constant of the graph under ``torch.compile`` (read
eagerly, once); :func:`axis_order` is the rank-order check
:class:`~tplower.core.lower.redistribute.MeshLowerer` runs per axis: collectives
put pieces in mesh-coordinate order where a group orders its ranks otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..support.errors import TPLowerError
from ..support.fake import host_values

__all__ = ["MeshFacts", "axis_order", "mesh_facts"]

MeshFacts = tuple[tuple[int, ...] | None, tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]


def _read_mesh_facts(mesh: DeviceMesh) -> MeshFacts:
    """This rank's coordinate, and per axis the ranks along it in mesh order and in its group's order.

    Read from the mesh's rank tensor and the process groups: under
    ``torch.compile`` this runs once, eagerly, and its result is a constant
    of the graph (reading a mesh tensor inside a graph would break it).
    """
    coord = mesh.get_coordinate()
    if coord is None:
        return None, (), ()
    along = []
    with host_values():  # the rank tensor stays real under a FakeTensorMode (tplower.planner traces there)
        for axis in range(mesh.ndim):
            index: list[int | slice] = list(coord)
            index[axis] = slice(None)
            along.append(tuple(int(r) for r in mesh.mesh[tuple(index)].tolist()))
    groups = tuple(tuple(dist.get_process_group_ranks(mesh.get_group(i))) for i in range(mesh.ndim))
    return tuple(coord), tuple(along), groups


mesh_facts: Callable[[DeviceMesh], MeshFacts] = torch.compiler.assume_constant_result(_read_mesh_facts)


def axis_order(name: str, mesh_ranks: list[int], group_ranks: list[int]) -> tuple[int, ...] | None:
    """How the process group of mesh axis ``name`` orders its ranks against the mesh.

    Args:
        name: the axis name, for the message.
        mesh_ranks: the ranks along the axis through this rank, in mesh-coordinate order.
        group_ranks: the ranks of the axis's process group, in group-rank order.

    Returns:
        ``None`` when both orders agree, else ``order[c]`` = the group rank of mesh coordinate ``c``.

    Raises:
        TPLowerError: the group holds other ranks than the mesh axis.
    """
    if sorted(mesh_ranks) != sorted(group_ranks):
        raise TPLowerError(f"mesh axis {name!r} holds ranks {mesh_ranks} but its process group holds {group_ranks}")
    if mesh_ranks == group_ranks:
        return None
    return tuple(group_ranks.index(r) for r in mesh_ranks)
