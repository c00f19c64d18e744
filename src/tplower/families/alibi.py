"""ALiBi built for all heads outside the attention module (BLOOM): each rank takes its own heads' slice.

BLOOM's model builds one ``alibi`` tensor for every head, shaped
``[batch * heads, 1, seq]`` (batch-major: row ``b * heads + h``), and passes
it to every attention module, which adds it to its ``[batch * num_heads, q, k]``
scores. Under a column split of ``query_key_value`` a rank computes
``num_heads / n`` heads (``local_attrs`` divides the count), so it needs the
rows of its own heads: a block of ``num_heads / n`` rows in every batch's group,
not one ``torch.chunk`` piece of dim 0 (no placement of the ``[batch * heads]``
dim says that). :func:`alibi_heads_forward` is the attention module's
``local_compute``: it slices ``alibi`` to the rank's heads and runs the
module's own ``forward``. The rank's heads are those of its piece of the
column-split projection (the first sharded parameter found under the module),
in mesh-coordinate order as ``torch.chunk`` gives them.

ALiBi has no learnable part (slopes from the head count); an ``alibi`` that
requires a gradient is refused, since each rank would give back the gradient
of its own heads only.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..core.support.errors import TPLowerError

__all__ = ["alibi_heads_forward", "local_alibi"]

_RANK = "_tplower_head_rank"


@functools.lru_cache(maxsize=64)
def _signature(forward: Any) -> inspect.Signature:
    return inspect.signature(forward)


def _head_rank(module: nn.Module) -> tuple[int, int]:
    """``(index, count)`` of this rank's piece of the module's column-split heads, found once and kept."""
    cached = module.__dict__.get(_RANK)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    for p in module.parameters():
        if isinstance(p, DTensor):
            dims = [i for i, q in enumerate(p.placements) if isinstance(q, Shard) and q.dim == 0]
            if len(dims) == 1:
                coord = p.device_mesh.get_coordinate()
                assert coord is not None, "parallelize checks that this rank is in the mesh"
                found = (coord[dims[0]], p.device_mesh.size(dims[0]))
                module.__dict__[_RANK] = found
                return found
    raise TPLowerError(f"{type(module).__name__}: alibi_heads_forward finds no parameter split on its dim 0 under "
                       "the module (the column-split query/key/value projection that gives each rank its heads); "
                       "plan the projection colwise, or drop local_compute from the attention entry")


def _int_attr(module: nn.Module, name: str) -> int:
    value = module.__dict__.get(name)
    if not isinstance(value, int):
        raise TPLowerError(f"{type(module).__name__}.{name} is {value!r}, not a head count; alibi_heads_forward "
                           "slices alibi to the module's (divided) num_heads")
    return value


def local_alibi(alibi: torch.Tensor, batch: int, local_heads: int, index: int) -> torch.Tensor:
    """This rank's heads of an ALiBi tensor built for all heads.

    Args:
        alibi: ``[batch * heads, ...]``, batch-major (BLOOM's layout).
        batch: the batch size.
        local_heads: heads this rank computes (``heads / n``).
        index: this rank's piece (``0 .. n-1``): heads ``index * local_heads`` up to the next piece.

    Returns:
        ``[batch * local_heads, ...]`` (``alibi`` itself when it holds ``local_heads`` heads already).

    Raises:
        TPLowerError: ``alibi``'s dim 0 is not a multiple of ``batch`` with at least ``local_heads`` heads each.
    """
    start = index * local_heads
    if alibi.shape[0] % batch or alibi.shape[0] // batch < start + local_heads:
        raise TPLowerError(f"alibi of shape {tuple(alibi.shape)} is not [batch * heads, ...] for batch {batch} "
                           f"with heads {start}..{start + local_heads - 1} on this rank")
    heads = alibi.shape[0] // batch
    if heads == local_heads:  # already local (built for this rank's heads)
        return alibi
    rest = alibi.shape[1:]
    return alibi.reshape(batch, heads, *rest)[:, start:start + local_heads].reshape(batch * local_heads, *rest)


def alibi_heads_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's own ``forward`` with its ``alibi`` argument sliced to this rank's heads.

    The batch size is the first argument's dim 0 (the hidden states), the local head count the module's
    ``num_heads`` (divided at install by ``local_attrs``).

    Raises:
        TPLowerError: ``alibi`` requires a gradient, or does not hold this rank's heads (see :func:`local_alibi`).
    """
    forward = type(module).forward
    bound = _signature(forward).bind(module, *args, **kwargs)
    alibi = bound.arguments.get("alibi")
    if isinstance(alibi, torch.Tensor):
        if alibi.requires_grad and torch.is_grad_enabled():
            raise TPLowerError(f"{type(module).__name__}: alibi requires a gradient; each rank would give back its "
                               "own heads' part only (ALiBi has no learnable part: build it without one)")
        hidden = next(iter(list(bound.arguments.values())[1:]))
        index, _ = _head_rank(module)
        bound.arguments["alibi"] = local_alibi(alibi, hidden.shape[0], _int_attr(module, "num_heads"), index)
    return forward(*bound.args, **bound.kwargs)
