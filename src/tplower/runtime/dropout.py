"""Dropout across ranks: one stream for replicated activations, a stream of each rank's own where they are sharded.

Every rank starts from the same seed, as one process would. Dropout on a
replicated activation must draw the same mask on every rank (the replicas
stay equal, as one process's single copy); dropout on a sharded activation
(the heads a rank holds, its piece of an MLP's features, its part of the
sequence) must draw each rank's mask independently of the others'. Drawn
from one common stream, head ``h`` on rank 0 and head ``h + H/2`` on rank 1
get the same mask; and where the ranks' pieces differ in size, each rank
consumes a different count of random numbers, so their later replicated
masks differ and the replicas drift apart.

The convention (Megatron-LM's "model-parallel RNG", without a tracker the
model's code must call): a *sharded region* opens where a boundary's output
stays sharded along its axis (a column-parallel layer's features, a
sequence-parallel norm's sequence) and closes where one ends replicated or
partial (a row-parallel layer's reduced output). On opening, every rank
draws one seed from the common CPU stream (so that stream advances alike on
every rank), keeps the generator's state, and seeds the model's device
generator with that seed and its own coordinate on the axis; on closing, it
puts the kept state back. So replicated dropout draws the same masks on
every rank however the sharded pieces are sized, and sharded dropout draws
independent masks per rank, fresh in each region. Activation checkpointing
recomputes the same masks: its recompute restores the common stream, whose
draw seeds the region again.

Only models that can drop anything get streams (a ``Dropout`` module with
``p > 0``, or a float ``*dropout*``/``*pdrop*`` attribute above 0 on a module
or its config), and only modules in training mode switch. Under
``torch.compile`` no switch is traced (reading and setting a generator's
state is a graph break): the sharded regions then draw from the common
stream, as they did before (the README says so).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["DropoutStreams", "can_drop", "install_dropout_streams"]

#: spreads the ranks' seeds apart (the 64-bit golden ratio, an odd constant)
_SPREAD = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


class DropoutStreams:
    """One model's dropout streams on one rank (see the module docstring).

    Args:
        device_type: the mesh's device type (``cpu``, ``cuda``, ...): whose
            default generator dropout draws from.
        coord: this rank's coordinate on the sharded axis (its stream's salt).
    """

    def __init__(self, device_type: str, coord: int) -> None:
        self.device_type = device_type
        self.salt = ((coord + 1) * _SPREAD) & _MASK
        self._kept: torch.Tensor | None = None

    def _generator(self) -> torch.Generator:
        if self.device_type == "cpu":
            return torch.default_generator
        module: Any = getattr(torch, self.device_type)
        gen: torch.Generator = module.default_generators[module.current_device()]
        return gen

    @property
    def sharded(self) -> bool:
        """Whether a sharded region is open (the device generator holds this rank's stream)."""
        return self._kept is not None

    def open(self) -> None:
        """Enter a sharded region (nothing when one is open): draw its seed from the common stream, switch."""
        if self._kept is not None:
            return
        seed = int(torch.randint(0, 1 << 62, (1,), generator=torch.default_generator))  # the common CPU stream
        gen = self._generator()
        self._kept = gen.get_state()
        gen.manual_seed((seed + self.salt) & _MASK)

    def close(self) -> None:
        """Leave a sharded region (nothing when none is open): the common stream comes back as it was."""
        if self._kept is not None:
            self._generator().set_state(self._kept)
            self._kept = None

    def after_root(self, module: nn.Module, args: Any, out: Any) -> None:
        """Root forward hook (also after an exception): no region outlives a call of the model."""
        self.close()


def can_drop(model: nn.Module) -> bool:
    """Whether anything in ``model`` may drop: a ``Dropout`` module with ``p > 0``, or a float attribute named
    ``*dropout*``/``*pdrop*`` above 0 on a module or its ``config`` (attention kernels take ``dropout_p``)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        for holder in (module, getattr(module, "config", None)):
            attrs = getattr(holder, "__dict__", {}) if holder is not None else {}
            for name, value in attrs.items():
                low = name.lower()
                if ("dropout" in low or "pdrop" in low) and isinstance(value, float) and value > 0:
                    return True
    return False


def install_dropout_streams(model: nn.Module, boundaries: list[Any], device_type: str, coord: int) -> None:
    """Give ``model``'s boundaries one :class:`DropoutStreams` if the model can drop (:func:`can_drop`).

    Each boundary in ``boundaries`` (a :class:`tplower.runtime.boundary._Boundary`
    whose ``region`` says whether its outputs open or close a sharded region)
    gets it as ``streams``; the model gets a forward hook that closes a
    region left open (``always_call``). Nothing is installed for a model
    that cannot drop.
    """
    if not boundaries or not can_drop(model):
        return
    streams = DropoutStreams(device_type, coord)
    for b in boundaries:
        b.streams = streams
    model.register_forward_hook(streams.after_root, always_call=True)
