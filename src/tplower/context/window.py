"""The all-gather mode's keys under a sliding window: each holder receives only the keys its queries' windows reach.

A causal layer with a window of ``W`` keys lets the query at ``q`` see at
most the keys ``[q - W + 1, q]``, so a piece of queries ``[a, b)`` reaches
the keys ``[a - W + 1, b)`` (:meth:`~tplower.context.layout.SequenceLayout.reach`).
Where every rank's windows reach fewer keys than the whole sequence, the
all-gather mode's ``S(seq) -> R`` of keys and values (every rank receives
every key) is replaced by one variable-split ``all_to_all`` of keys and values
stacked (:func:`~tplower.core.ops.dispatch.all_to_all_splits`): holder ``s``
sends holder ``d`` the keys ``d``'s windows reach that ``s`` holds, and its
backward, the same exchange with the splits swapped, sends each key's
gradient back to the holder of the key (backward is a transition too). With
``n`` ranks, pieces of ``p`` tokens and ``W <= p`` a rank receives about
``W`` keys for each of its pieces that a piece of another rank precedes,
where the all-gather delivers ``(n - 1)`` of its whole local lengths.

A holder is a rank of the all-gather mode, or a group of the hybrid mode
(its ranks' padded pieces after the Ulysses exchange inside it). The keys a
holder ends up with are those of its reach in global order, laid end to end
as :attr:`WindowKeys.segments`; the kernel reads a piece's keys at
:meth:`WindowKeys.key_at` (:func:`~tplower.context.kernels.attend_runs`'s
``k_at``). The plan is arithmetic on the layout, the same on every rank;
where the windows reach every key, or a holder holds no token (a rank's
placeholder query sees every key), there is none (:func:`plan_window_keys`
returns ``None``) and the mode gathers every key as without a window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..core.lower.mesh_facts import axis_order, mesh_facts
from ..core.ops.dispatch import all_to_all_splits
from .layout import SequenceLayout, merge_spans

__all__ = ["WindowKeys", "axis_group_ranks", "exchange_window_keys", "holder_keys", "plan_window_keys"]


@dataclass(frozen=True, eq=False)
class WindowKeys:
    """One holder's exchange of the keys its windows reach.

    Attributes:
        send: ``[R]`` int64, the local slots this holder sends, to each other holder in group-rank order (each
            destination's in ascending global position).
        matrix: ``matrix[s][d]``, the keys group rank ``s`` sends to group rank ``d`` (``0`` on the diagonal).
        take: ``[N]`` int64, where each reached key is among this holder's slots followed by the received rows:
            the reached keys in global order.
        segments: ``(lo, hi, at)`` per reached span: global keys ``[lo, hi)`` at ``[at, at + hi - lo)`` of the
            ``N`` keys.
        group_rank: this holder's rank in the exchange's group.
    """

    send: torch.Tensor
    matrix: tuple[tuple[int, ...], ...]
    take: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]
    group_rank: int

    def key_at(self, start: int) -> int:
        """The global position that index 0 of the reached keys stands for, for the span holding the key at
        ``start`` (a piece's first query): its keys ``[kl, kh)`` are then at ``[kl - key_at, kh - key_at)``.

        Raises:
            ValueError: no reached span holds ``start``.
        """
        for lo, hi, at in self.segments:
            if lo <= start < hi:
                return lo - at
        raise ValueError(f"key_at: position {start} lies in no reached span {self.segments}")


def axis_group_ranks(mesh: DeviceMesh, axis: str) -> tuple[int, ...]:
    """The rank in ``mesh.get_group(axis)`` of each coordinate along ``axis`` (this rank's other coordinates
    fixed): a mesh whose ranks are not in group order still exchanges with the right peers (the lowerer's own
    reading of the mesh, :func:`~tplower.core.lower.mesh_facts.axis_order`)."""
    dim = tuple(mesh.mesh_dim_names or ()).index(axis)
    _, along, groups = mesh_facts(mesh)
    order = axis_order(axis, list(along[dim]), list(groups[dim]))
    return tuple(range(mesh.size(dim))) if order is None else order


def holder_keys(layout: SequenceLayout, window: int, holders: int, padded: bool
                ) -> tuple[list[torch.Tensor], list[tuple[tuple[int, int], ...]]]:
    """:func:`plan_window_keys`'s ``slots`` and ``needs`` for ``holders`` holders of ``layout``'s ranks: holder
    ``h`` holds ranks ``h * u .. h * u + u - 1`` (``u = n / holders``) and reaches what their windows of ``window``
    keys reach; ``padded``: each rank's pieces padded to the longest (the hybrid mode's groups, as the Ulysses
    exchange inside a group lays them), else laid end to end (a rank of the all-gather mode)."""
    u, width = layout.size // holders, max(layout.lengths)
    slots, needs = [], []
    for h in range(holders):
        ranks = range(h * u, h * u + u)
        pieces = [layout.global_index(r) for r in ranks]
        if padded:
            pieces = [torch.cat([p, p.new_full((width - p.numel(),), -1)]) for p in pieces]
        slots.append(torch.cat(pieces))
        needs.append(merge_spans([span for r in ranks for span in layout.reach(r, window)]))
    return slots, needs


def plan_window_keys(slots: Sequence[torch.Tensor], needs: Sequence[tuple[tuple[int, int], ...]], me: int,
                     length: int, group_ranks: Sequence[int]) -> WindowKeys | None:
    """Holder ``me``'s exchange of reached keys; ``None`` where it would not send less than the all-gather.

    Args:
        slots: per holder, ``[slots]`` int64: the global position each local slot holds (``-1``: padding).
        needs: per holder, the spans ``[lo, hi)`` of keys its queries reach (disjoint, ascending, its own
            tokens among them).
        me: this holder's index in ``slots``.
        length: ``S``, the positions held over all holders.
        group_ranks: per holder, its rank in the exchange's group.

    Returns:
        ``None`` where every holder's reach is every key (the windows hide nothing the all-gather would not
        deliver) or a holder holds no token; else :class:`WindowKeys`.
    """
    m = len(slots)
    owner = torch.full((length,), -1, dtype=torch.int64)
    slot = torch.full((length,), -1, dtype=torch.int64)
    for h, held in enumerate(slots):
        real = torch.nonzero(held >= 0).view(-1)
        if not real.numel():
            return None
        owner[held[real]], slot[held[real]] = h, real
    want = []
    for spans in needs:
        w = torch.zeros(length, dtype=torch.bool)
        for lo, hi in spans:
            w[lo:hi] = True
        want.append(w)
    if all(bool((want[h] | (owner == h)).all()) for h in range(m)):
        return None
    matrix = [[0] * m for _ in range(m)]
    for s in range(m):
        for d in range(m):
            if s != d:
                matrix[group_ranks[s]][group_ranks[d]] = int((want[d] & (owner == s)).sum())
    by_rank = sorted(range(m), key=lambda h: group_ranks[h])
    send = [slot[want[d] & (owner == me)] for d in by_rank if d != me]
    received = torch.cat([torch.nonzero(want[me] & (owner == s)).view(-1) for s in by_rank if s != me])
    index = torch.full((length,), -1, dtype=torch.int64)
    index[owner == me] = slot[owner == me]
    index[received] = slots[me].numel() + torch.arange(received.numel())
    segments, at = [], 0
    for lo, hi in needs[me]:
        segments.append((lo, hi, at))
        at += hi - lo
    return WindowKeys(torch.cat(send) if send else torch.zeros(0, dtype=torch.int64),
                      tuple(tuple(row) for row in matrix), index[want[me]], tuple(segments), group_ranks[me])


def exchange_window_keys(k: torch.Tensor, v: torch.Tensor, plan: WindowKeys,
                         group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[B, H_kv, slots, D]`` of this holder's slots -> ``[B, H_kv, N, D]``, the keys its windows
    reach in global order (:attr:`WindowKeys.segments`): one ``all_to_all`` of keys and values stacked, whose
    backward sends their gradients back to the holders of the keys (the same exchange, splits swapped)."""
    send = plan.send.to(k.device)
    rows = torch.stack((k.index_select(2, send), v.index_select(2, send))).permute(3, 0, 1, 2, 4).contiguous()
    got = all_to_all_splits(rows, group=group, matrix=plan.matrix, rank=plan.group_rank).permute(1, 2, 3, 0, 4)
    take = plan.take.to(k.device)
    return torch.cat((k, got[0]), dim=2).index_select(2, take), torch.cat((v, got[1]), dim=2).index_select(2, take)
