"""The debug path of :class:`~tplower.core.lower.redistribute.MeshLowerer`: a transition run once the ranks agree on it.

:func:`checked` describes this rank's call (placements, shapes, dtype,
device, its own error if any), lets the ranks compare their descriptions
(:mod:`tplower.core.lower.agreement`: one small ``all_gather`` of a digest) over
:func:`debug_group`, and raises the same error on every rank on a
difference; otherwise it runs the cached program.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from ..language.placements import PlacementsLike, format_placements, parse_placements
from ..language.transitions import global_shape_from_local
from ..support.argcheck import check_local_tensor, check_shape
from ..support.errors import TPLowerError
from .agreement import check_agreement

__all__ = ["Lowerer", "checked", "debug_group", "describe_spec", "name_type_error"]


class Lowerer(Protocol):
    """What the debug path reads of a :class:`~tplower.core.lower.redistribute.MeshLowerer` (which calls it; typed
    by this protocol so the two modules do not import each other)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    _flat_group: ProcessGroup | None

    @property
    def mesh(self) -> DeviceMesh:
        """The lowerer's device mesh."""

    @property
    def groups(self) -> tuple[ProcessGroup, ...]:
        """The process group of each mesh axis."""

    def parse(self, spec: PlacementsLike, tensor_ndim: int, arg: str) -> tuple[Placement, ...]:
        """Placements of the mesh from any accepted form."""

    def program(self, src: PlacementsLike, dst: PlacementsLike, local_shape: Sequence[int], device_type: str, *,
                grad: PlacementsLike | None = None,
                global_shape: Sequence[int] | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """The cached program of a transition."""


def name_type_error(names: Sequence[str], src: Any, dst: Any, grad: Any, global_shape: Any) -> None:
    """After a ``TypeError`` while building a program: raise it again naming the argument that caused it."""
    parse_placements(src, names, arg="src")
    parse_placements(dst, names, arg="dst")
    if grad is not None:
        parse_placements(grad, names, arg="grad")
    if global_shape is not None:
        check_shape(global_shape, "global_shape", "redistribute_local")


def describe_spec(spec: PlacementsLike, names: Sequence[str]) -> str:
    """``spec`` in canonical form, or its ``repr`` when it does not parse."""
    try:
        return format_placements(parse_placements(spec, names))
    except (TPLowerError, TypeError):
        return repr(spec)


def checked(lowerer: Lowerer, local: torch.Tensor, src: PlacementsLike, dst: PlacementsLike, *,
            grad: PlacementsLike | None = None, global_shape: Sequence[int] | None = None,
            where: str | None = None, hint: str | None = None) -> torch.Tensor:
    """:func:`redistribute_local` after the debug check (:mod:`tplower.core.lower.agreement`); collective.

    ``where`` (what is moved, e.g. ``module 'up', input '0'``) starts the
    error message; ``hint`` says how to fix local sizes that differ
    (default: pass ``global_shape=``).

    Raises:
        TPLowerError: on every rank alike when the ranks' calls disagree
            or any rank's call is invalid; it is also a ``TypeError``
            (:class:`~tplower.core.support.errors.TPLowerTypeError`) when a rank's
            call had an argument of the wrong type (``local`` a list, a
            NumPy array, ``None`` or a DTensor).
    """
    prog, error, type_error = None, None, False
    is_tensor = isinstance(local, torch.Tensor) and not isinstance(local, DTensor)
    gshape: Any = global_shape
    try:
        local = check_local_tensor(local, "local", "redistribute_local")
        if global_shape is not None:
            gshape = check_shape(global_shape, "global_shape", "redistribute_local")
        try:
            prog = lowerer.program(src, dst, local.shape, local.device.type, grad=grad, global_shape=global_shape)
        except TypeError:
            name_type_error(lowerer.names, src, dst, grad, global_shape)
            raise
        if global_shape is None:  # the program's own shape has 1 for dims no placement shards (its cache key)
            gshape = global_shape_from_local(local.shape, lowerer.parse(src, local.ndim, "src"), lowerer.shape)
    except (TPLowerError, TypeError, ValueError) as exc:
        error, type_error = f"{type(exc).__name__}: {exc}", isinstance(exc, TypeError)
    names = lowerer.names
    record = {"rank": dist.get_rank(), "src": describe_spec(src, names), "dst": describe_spec(dst, names),
              "grad": None if grad is None else describe_spec(grad, lowerer.names),
              "dtype": str(local.dtype) if is_tensor else type(local).__name__,
              "device": local.device.type if is_tensor else lowerer.mesh.device_type, "error": error,
              "type_error": type_error, "global_shape": gshape,
              "local_shape": tuple(local.shape) if is_tensor else None}
    check_agreement(record, debug_group(lowerer), local.device if is_tensor else lowerer.mesh.device_type,
                    where=where, **({} if hint is None else {"hint": hint}))
    assert prog is not None  # check_agreement raised otherwise
    return prog(local)

def debug_group(lowerer: Lowerer) -> ProcessGroup | None:
    if lowerer.mesh.mesh.numel() == dist.get_world_size():
        return None
    if lowerer.mesh.ndim == 1:
        return lowerer.groups[0]
    if lowerer._flat_group is None:
        lowerer._flat_group = lowerer.mesh._flatten().get_group()
    return lowerer._flat_group
