"""Count the collectives a piece of code issues and the bytes each rank sends, whoever issues them.

:class:`CollectiveTraffic` is a ``TorchDispatchMode``: every collective reaches
the dispatcher as an operator, whether issued by ``torch.distributed``'s
functions (``c10d.allreduce_``, ``c10d._allgather_base_``,
``c10d.alltoall_base_``, ...: tplower's lowered transitions) or by functional
collectives (``_c10d_functional.all_reduce``, ...: DTensor and so
transformers' tensor parallelism), forward and backward (the autograd engine
carries the mode into backward on the calling thread). Bytes sent per rank
follow the ring conventions of :mod:`tplower.core.language.transitions`
(``all_reduce`` ``2(n-1)/n`` of the tensor, ``all_gather`` and
``reduce_scatter`` ``n-1`` pieces, ``all_to_all`` every row bound for another
rank), so they compare across libraries. The compiled expert dispatch's
exchange (``tplower::split_exchange``, an operator whose kernel issues the
``all_to_all``) counts as that ``all_to_all``.

The mode sees every operator call, so it costs time: count on an untimed step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveTraffic"]


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group(args: Sequence[Any]) -> dist.ProcessGroup | None:
    """The process group among a collective operator's arguments (a boxed group, or a functional group's name)."""
    for a in args:
        if isinstance(a, torch.ScriptObject):  # a c10d operator's ProcessGroup
            return dist.ProcessGroup.unbox(a)
        if isinstance(a, str) and a not in ("sum", "avg", "max", "min", "product"):
            try:  # a functional collective names its group; c10d resolves the name
                group: dist.ProcessGroup = dist.distributed_c10d._resolve_process_group(a)  # type: ignore[attr-defined,arg-type]
            except (KeyError, RuntimeError, ValueError):
                continue
            return group
    return None


def _a2a_sent(t: torch.Tensor, input_splits: Sequence[int] | None, n: int, rank: int) -> int:
    """Bytes of the rows of ``t`` bound for other ranks (``input_splits`` rows per rank, or equal pieces)."""
    if not t.numel():
        return 0
    row = _bytes(t) // max(t.shape[0], 1) if t.dim() else _bytes(t)
    if input_splits:
        return sum(int(s) for i, s in enumerate(input_splits) if i != rank) * row
    return (n - 1) * _bytes(t) // n


class CollectiveTraffic(TorchDispatchMode):
    """While active: ``counts[kind]`` collectives issued and ``sent`` bytes this rank sends.

    Kinds are ``all_reduce``, ``all_gather``, ``reduce_scatter``,
    ``all_to_all`` and ``broadcast``. A ``wait`` is not a collective. Use as
    ``with CollectiveTraffic() as t: step()`` then read ``t.counts`` and
    ``t.sent`` (bytes, int). ``by_group[(group name, kind)]`` is ``[count, bytes sent]`` of each process group
    (``ProcessGroup.group_name``; a mesh axis's group is ``mesh.get_group(axis)``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.sent = 0
        self.by_group: dict[tuple[str, str], list[int]] = {}
        self._name = ""

    def _record(self, kind: str, nbytes: int) -> None:
        self.counts[kind] += 1
        self.sent += int(nbytes)
        row = self.by_group.setdefault((self._name, kind), [0, 0])
        row[0] += 1
        row[1] += int(nbytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        ns, name = func.namespace, func._opname
        if ns in ("c10d", "_c10d_functional") or (ns, name) == ("tplower", "split_exchange"):
            self._count(ns, name, args)
        return func(*args, **(kwargs or {}))

    def _count(self, ns: str, name: str, args: Sequence[Any]) -> None:
        group = _group(args)
        n = group.size() if group is not None else 1
        if n <= 1:
            return
        self._name = group.group_name if group is not None else ""
        rank = dist.get_rank(group)
        if name in ("allreduce_", "all_reduce", "all_reduce_coalesced", "allreduce_coalesced_"):
            tensors = args[0] if isinstance(args[0], list | tuple) else [args[0]]
            self._record("all_reduce", sum(2 * (n - 1) * _bytes(t) // n for t in tensors))
        elif name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
            self._record("all_gather", (n - 1) * _bytes(args[1]) if isinstance(args[1], torch.Tensor) else 0)
        elif name == "allgather_":
            self._record("all_gather", sum((n - 1) * _bytes(t) for t in args[1]))
        elif name in ("all_gather_into_tensor", "all_gather_into_tensor_out"):
            self._record("all_gather", (n - 1) * _bytes(args[0]))
        elif name in ("_reduce_scatter_base_",):
            self._record("reduce_scatter", (n - 1) * _bytes(args[0]))
        elif name == "reduce_scatter_tensor":
            self._record("reduce_scatter", (n - 1) * _bytes(args[0]) // n)
        elif name == "alltoall_base_":
            self._record("all_to_all", _a2a_sent(args[1], args[4], n, rank))
        elif name == "all_to_all_single":
            self._record("all_to_all", _a2a_sent(args[0], args[2], n, rank))
        elif name == "split_exchange":  # (rows, matrix [n, n] of rows s -> d, group rank, group name)
            self._record("all_to_all", _a2a_sent(args[0], args[1][args[2]].tolist(), n, rank))
        elif name in ("broadcast_", "broadcast"):
            self._record("broadcast", 0)
