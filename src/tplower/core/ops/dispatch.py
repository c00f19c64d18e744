"""Expert parallelism's token exchange: route each token to the rank that holds its expert, and back.

Experts are sharded by index over one process group, in contiguous blocks by
group rank: with ``E`` experts on ``n`` ranks, group rank ``g`` holds experts
``g * E/n .. (g+1) * E/n - 1`` (``Shard(0)`` on the expert dim of a packed
``[E, ...]`` weight, as transformers' expert parallelism shards them). The
steps, each a small function testable against one process (Megatron's
all-to-all token dispatcher names the same ones):

1. :func:`plan_dispatch`: count this rank's tokens per expert, exchange the
   counts (one ``all_gather`` of ``E`` integers per rank: every rank learns the
   whole ``n x E`` count matrix, so every split below is known everywhere), and
   derive the rows sent to and received from each rank, the permutation that
   sorts this rank's ``(token, slot)`` rows by expert, and the one that sorts
   the received rows by local expert.
2. :func:`dispatch_tokens`: permute the token rows by expert, one variable-split
   ``all_to_all`` (:func:`all_to_all_splits`), sort by local expert.
3. the experts compute on their rows (the model's own code).
4. :func:`combine_tokens`: each step's inverse, then the weighted sum over the top-k
   slots of each token.

The one collective with a gradient is :func:`all_to_all_splits`, whose
backward is the same collective with the splits swapped (backward is a
transition too); the permutations are ``index_select`` and differentiate as
such, so the gradients of the hidden states and of the routing weights are
exact. A rank that sends or receives nothing, an expert that receives no
token, and any ``top_k`` all work. Split sizes are host integers: planning
reads the counts on the host once per step (as every variable-split
dispatcher does). Under ``torch.compile`` those reads would be graph breaks:
the same steps run there as :mod:`tplower.core.ops.dispatch_traced` (the counts
kept as tensors, the exchange one operator).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..lower.backends import backend_caps, backend_name_for
from ..lower.collectives import _all_gather_base, keep_backward
from ..lower.program import Program
from ..support.errors import TPLowerError
from ..support.fake import host_values, is_fake
from ..support.words import count

__all__ = ["DispatchPlan", "all_to_all_splits", "combine_tokens", "dispatch_tokens", "plan_dispatch"]



def _a2a_native(x: torch.Tensor, group: ProcessGroup, out_rows: int, output_splits: Sequence[int],
                input_splits: Sequence[int]) -> torch.Tensor:
    out = x.new_empty((out_rows, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(output_splits), list(input_splits), group=group)
    return out


def _a2a_via_gather(x: torch.Tensor, group: ProcessGroup, matrix: Sequence[Sequence[int]], rank: int
                    ) -> torch.Tensor:
    """The same exchange on a backend without ``all_to_all``: every rank gathers every padded send buffer."""
    n = len(matrix)
    width = max(max(row) for row in matrix)
    send = x.new_zeros((n * width, *x.shape[1:]))
    start = 0
    for dst, rows in enumerate(matrix[rank]):
        send.narrow(0, dst * width, rows).copy_(x.narrow(0, start, rows))
        start += rows
    every = x.new_empty((n * n * width, *x.shape[1:]))
    _all_gather_base(every, send, group=group)
    pieces = [every.narrow(0, (src * n + rank) * width, matrix[src][rank]) for src in range(n)]
    return torch.cat(pieces)


def _exchange(x: torch.Tensor, *, group: ProcessGroup, matrix: tuple[tuple[int, ...], ...], rank: int,
               native: bool) -> torch.Tensor:
    out_rows = sum(row[rank] for row in matrix)
    if not any(any(row) for row in matrix):  # nothing moves anywhere: every rank skips alike
        return x.new_empty((out_rows, *x.shape[1:]))
    if native:
        return _a2a_native(x, group, out_rows, [row[rank] for row in matrix], matrix[rank])
    return _a2a_via_gather(x, group, matrix, rank)


def all_to_all_splits(x: torch.Tensor, *, group: ProcessGroup, matrix: Sequence[Sequence[int]], rank: int,
                      native: bool | None = None) -> torch.Tensor:
    """A variable-split ``all_to_all`` of rows, differentiable: backward is the same exchange with the splits swapped.

    ==========  =======================================================
    ``x``       ``[sum(matrix[rank]), *rest]``: the rows for group rank
                ``g`` are the ``matrix[rank][g]`` rows after those for
                ranks ``< g``
    result      ``[sum(matrix[s][rank] for s), *rest]``: the rows from
                group rank ``s`` in rank order
    ==========  =======================================================

    Args:
        group: the process group (ranks are group ranks).
        matrix: ``matrix[s][d]`` = rows group rank ``s`` sends to ``d``; the
            same on every rank (backward uses its transpose).
        rank: this process's group rank.
        native: use ``all_to_all_single`` (default: when the group's backend
            has it for ``x``'s device, else ``all_gather`` of padded send
            buffers and the local rows, chosen once per call site).

    Raises:
        TPLowerError: ``x`` does not hold ``sum(matrix[rank])`` rows.
    """
    want = sum(matrix[rank])
    if x.dim() == 0 or x.shape[0] != want:
        raise TPLowerError(f"all_to_all_splits: x has {tuple(x.shape)[:1] or 'no'} rows but matrix[{rank}] sends "
                           f"{want}")
    if native is None:
        native = backend_caps(backend_name_for(group, x.device.type)).all_to_all
    frozen = tuple(tuple(int(v) for v in row) for row in matrix)
    swapped = tuple(zip(*frozen, strict=True))
    # The same Program and autograd Function as every placement transition (so teardown releases its group):
    # forward the exchange, backward the same exchange with the splits swapped.
    program = Program(None, (functools.partial(_exchange, group=group, matrix=frozen, rank=rank, native=native),),
                      (functools.partial(_exchange, group=group, matrix=swapped, rank=rank, native=native),))
    return program(x)


@dataclass(frozen=True)
class DispatchPlan:
    """One step's routing on one rank: what :func:`dispatch_tokens` and :func:`combine_tokens` need.

    Attributes:
        num_experts: ``E``, experts over the whole group.
        top_k: slots per token (``k``).
        num_tokens: ``T``, this rank's tokens.
        rank, group_size: this rank's group rank and ``n``.
        matrix: ``matrix[s][d]`` = rows group rank ``s`` sends to ``d``.
        order: ``[T * k]`` int64, this rank's ``(token, slot)`` rows (flat
            index ``t * k + j``) sorted by expert, stably.
        local_order: ``[R]`` int64, the received rows sorted by local expert
            (stably: by source rank, then token order within it).
        tokens_per_expert: ``[E/n]`` int64, rows each local expert receives.
        local_experts: ``[R]`` int64, the local expert (``0 .. E/n - 1``) of each
            row :func:`dispatch_tokens` returns.
    """

    num_experts: int
    top_k: int
    num_tokens: int
    rank: int
    group_size: int
    matrix: tuple[tuple[int, ...], ...]
    order: torch.Tensor
    local_order: torch.Tensor
    tokens_per_expert: torch.Tensor
    local_experts: torch.Tensor
    group: ProcessGroup
    native: bool

    @property
    def experts_per_rank(self) -> int:
        """``E / n``."""
        return self.num_experts // self.group_size


def _check_ids(expert_ids: Any, num_experts: Any, n: int) -> None:
    if not isinstance(expert_ids, torch.Tensor) or expert_ids.dim() != 2 or expert_ids.dtype.is_floating_point \
            or expert_ids.dtype == torch.bool:
        what = f"a {expert_ids.dim()}-D {expert_ids.dtype} tensor" if isinstance(expert_ids, torch.Tensor) else \
            type(expert_ids).__name__
        raise TPLowerError(f"plan_dispatch: expert_ids must be an integer tensor [tokens, top_k] (the router's top-k "
                           f"indices), got {what}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise TPLowerError(f"plan_dispatch: num_experts={num_experts!r} must be an int >= 1")
    if num_experts % n:
        raise TPLowerError(f"plan_dispatch: num_experts={num_experts} does not divide over the {n} ranks of the "
                           f"expert-parallel group; use an expert-parallel size that divides it")


def plan_dispatch(expert_ids: torch.Tensor, num_experts: int, group: ProcessGroup) -> DispatchPlan:
    """Plan one step's exchange from this rank's top-k expert indices; collective over ``group``.

    Args:
        expert_ids: ``[T, k]`` integer, the expert of each token's slot
            (``0 .. E-1``; ``T`` may differ between ranks and be 0).
        num_experts: ``E``; must divide by the group's size.
        group: the expert-parallel process group.

    Returns:
        The :class:`DispatchPlan` (the count matrix is the same on every rank). For fake ``expert_ids`` (a step
        traced by :mod:`tplower.planner`) the routing is taken as balanced (:func:`_balanced`).

    Raises:
        TPLowerError: ``expert_ids`` not an integer ``[T, k]`` tensor, an index
            outside ``0 .. E-1`` (checked on this rank before any collective),
            or ``E`` that does not divide over the group.
    """
    n = dist.get_world_size(group)
    _check_ids(expert_ids, num_experts, n)
    rank = dist.get_group_rank(group, dist.get_rank())
    fake = is_fake(expert_ids)
    if fake:
        flat, every = _balanced(expert_ids, num_experts, group)
    else:
        flat = expert_ids.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
            raise TPLowerError(f"plan_dispatch: expert_ids hold {int(flat.min())} .. {int(flat.max())}, outside "
                               f"0 .. {num_experts - 1} (num_experts={num_experts})")
        counts = torch.bincount(flat, minlength=num_experts)
        every = counts.new_empty((n * num_experts,))
        _all_gather_base(every, counts, group=group)
    with host_values() if fake else contextlib.nullcontext():  # (fake: the assumed routing's real values)
        per_rank = num_experts // n
        by_expert = every.view(n, n, per_rank)  # [source rank, owner rank, local expert]
        matrix = tuple(tuple(int(v) for v in row) for row in by_expert.sum(-1).tolist())
        received = by_expert[:, rank, :]  # [source, local expert]
        local_ids = torch.arange(per_rank, device=flat.device).repeat(n)
        recv_expert = torch.repeat_interleave(local_ids, received.reshape(-1).to(flat.device))
        local_order = torch.argsort(recv_expert, stable=True)
        order, tokens, local_experts = (torch.argsort(flat, stable=True), received.sum(0).to(flat.device),
                                        recv_expert.index_select(0, local_order))
    backend = backend_name_for(group, expert_ids.device.type)
    return DispatchPlan(num_experts, int(expert_ids.shape[1]), int(expert_ids.shape[0]), rank, n, matrix,
                        order, local_order, tokens, local_experts, group, backend_caps(backend).all_to_all)


def _balanced(expert_ids: torch.Tensor, num_experts: int, group: ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake ``expert_ids`` (a step traced by :mod:`tplower.planner`, whose routing has no values): the routing
    assumed is balanced, slot ``s`` of this rank's ``T * k`` to expert ``s mod E``, the same on every rank.

    Returns ``(flat, every)``: the assumed expert of each slot and the ``n x E`` count matrix, flattened, both real
    (host) tensors; the counts' ``all_gather`` is issued all the same, on fake tensors, as a real step issues it.
    """
    n = dist.get_world_size(group)
    _all_gather_base(expert_ids.new_empty((n * num_experts,), dtype=torch.int64),
                     expert_ids.new_empty((num_experts,), dtype=torch.int64), group=group)
    with host_values():
        flat = torch.arange(expert_ids.numel(), dtype=torch.int64) % num_experts
        every = torch.bincount(flat, minlength=num_experts).repeat(n)
    return flat, every


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def dispatch_tokens(x: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Send each token's copy for each of its ``k`` slots to the rank holding that slot's expert.

    ========  ============================================================
    ``x``     ``[T, H]`` this rank's tokens (any trailing shape)
    result    ``[R, H]`` the rows for this rank's experts, sorted by local
              expert (``plan.local_experts`` names each row's expert,
              ``plan.tokens_per_expert`` counts them)
    ========  ============================================================

    Backward: the gradient rows travel back by the same exchange with the
    splits swapped and sum over the slots of each token.

    Raises:
        TPLowerError: ``x`` does not hold the plan's ``T`` tokens.
    """
    if x.dim() == 0 or x.shape[0] != plan.num_tokens:
        raise TPLowerError(f"dispatch_tokens: x has shape {tuple(x.shape)} but the plan routes {plan.num_tokens} "
                           "tokens")
    rows = x.index_select(0, torch.div(plan.order, plan.top_k, rounding_mode="floor"))
    got = all_to_all_splits(rows, group=plan.group, matrix=plan.matrix, rank=plan.rank, native=plan.native)
    return got.index_select(0, plan.local_order)


def combine_tokens(y: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor | None = None, *,
                   dispatched: torch.Tensor | None = None) -> torch.Tensor:
    """Bring each expert's output rows back to their tokens and sum each token's ``k`` slots.

    ==============  ======================================================
    ``y``           ``[R, H]`` expert outputs, in :func:`dispatch_tokens`'s row order
    ``weights``     ``[T, k]`` routing weights (``None``: 1), cast to ``y``'s
                    dtype before the product, as transformers' experts do
    ``dispatched``  ``[R, H]``: what :func:`dispatch_tokens` returned for
                    this plan (give it whenever ``y`` is computed from it)
    result          ``[T, H]``: ``sum_j weights[t, j] * y[row of (t, j)]``
    ==============  ======================================================

    Backward: the gradients of ``y`` and of ``weights``, exactly. With
    ``dispatched`` given, the dispatch's backward exchange runs on this rank
    whenever the combine's does, even where ``y`` does not depend on the
    rows (an experts implementation that skips experts with no row returns
    ``zeros_like`` on a rank that received none): every rank then issues the
    backward ``all_to_all`` that the others wait for
    (:func:`tplower.core.lower.collectives.keep_backward`).

    Raises:
        TPLowerError: ``y`` or ``weights`` of the wrong size.
    """
    rows_here = int(plan.local_order.numel())
    if y.dim() == 0 or y.shape[0] != rows_here:
        raise TPLowerError(f"combine_tokens: y has shape {tuple(y.shape)} but the plan gave this rank "
                           f"{count(rows_here, 'row')}")
    if weights is not None and tuple(weights.shape) != (plan.num_tokens, plan.top_k):
        raise TPLowerError(f"combine_tokens: weights have shape {tuple(weights.shape)}, expected "
                           f"{(plan.num_tokens, plan.top_k)} (tokens, top_k)")
    if dispatched is not None:
        y = keep_backward(y, dispatched)
    received = y.index_select(0, _inverse(plan.local_order))
    transposed = tuple(zip(*plan.matrix, strict=True))
    back = all_to_all_splits(received, group=plan.group, matrix=transposed, rank=plan.rank, native=plan.native)
    slots = back.index_select(0, _inverse(plan.order)).unflatten(0, (plan.num_tokens, plan.top_k))
    if weights is not None:
        slots = slots * weights.to(slots.dtype).reshape(*weights.shape, *([1] * (slots.dim() - 2)))
    out: torch.Tensor = slots.sum(1)
    return out
