"""Control values that stay real when tplower runs under a ``FakeTensorMode`` (:mod:`tplower.planner` traces a
whole training step there: fake parameters and activations, a fake process group).

tplower reads a few small integer tensors on the host to decide how to move data: a mesh's rank tensor, every
rank's size along an uneven axis, the parameter uses the coverage probe merges. Made and read with
:func:`host_values`, they are real tensors whatever mode is active (on a fake process group a collective returns
its input as it is, so each rank's own values stand for every rank's, which is what an even layout has). The
gradient sums' "used" flags travel in one buffer with the gradients, so under fake tensors they cannot be read:
:func:`used_flags` counts every parameter as used there (the memory and the collectives are the same either way).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["host_values", "is_fake", "used_flags"]


@contextlib.contextmanager
def host_values() -> Iterator[None]:
    """Within: tensors made are real even under an active ``FakeTensorMode`` (no mode otherwise: a no-op)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield


def used_flags(flags: torch.Tensor) -> list[bool]:
    """``(flags > 0).tolist()`` for a 1-D tensor of summed "used" flags; every entry ``True`` for a fake tensor
    (its values do not exist)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(flags, FakeTensor):
        return [True] * flags.numel()
    return (flags > 0).tolist()


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``FakeTensor`` (shapes only: a check that compares values has nothing to compare)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
