"""Control values that stay real when tplower runs under a ``FakeTensorMode`` (:mod:`tplower.planner` traces a
whole training step there: fake parameters and activations, a fake process group).

tplower reads a few small integer tensors on the host to decide how to move data: a mesh's rank tensor, every
rank's size along an uneven axis, the parameter uses the coverage probe merges. Made and read with
:func:`host_values`, they are real tensors whatever mode is active (on a fake process group a collective returns
its input as it is, so each rank's own values stand for every rank's, which is what an even layout has). The
gradient sums' "used" flags travel in one buffer with the gradients, so under fake tensors they cannot be read:
:func:`used_flags` takes this rank's own flags there (a parameter no rank used gets no gradient, as in the real
step: the memory differs by whole gradients otherwise).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["host_values", "is_fake", "like_tensors", "used_flags"]


@contextlib.contextmanager
def host_values() -> Iterator[None]:
    """Within: tensors made are real even under an active ``FakeTensorMode`` (no mode otherwise: a no-op)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield


def like_tensors(tensors: list[torch.Tensor]) -> contextlib.AbstractContextManager[object]:
    """Within: tensors made are of the kind of ``tensors`` (their ``FakeTensorMode`` where they are fake, e.g. the
    buffers FSDP2 allocates when it gathers fake parameters; a no-op for real ones). DTensors by their local tensor."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    for t in tensors:
        local = t._local_tensor if isinstance(t, DTensor) else t
        if isinstance(local, FakeTensor):
            return local.fake_mode
    return contextlib.nullcontext()


def used_flags(flags: torch.Tensor, own: list[bool]) -> list[bool]:
    """``(flags > 0).tolist()`` for a 1-D tensor of "used" flags summed over ranks; ``own`` (this rank's flags
    before the sum) for a fake tensor (its values do not exist; on a fake process group this rank's flags stand for
    every rank's, as for :func:`host_values`)."""
    from torch._subclasses.fake_tensor import FakeTensor

    used = flags > 0  # (made on fake tensors too: the real step holds it a moment)
    if isinstance(flags, FakeTensor):
        return list(own)
    return used.tolist()


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``FakeTensor`` (shapes only: a check that compares values has nothing to compare)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
