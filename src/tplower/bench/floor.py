"""The communication floor of a model step: the same step with every collective moving nothing.

Each rank of the model phase builds a second ``tp`` group on PyTorch's
``fake`` backend (:func:`floor_group`: a ``fake`` subgroup of the real
default group, as ``DeviceMesh`` makes for axes it does not use), over the
same ranks: its collectives take and return tensors of the right shapes and
return at once, so a model parallelized on it runs every kernel, every
``torch.distributed`` call and every line of Python of the real step, and
communicates nothing. Its copies run in the same rounds as the real ones,
on the same processes and the same loaded machine, so

    share = (step - floor) / floor

reads as the time a step spends on communication (and on waiting for the
other rank) per unit of its own work; ``0`` would be a step whose
collectives cost nothing. Each real copy runs right before its floor copy,
and the share is the median of the rounds' own ratios
(:func:`paired_share`). A rowwise layer's forward all_reduce leaves the
partial sum in place on the fake group, so values differ from the real
step; shapes, and so the work, do not.

PyTorch's own recipe for such a group, ``init_process_group("fake",
store=FakeStore(), ...)``, replaces the default group and needs a process of
its own; the subgroup keeps the real group beside it, and with it the
barriers that line the ranks up before each timed step.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FLOOR", "FLOOR_AXIS", "comm_share", "floor_group", "floor_of", "paired_share", "with_shares"]

#: the suffix of a floor copy's variant name: ``tplower`` runs beside ``tplower_floor``
FLOOR = "_floor"
#: the floor mesh's axis name. Not ``tp``: ``DeviceMesh`` equality reads ranks and names, not backends, so a
#: ``tp`` mesh on the fake group would equal the real ``tp`` mesh, and DTensor's caches, keyed on meshes, would
#: run the floor copy's collectives on the real group (seen at the dispatcher: gloo all_reduces).
FLOOR_AXIS = "tp_floor"


def floor_group(device_type: str = "cpu") -> tuple[ProcessGroup, DeviceMesh]:
    """A ``fake`` process group over every rank of the default group, and a 1-D mesh on it (axis :data:`FLOOR_AXIS`).

    Collective: every rank calls it, in the same order as its other groups.

    Raises:
        RuntimeError: no default process group.
    """
    if not dist.is_initialized():
        raise RuntimeError("floor_group needs the default process group (dist.init_process_group) first")
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    group = dist.new_group(list(range(dist.get_world_size())), backend="fake")
    assert isinstance(group, ProcessGroup)
    return group, DeviceMesh.from_group(group, device_type, mesh_dim_names=(FLOOR_AXIS,))


def floor_of(variant: str) -> str:
    """The floor copy's variant name of ``variant``."""
    return variant + FLOOR


def comm_share(step_ms: float, floor_ms: float) -> float:
    """``(step - floor) / floor``: the step's time beyond its floor, per unit of the floor.

    Raises:
        ValueError: a floor that is not positive.
    """
    if not floor_ms > 0:
        raise ValueError(f"floor_ms={floor_ms!r} must be positive")
    return (step_ms - floor_ms) / floor_ms


def paired_share(steps_ms: Sequence[float], floors_ms: Sequence[float]) -> float:
    """The median over rounds of each round's :func:`comm_share` (the two samples of a round ran one after the
    other, so a load that drifts over the run, as on a shared machine, cancels out of each pair).

    Raises:
        ValueError: the two lists differ in length or are empty, or a floor is not positive.
    """
    if len(steps_ms) != len(floors_ms) or not steps_ms:
        raise ValueError(
            f"steps_ms and floors_ms must be paired samples of the same rounds, got {len(steps_ms)} "
            f"and {len(floors_ms)}"
        )
    return statistics.median(comm_share(s, f) for s, f in zip(steps_ms, floors_ms, strict=True))


def with_shares(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The model rows, each with a floor copy given ``floor_ms`` (its median) and ``comm_share``
    (:func:`paired_share` of the train step samples); the floor rows themselves are left as they are."""
    by = {(r["model"], r["variant"]): r for r in rows}
    out = []
    for r in rows:
        floor = by.get((r["model"], floor_of(r["variant"])))
        if floor is not None:
            r = r | {
                "floor_ms": floor["train_step_ms"],
                "comm_share": paired_share(r["step_samples_ms"], floor["step_samples_ms"]),
            }
        out.append(r)
    return out
