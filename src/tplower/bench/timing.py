"""Interleaved step timing across ranks, for the bench's model-level phases (``moe``, ``loss``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

__all__ = ["barrier_rounds"]


def barrier_rounds(keys: Sequence[str], step: Callable[[str], object], rounds: int,
                   warmup: int = 1) -> dict[str, list[float]]:
    """Run ``step(key)`` for every key in rounds ``A B C A B C ...``; per key the samples in milliseconds.

    A barrier before and after each call: a sample is the slower rank's time
    for that call. Every rank passes the same keys in the same order; the
    first ``warmup`` rounds are not kept.
    """
    samples: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(warmup + rounds):
        for key in keys:
            dist.barrier()
            t0 = time.perf_counter()
            step(key)
            dist.barrier()
            if r >= warmup:
                samples[key].append((time.perf_counter() - t0) * 1e3)
    return samples
