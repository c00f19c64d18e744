"""Which ranks share data: the mesh axes a training stack's batches are cut over, and sums over them.

A training mesh has axes among ``dp`` (data parallelism: each coordinate reads its own batches; FSDP2 shards
the parameters over it), ``cp`` (context parallelism: the ranks split each batch's sequence), ``tp`` and ``ep``
(tensor and expert parallelism: the ranks share each batch whole). :class:`DataLayout` is that reading of a
mesh, with the two reductions every integration needs: a count or a loss summed over the ranks that hold
different data (:meth:`DataLayout.sum_over`), each a lowered ``P(sum) -> R`` (:func:`tplower.redistribute_local`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..core.lower.redistribute import redistribute_local
from ..core.support.argcheck import check_mesh
from ..core.support.errors import TPLowerError
from ..core.support.words import closest

__all__ = ["AXES", "DataLayout"]

#: the mesh axis names a training stack's mesh may have, and what each means for its data
AXES = {"dp": "data parallel (own batches, FSDP2)", "cp": "context parallel (split sequence)",
        "tp": "tensor parallel (same batch)", "ep": "expert parallel (same batch)"}


@dataclass(frozen=True)
class DataLayout:
    """How the ranks of ``mesh`` share the training data.

    Attributes:
        mesh: the whole training mesh (every rank of the job is in it).
        dp: the data-parallel axis (``"dp"``) or ``None``.
        cp: the context-parallel axis or ``None``.
        dp_size, dp_rank: the data-parallel degree and this rank's coordinate on ``dp`` (1 and 0 without it).
    """

    mesh: DeviceMesh
    dp: str | None
    cp: str | None
    dp_size: int
    dp_rank: int

    @classmethod
    def of(cls, mesh: DeviceMesh, context: str | None, where: str) -> DataLayout:
        """The layout of ``mesh`` with ``context`` the context-parallel axis (``None``: none).

        Raises:
            TypeError: ``mesh`` is not a ``DeviceMesh``.
            TPLowerError: an axis name outside :data:`AXES`; a ``context`` other than ``"cp"`` or ``None`` (the
                nearest name suggested), or one the mesh lacks; a ``cp`` axis without ``context="cp"`` (nothing
                would be cut over it: every rank would train on the whole batch); or a mesh that does not span
                every rank of the default process group (a rank outside it would read batches nobody accounts
                for).
        """
        check_mesh(mesh, "mesh", where)
        names = tuple(mesh.mesh_dim_names or ())
        unknown = [n for n in names if n not in AXES]
        if not names or unknown:
            raise TPLowerError(f"{where}: mesh axes {names} must be named among {list(AXES)} ("
                               + "; ".join(f"{k}: {v}" for k, v in AXES.items()) + ")")
        if context is not None and context != "cp":
            raise TPLowerError(f"{where}: context={context!r}{closest(str(context), ('cp',))}; allowed: 'cp' (the "
                               "mesh's context-parallel axis) or None")
        if context is not None and context not in names:
            raise TPLowerError(f"{where}: context={context!r} is not an axis of the mesh {names}; pass "
                               f"context=None or make the mesh with a {context!r} axis")
        if context is None and "cp" in names:
            raise TPLowerError(f"{where}: the mesh {names} has a 'cp' axis but context=None, so nothing would be "
                               "cut over it (each of its ranks would train on the whole batch); pass context='cp'")
        world = dist.get_world_size() if dist.is_initialized() else 1
        if mesh.size() != world:
            raise TPLowerError(f"{where}: the mesh {names} {tuple(mesh.shape)} holds {mesh.size()} ranks, the job "
                               f"{world}; make the mesh over every rank (init_device_mesh(..., ({world},), ...)), "
                               "with a 'dp' axis for the ranks that read different batches")
        dp = "dp" if "dp" in names else None
        size = mesh.size(names.index(dp)) if dp else 1
        return cls(mesh, dp, context, size, mesh.get_local_rank(dp) if dp else 0)

    @property
    def shared(self) -> tuple[str, ...]:
        """The axes whose ranks hold the same data (every axis but ``dp``): ``cp``, ``tp``, ``ep``."""
        return tuple(a for a in (self.mesh.mesh_dim_names or ()) if a != self.dp)

    def same_random_streams(self) -> None:
        """Give every rank the random state (Python's, NumPy's, torch's CPU and current CUDA device's) of the
        rank with coordinate 0 on each of :attr:`shared`, so the ranks of one tp/cp/ep group draw the same
        dropout masks, shuffles and sampled tokens; ``dp`` ranks keep their own. A collective over each shared
        axis (one ``broadcast_object_list``); nothing without shared axes.

        Trainers that seed each process apart (TRL's ``GRPOTrainer``: ``set_seed(seed, device_specific=True)``)
        would otherwise let two tp ranks sample different completions from the same logits and mix them.
        """
        import random

        import numpy as np

        for axis in self.shared:
            state: list[Any] = [random.getstate(), np.random.get_state(), torch.get_rng_state(),
                                torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized()
                                else None]
            dist.broadcast_object_list(state, group=self.mesh.get_group(axis), group_src=0)
            random.setstate(state[0])
            np.random.set_state(state[1])
            torch.set_rng_state(state[2])
            if state[3] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(state[3])

    @property
    def split(self) -> tuple[str, ...]:
        """The axes over which ranks hold different parts of the data: ``dp`` and ``cp``, those present."""
        return tuple(a for a in (self.dp, self.cp) if a is not None)

    def sum_over(self, value: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """``value`` summed over the ranks of ``axes`` (an ``all_reduce`` each; no collective when empty).

        Args:
            value: this rank's tensor (any shape); it is not modified.
            axes: mesh axis names, e.g. :attr:`split` or ``(self.dp,)``.

        Returns:
            A new tensor of ``value``'s shape, the same on every rank of ``axes``; differentiable (``P(sum) -> R``,
            gradient ``R``).
        """
        if not axes:
            return value
        return redistribute_local(value, self.mesh, {a: "P(sum)" for a in axes}, {a: "R" for a in axes},
                                  grad={a: "R" for a in axes})
