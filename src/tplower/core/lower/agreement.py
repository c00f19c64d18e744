"""The debug check: ranks compare what they are about to do before any collective starts.

Switched on by ``TPLOWER_DEBUG=1`` in the environment (read when a mesh's
lowerer is made; set it alike on every rank) or per call with
``redistribute_local(..., check=True)``. Each rank describes its call (its
placements, dtype, device, global shape and any error it met while
planning); the ranks first exchange a 64-bit digest of the description and
an error flag (one small ``all_gather``), and only when those differ the full
descriptions (``all_gather_object``), so that every rank raises the same
:class:`~tplower.TPLowerError` naming the differing ranks. Without the check, a disagreement ends in the
backend's own error or the process group's timeout.
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..support.errors import TPLowerError, TPLowerTypeError
from .collectives import _all_gather_base

__all__ = ["AGREED_FIELDS", "check_agreement", "debug_enabled"]

#: Fields every rank's description must share (local shapes may differ: uneven shards).
AGREED_FIELDS: tuple[str, ...] = ("src", "dst", "grad", "dtype", "device", "global_shape")


def debug_enabled() -> bool:
    """Whether ``TPLOWER_DEBUG=1`` is set (the one environment switch tplower reads)."""
    return os.environ.get("TPLOWER_DEBUG", "") == "1"


def _digest(record: dict[str, Any]) -> int:
    text = repr([record[f] for f in AGREED_FIELDS]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


def check_agreement(record: dict[str, Any], group: ProcessGroup | None,
                    device: torch.device | str = "cpu", *, where: str | None = None,
                    hint: str = "uneven shards need global_shape=") -> None:
    """Exchange ``record`` over ``group``; raise on every rank if the ranks disagree.

    Args:
        record: this rank's description: ``rank``, the :data:`AGREED_FIELDS`,
            ``error`` (a message, or ``None``) and optionally ``type_error``
            (whether that error was a ``TypeError``) and ``local_shape``
            (compared only to name the dims whose local sizes differ when
            ``global_shape`` differs).
        group: the process group spanning the mesh (``None``: the default group).
        device: where the small digest tensor lives (the data's device, so
            NCCL groups get a CUDA tensor).
        where: what is being moved (``module 'up', input '0'``), put first
            in the message.
        hint: the fix for local sizes that differ (uneven shards).

    Raises:
        TPLowerError: on every rank alike, when any rank reported an error
            or any agreed field differs; the message lists each differing
            field with the ranks holding each value, then each rank's error.
            A :class:`~tplower.core.support.errors.TPLowerTypeError` (also a ``TypeError``)
            when any rank's error was a ``TypeError``.
    """
    size = dist.get_world_size(group)
    mine = torch.tensor([_digest(record), int(record["error"] is not None)], dtype=torch.int64, device=device)
    every = torch.empty(2 * size, dtype=torch.int64, device=device)
    _all_gather_base(every, mine, group=group)
    digests, errors = every[0::2], every[1::2]
    if bool((digests == digests[0]).all()) and not bool(errors.any()):
        return
    records: list[Any] = [None] * size
    dist.all_gather_object(records, record, group=group)
    problems = []
    for field in AGREED_FIELDS:
        by_value: dict[str, list[int]] = defaultdict(list)
        for r in records:
            by_value[repr(r[field])].append(r["rank"])
        if len(by_value) > 1:
            problems.append(f"{field} differs: " + "; ".join(f"{v} on ranks {rs}" for v, rs in by_value.items()))
            if field == "global_shape":
                problems += _local_sizes(records, hint)
    problems += [f"rank {r['rank']}: {r['error']}" for r in records if r["error"]]
    if problems:
        cls = TPLowerTypeError if any(r.get("type_error") for r in records) else TPLowerError
        head = "ranks disagree before the collective (debug check):\n  "
        raise cls((f"{where}: " if where else "") + head + "\n  ".join(problems))


def _local_sizes(records: list[Any], hint: str) -> list[str]:
    """One line per tensor dim whose local size differs across ranks (when every rank's ndim agrees)."""
    shapes = [r.get("local_shape") for r in records]
    if any(s is None for s in shapes) or len({len(s) for s in shapes}) != 1:
        return []
    lines = []
    for d in range(len(shapes[0])):
        by_size: dict[int, list[int]] = defaultdict(list)
        for r, s in zip(records, shapes, strict=True):
            by_size[s[d]].append(r["rank"])
        if len(by_size) > 1:
            sizes = "; ".join(f"{v} on ranks {rs}" for v, rs in by_size.items())
            lines.append(f"local size of dim {d} differs: {sizes} ({hint})")
    return lines
