"""Expert parallelism's token exchange under ``torch.compile``: exact sizes, one graph, no host read in it.

The eager dispatch (:mod:`tplower.core.ops.dispatch`) reads the count matrix on
the host to size its exchange and its permutations; in a trace each of those
reads (``bincount``, ``.tolist()``, ``repeat_interleave`` by counts, the split
sizes) is a graph break. Here the counts stay tensors, and the one
variable-split exchange is an operator of its own, ``tplower::split_exchange``
(:func:`split_exchange`), opaque to the compiler: its kernel reads the count
matrix (the host read every dropless dispatcher makes, here inside the
operator) and runs the same exchange as the eager dispatch; the trace only
learns that its output has some number of rows (an unbacked size, made by the
operator's fake kernel: no ``capture_scalar_outputs`` or
``capture_dynamic_output_shape_ops`` needed, with or without ``fullgraph``). Its
backward is the same operator with the matrix transposed (backward is a
transition too). Every other step is a traced tensor operation:

1. :func:`traced_route`: this rank's rows per expert (``scatter_add`` into
   ``E`` bins), one functional ``all_gather`` of them (the ``n x E`` counts
   every rank sees alike), and the permutation sorting this rank's
   ``(token, slot)`` rows by expert, stably;
2. :func:`traced_dispatch`: the rows permuted and exchanged, and the local
   expert of each received row;
3. :func:`traced_combine`: the exchange back, the inverse permutation and the
   weighted sum over each token's slots.

Nothing is dropped and nothing is padded: the rows and bytes are the eager
dispatch's, and one graph serves every routing. Two other ways were measured
on the bench's MoE layer (2 gloo ranks, inductor, one process, interleaved)
and not kept: split sizes read by ``.tolist()`` into unbacked sizes (the same
rows and bytes, but a plain ``torch.compile`` breaks there unless the user
sets ``capture_scalar_outputs``; its step took 1.08x this one's), and a
capacity-bounded exchange of static shapes (every rank sends ``T * k`` rows
to every rank, dropless at worst-case padding: 1.23x the bytes per step and
1.32x the step time). The received rows come in
source-rank order, each source's rows by expert; the experts implementation
groups them by expert itself (the eager dispatch sorts them first, which
changes nothing but the order of each expert's rows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size

from ..lower.backends import backend_caps, backend_name_for
from ..lower.collectives import _fc_all_gather, keep_backward
from .dispatch import _exchange

__all__ = ["TracedRoute", "split_exchange", "traced_combine", "traced_dispatch", "traced_experts", "traced_route"]


def _group(name: str) -> dist.ProcessGroup:
    group: dist.ProcessGroup = dist.distributed_c10d._resolve_process_group(name)  # type: ignore[attr-defined,arg-type]
    return group


@torch.library.custom_op("tplower::split_exchange", mutates_args=())
def split_exchange(x: torch.Tensor, matrix: torch.Tensor, rank: int, group_name: str) -> torch.Tensor:
    """A variable-split ``all_to_all`` of rows whose sizes are a tensor: an operator ``torch.compile`` keeps whole.

    ==========  =========================================================
    ``x``       ``[sum(matrix[rank]), *rest]``: the rows for group rank
                ``g`` are the ``matrix[rank, g]`` rows after those for
                ranks ``< g``
    ``matrix``  ``[n, n]`` integer, rows group rank ``s`` sends to ``d``;
                the same on every rank
    result      ``[sum(matrix[:, rank]), *rest]``: the rows from group
                rank ``s`` in rank order
    ==========  =========================================================

    The kernel reads ``matrix`` on the host and runs
    :func:`tplower.core.ops.dispatch.all_to_all_splits`'s exchange
    (``all_to_all_single`` where the backend has it, else an ``all_gather``
    of padded buffers); traced, the number of result rows is an unbacked
    size. Backward: the same operator with ``matrix`` transposed.
    """
    group = _group(group_name)
    rows = tuple(tuple(int(v) for v in row) for row in matrix.tolist())
    native = backend_caps(backend_name_for(group, x.device.type)).all_to_all
    return _exchange(x.contiguous(), group=group, matrix=rows, rank=rank, native=native)


@split_exchange.register_fake
def _split_exchange_fake(x: torch.Tensor, matrix: torch.Tensor, rank: int, group_name: str) -> torch.Tensor:
    ctx = torch.library.get_ctx()
    shape_env = getattr(ctx, "_shape_env", None)
    if shape_env is None:
        rows = ctx.new_dynamic_size()
    else:
        # A sum of counts, always a valid size: made directly, as torch's own device-mesh operator makes its
        # coordinate, so that a plain torch.compile traces it too (new_dynamic_size asks for fullgraph=True or
        # capture_dynamic_output_shape_ops, and is a graph break without them).
        rows = shape_env.create_unbacked_symint()
        _constrain_range_for_size(rows, min=0)
    return x.new_empty((rows, *x.shape[1:]))


def _setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...], output: torch.Tensor) -> None:
    _, ctx.matrix, ctx.rank, ctx.group_name = inputs  # type: ignore[attr-defined]


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
    swapped = ctx.matrix.t().contiguous()  # type: ignore[attr-defined]
    return split_exchange(grad, swapped, ctx.rank, ctx.group_name), None, None, None  # type: ignore[attr-defined]


split_exchange.register_autograd(_backward, setup_context=_setup)


class TracedRoute(NamedTuple):
    """One step's routing on one rank, as tensors (what :func:`traced_dispatch` and :func:`traced_combine` need).

    Attributes:
        counts: ``[n, n, E/n]`` int64, rows source rank ``s`` sends to owner
            ``d`` for its local expert ``e`` (the same on every rank).
        order: ``[T * k]`` int64, this rank's ``(token, slot)`` rows (flat
            index ``t * k + j``) sorted by expert, stably.
        top_k: slots per token (``k``).
        rank: this rank's group rank.
        group_name: the expert-parallel process group's name.
    """

    counts: torch.Tensor
    order: torch.Tensor
    top_k: int
    rank: int
    group_name: str


def traced_route(
    expert_ids: torch.Tensor, num_experts: int, n: int, rank: int, group: dist.ProcessGroup
) -> TracedRoute:
    """Plan one step's exchange from this rank's ``[T, k]`` top-k expert indices; collective over ``group``.

    ``num_experts`` (``E``) divides by ``n``, the group's size (checked when
    the experts module was parallelized). An index outside ``0 .. E-1``
    fails an assertion in the graph before the counts are exchanged.
    """
    flat = expert_ids.reshape(-1).to(torch.int64)
    torch._assert_async(
        ((flat >= 0) & (flat < num_experts)).all(),
        f"expert parallelism: a routing index is outside 0 .. {num_experts - 1} (num_experts={num_experts})",
    )
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts = counts.scatter_add(0, flat, torch.ones_like(flat))
    every = _fc_all_gather(counts, n, group).view(n, n, num_experts // n)
    return TracedRoute(every, torch.argsort(flat, stable=True), int(expert_ids.shape[1]), rank, group.group_name)


def traced_dispatch(x: torch.Tensor, route: TracedRoute) -> tuple[torch.Tensor, torch.Tensor]:
    """Send each token's copy for each of its slots to the rank holding that slot's expert.

    ========  ============================================================
    ``x``     ``[T, H]`` this rank's tokens (any trailing shape)
    result    ``[R, H]`` the rows for this rank's experts (by source rank,
              each source's rows by expert), and ``[R]`` int64 the local
              expert (``0 .. E/n - 1``) of each
    ========  ============================================================
    """
    rows = x.index_select(0, torch.div(route.order, route.top_k, rounding_mode="floor"))
    got = split_exchange(rows, route.counts.sum(-1), route.rank, route.group_name)
    received = route.counts[:, route.rank, :]  # [source, local expert]
    per = received.shape[1]
    local_ids = torch.arange(per, device=x.device).repeat(received.shape[0])
    experts = torch.repeat_interleave(local_ids, received.reshape(-1).to(x.device), output_size=got.shape[0])
    return got, experts


def traced_combine(
    y: torch.Tensor, route: TracedRoute, weights: torch.Tensor, dispatched: torch.Tensor
) -> torch.Tensor:
    """Bring the experts' ``[R, H]`` rows back to their tokens: ``[T, H]``, each token's slots summed by ``weights``.

    ``weights`` is ``[T, k]`` (cast to ``y``'s dtype before the product, as
    transformers' experts do); ``dispatched`` is what :func:`traced_dispatch`
    returned, joined to ``y`` so its backward exchange runs on every rank
    (:func:`tplower.core.lower.collectives.keep_backward`).
    """
    y = keep_backward(y, dispatched)
    back = split_exchange(y, route.counts.sum(-1).t().contiguous(), route.rank, route.group_name)
    inverse = torch.empty_like(route.order)
    inverse[route.order] = torch.arange(route.order.numel(), device=route.order.device)
    slots = back.index_select(0, inverse).unflatten(0, tuple(weights.shape))
    slots = slots * weights.to(slots.dtype).reshape(*weights.shape, *([1] * (slots.dim() - 2)))
    out: torch.Tensor = slots.sum(1)
    return out


def traced_experts(
    experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    n: int,
    rank: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Route, dispatch, run ``experts(rows, local_ids [R, 1], ones [R, 1])`` and combine: ``[T, H]`` out.

    ``experts`` is an experts module's own forward holding ``E/n`` experts.
    """
    route = traced_route(top_k_index, num_experts, n, rank, group)
    rows, local = traced_dispatch(hidden_states, route)
    ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
    out = experts(rows, local[:, None], ones)
    return traced_combine(out, route, top_k_weights, rows)
