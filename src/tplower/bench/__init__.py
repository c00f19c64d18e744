"""``tplower bench``: timings and memory of tplower against the raw collective, DTensor and hand-written code.

:mod:`~tplower.bench.phases` runs the phases, :mod:`~tplower.bench.cases` holds the transitions and the
implementations timed (their names, without torch, in :mod:`~tplower.bench.catalog`),
:mod:`~tplower.bench.model` the real-model phase (:mod:`~tplower.bench.floor` its communication floor,
:mod:`~tplower.bench.megatron` the hand-written copies), :mod:`~tplower.bench.report` the tables and plots. The
names below are those of :mod:`~tplower.bench.phases`, imported on first use (:mod:`tplower._lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .phases import PHASES, BenchConfig, fake_rank, micro_rank, peak_bytes, plan_cache_rows, run_bench, summarize

__all__ = ["PHASES", "BenchConfig", "fake_rank", "micro_rank", "peak_bytes", "plan_cache_rows", "run_bench",
           "summarize"]

__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(__all__, ".phases"), globals())
