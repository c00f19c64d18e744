"""The bench's ``context`` phase: long sequences' train steps under context parallelism, measured per rank.

Each cp size of the sweep (:class:`ContextSweep`) is one spawn of ``cp`` gloo
ranks building a tiny Llama (hidden 64, 4 query heads, 2 key/value heads of
16, vocabulary 128, ``sdpa``, float32, at least 4 layers;
:func:`~tplower.bench.context_budget.context_model`). Per sequence length and
kind of batch (:func:`~tplower.bench.context_budget.context_batch`:
``plain``, ``padded`` with its last eighth padding, ``packed`` with 4
documents; one row of ``seq`` tokens):

* ``one process``: the whole batch on rank 0 (the others wait); padded and
  packed only up to :data:`ONE_PROCESS_MASKED` tokens (one process builds a
  whole ``[S, S]`` mask for them and CPU ``sdpa`` holds every score: 1.2 GiB at
  8k, 20 GiB at 32k);
* ``ulysses`` and ``allgather`` (and ``hybrid`` from cp=4 on: 2 x 2 at
  cp=4, by the model's 4 query and 2 key/value heads): ``parallelize(model,
  mesh, None, context="cp", context_mode=...)`` on ``tplower.shard_sequence``'s
  part;
* ``tp`` (cp=2's spawn, plain batches): ``parallelize(model, mesh, "auto")``
  at tp=2 on the whole sequence.

A train step is forward, backward and an SGD step. Per row: the step's median
time over interleaved rounds (the slower rank's, behind barriers;
:func:`tplower.bench.timing.barrier_rounds`) and the ratio to one process's
step on the same batch and on the plain batch, round by round; each rank's
peak tensor memory over a step (:func:`tplower.bench.memory.peak_tensor_bytes`);
the collectives and bytes a rank sends (:class:`tplower.core.lower.traffic.CollectiveTraffic`)
and, for plain batches, the bytes ``tplower explain --context`` predicts.
Then the longest plain sequence whose train step peaks within
``sweep.budget`` bytes per rank (:mod:`tplower.bench.context_budget`),
the loss rows: a vocabulary of 32000, the whole logits against the loss in
chunks (``context_loss_chunk``), and the sliding-window rows: a window of
``sweep.window`` keys at fixed size over growing sequences
(:mod:`tplower.bench.context_window`).

With ``sweep.compile_backend`` (``tplower bench --compile``), also ``ulysses
compiled`` and ``allgather compiled`` (``sweep.compile_modes``):
``torch.compile(parallelize(model, mesh, None, context="cp",
context_mode=...), backend=...)`` (inductor's ``bucket_all_reduces_fx = "all"``:
the gradient sums over cp in one ``all_reduce``, as docs/context.md tells users
to compile) on every batch, in the same interleaved
rounds. Each compiled ``variant|batch`` runs once before the rounds, untimed
(the first batch kind's call compiles; the row keeps its seconds, the graphs
it compiled and its graph breaks), then once more (the graphs that call
compiled), and the row counts the variant's graphs compiled in the rounds, and its row (``table: compiled``) sets the
step beside the eager row of the same mode and batch: their times' ratio
round by round, the first step's loss of each (both start from the same
weights and have seen the same batches by then), and both steps' peak from
the profiler's memory events (:func:`tplower.bench.memory.profiler_peak_bytes`:
the live-tensor count does not see the buffers inductor's code allocates).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..testing import run_processes
from .context_budget import BATCHES, budget_rows, context_batch, context_model, loss_rows
from .context_window import window_rows
from .memory import peak_tensor_bytes, profiler_peak_bytes
from .timing import barrier_rounds

__all__ = ["CONTEXT_LAYERS", "CONTEXT_SEQ", "ONE_PROCESS_MASKED", "ContextSweep", "context_phase", "context_rank"]

#: the default sequence and depth of the phase
CONTEXT_SEQ, CONTEXT_LAYERS = 8192, 4
#: the longest padded or packed sequence one process runs (its [S, S] mask and math-path scores beyond)
ONE_PROCESS_MASKED = 8192
_HIDDEN, _HEADS, _KV, _HEAD_DIM = 64, 4, 2, 16
#: the context modes a spawn may run (hybrid from cp=4 on)
_MODES = ("ulysses", "allgather", "hybrid")


@dataclass(frozen=True)
class ContextSweep:
    """What the context phase measures.

    Attributes:
        seqs: sequence lengths (tokens of the one row).
        cps: cp sizes (one spawn of that many gloo ranks each).
        batches: kinds of batch (:data:`BATCHES`).
        budget: bytes per rank for the longest-sequence search (0: none); searched at cp=1 (one process) and
            every size of ``cps``.
        loss_vocab, loss_seq, loss_chunk: the loss rows (in the spawn of the first cp size): a vocabulary of
            ``loss_vocab``, ``loss_seq`` tokens, chunks of ``loss_chunk`` positions (0: no loss rows).
        window, window_seqs, window_modes: the sliding-window rows (in the spawn of the first cp size,
            :mod:`tplower.bench.context_window`): a window of ``window`` keys over each of ``window_seqs``
            (0: no window rows), in each context mode of ``window_modes``.
        compile_backend, compile_modes: the compiled rows (module docstring): ``torch.compile`` with this backend
            (``None``: no compiled rows) of each mode of ``compile_modes`` that a spawn runs.
    """

    seqs: tuple[int, ...] = (CONTEXT_SEQ,)
    cps: tuple[int, ...] = (2,)
    batches: tuple[str, ...] = BATCHES
    budget: int = 64 << 20
    loss_vocab: int = 32000
    loss_seq: int = CONTEXT_SEQ
    loss_chunk: int = 512
    window: int = 1024
    window_seqs: tuple[int, ...] = (8192, 16384, 32768)
    window_modes: tuple[str, ...] = ("ulysses", "allgather")
    compile_backend: str | None = None
    compile_modes: tuple[str, ...] = ("ulysses", "allgather")

    def check(self) -> None:
        """Raises ValueError for sizes below what the phase runs: a sequence below 16 tokens, a cp size below 2,
        an unknown batch kind, a negative budget or chunk, no or an unknown compiled mode."""
        if not self.seqs or min(self.seqs) < 16:
            raise ValueError(f"context phase: seqs={self.seqs}; each at least 16 tokens")
        if not self.cps or min(self.cps) < 2:
            raise ValueError(f"context phase: cps={self.cps}; each at least 2 ranks")
        if not self.batches or set(self.batches) - set(BATCHES):
            raise ValueError(f"context phase: batches={self.batches}; allowed: {', '.join(BATCHES)}")
        if self.budget < 0 or self.loss_chunk < 0 or self.window < 0:
            raise ValueError(f"context phase: budget={self.budget}, loss_chunk={self.loss_chunk} and "
                             f"window={self.window} are >= 0")
        if self.window and (not self.window_seqs or min(self.window_seqs) < 16):
            raise ValueError(f"context phase: window_seqs={self.window_seqs}; each at least 16 tokens")
        if self.compile_backend is not None and (not self.compile_modes or set(self.compile_modes) - set(_MODES)):
            raise ValueError(f"context phase: compile_modes={self.compile_modes}; allowed: {', '.join(_MODES)}")


class _Variants:
    """The models and batches of one sequence length on this spawn, and a train step of each ``variant|batch``."""

    def __init__(self, rank: int, world: int, seq: int, layers: int, sweep: ContextSweep) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from ..context import SPLIT_KEY, shard_sequence
        from ..nn.parallelize import parallelize

        self.rank, self.world, self.seq, self.split_key = rank, world, seq, SPLIT_KEY
        self.backend = sweep.compile_backend
        self.cp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        ref = context_model(layers)
        batches = sweep.batches
        self.modes = _MODES if world >= 4 else _MODES[:2]
        self.models: dict[str, torch.nn.Module] = {"one process": ref, **{
            m: parallelize(copy.deepcopy(ref), self.cp_mesh, None, context="cp", context_mode=m) for m in self.modes}}
        self.mode = {m: m for m in self.modes}  # cp variant -> its context mode
        self.compiled: dict[str, Any] = {}  # compiled variant -> the backend that counts its graphs
        if sweep.compile_backend is not None:
            from torch._dynamo.testing import CompileCounterWithBackend

            torch._dynamo.reset()  # each length compiles afresh: its first call is the compile its rows report
            # the context axis' gradient sums are one all_reduce each in the compiled backward (eager runs them as
            # one pass at its end); inductor's bucketing joins them, as docs/context.md tells users to (this
            # process is a spawned rank: the setting ends with it)
            import torch._inductor.config as inductor

            inductor.bucket_all_reduces_fx = "all"
            for m in (m for m in self.modes if m in sweep.compile_modes):
                self.compiled[f"{m} compiled"] = counter = CompileCounterWithBackend(sweep.compile_backend)
                compiled: Any = torch.compile(parallelize(copy.deepcopy(ref), self.cp_mesh, None, context="cp",
                                                          context_mode=m), backend=counter)
                self.models[f"{m} compiled"], self.mode[f"{m} compiled"] = compiled, m
        if world == 2:
            self.models["tp"] = parallelize(copy.deepcopy(ref), init_device_mesh("cpu", (2,), mesh_dim_names=(
                "tp",)), "auto")
        self.opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in self.models.items()}
        self.whole = {k: {**context_batch(k, seq), "use_cache": False} for k in batches}
        self.parts = {k: shard_sequence(context_batch(k, seq), self.cp_mesh, "cp") for k in batches}
        self.keys = [f"one process|{k}" for k in batches if k == "plain" or seq <= ONE_PROCESS_MASKED]
        self.keys += [f"{m}|{k}" for m in self.modes for k in batches]
        self.keys += ["tp|plain"] if world == 2 and "plain" in batches else []
        self.keys += [f"{c}|{k}" for c in self.compiled for k in batches]
        self.first_loss: dict[str, float] = {}  # variant|batch -> the loss of its first step

    def step(self, key: str) -> None:
        """One train step of ``variant|batch`` (one process: rank 0 alone); keeps the loss of its first."""
        variant, kind = key.split("|")
        if variant == "one process" and self.rank != 0:
            return
        batch: dict[str, Any] = self.whole[kind]
        if variant in self.mode:  # a new batch's runs and masks are made afresh, as in training
            part = self.parts[kind]
            batch = {**part, self.split_key: dataclasses.replace(part[self.split_key], cache={})}
        self.opts[variant].zero_grad(set_to_none=True)
        loss = self.models[variant](**batch).loss
        loss.backward()
        self.opts[variant].step()
        self.first_loss.setdefault(key, float(loss.detach()))

    def first_calls(self) -> dict[str, dict[str, Any]]:
        """Each compiled ``variant|batch``'s first two steps, behind barriers, before any timed one: the first's
        seconds (the compile, on the first batch kind), the graphs it compiled and its graph breaks; the graphs
        the second compiled (``recompiles``: the modes share the model's code, so one mode's graphs can send the
        other's guards back to dynamo)."""
        from torch._dynamo.utils import counters

        out: dict[str, dict[str, Any]] = {}
        keys = [k for k in self.keys if k.split("|")[0] in self.compiled]
        for second, key in [(False, k) for k in keys] + [(True, k) for k in keys]:
            counter = self.compiled[key.split("|")[0]]
            graphs, breaks = counter.frame_count, sum(counters["graph_break"].values())
            dist.barrier()
            t0 = time.perf_counter()
            self.step(key)
            dist.barrier()
            if second:
                out[key]["recompiles"] = counter.frame_count - graphs
            else:
                out[key] = {"compile_s": time.perf_counter() - t0, "graphs": counter.frame_count - graphs,
                            "breaks": sum(counters["graph_break"].values()) - breaks}
        return out


def _ratios(mine: list[float], theirs: list[float] | None) -> dict[str, float] | None:
    """Round-by-round ratios: their median, lowest and highest (interleaved rounds share the machine's load)."""
    if not theirs:
        return None
    r = [a / b for a, b in zip(mine, theirs, strict=True)]
    return {"median": statistics.median(r), "low": min(r), "high": max(r)}


def _measure(v: _Variants) -> tuple[dict[str, tuple[int, dict[str, int], int]], dict[str, int]]:
    """One more step of each variant, measured: the eager ones' live-tensor peak, collectives and bytes sent; the
    compiled ones' and their eager peers' profiler peak (a dispatch mode would change what dynamo traces)."""
    from ..core.lower.traffic import CollectiveTraffic

    measured: dict[str, tuple[int, dict[str, int], int]] = {}
    for key in (k for k in v.keys if k.split("|")[0] not in v.compiled):
        dist.barrier()
        with CollectiveTraffic() as t:
            peak = peak_tensor_bytes(lambda k=key: v.step(k))[0]  # type: ignore[misc]
        measured[key] = (peak, dict(t.counts), t.sent)
    profiled: dict[str, int] = {}
    for key in (k for k in v.keys if k.split("|")[0] in v.compiled):
        variant, kind = key.split("|")
        for k in (f"{v.mode[variant]}|{kind}", key):
            dist.barrier()
            profiled[k] = profiler_peak_bytes(lambda k=k: v.step(k))[0]  # type: ignore[misc]
    return measured, profiled


def _compiled_row(v: _Variants, key: str, samples: dict[str, list[float]], first: dict[str, Any],
                  peaks: dict[str, int]) -> dict[str, Any]:
    """A compiled variant's row beside the eager row of its mode and batch (module docstring)."""
    variant, kind = key.split("|")
    eager = f"{v.mode[variant]}|{kind}"
    times = samples[key]
    return {"table": "compiled", "seq": v.seq, "cp": v.world, "variant": v.mode[variant], "batch": kind,
            "backend": v.backend, "train_step_ms": statistics.median(times), "step_samples_ms": times,
            "eager_step_ms": statistics.median(samples[eager]), "vs_eager": _ratios(times, samples[eager]),
            "profiler_peak_bytes": peaks[key], "eager_profiler_peak_bytes": peaks[eager],
            "loss": v.first_loss[key], "eager_loss": v.first_loss[eager], **first}


def _step_rows(rank: int, world: int, seq: int, layers: int, rounds: int, sweep: ContextSweep) -> list[dict[str, Any]]:
    from ..context.explain import explain_context

    v = _Variants(rank, world, seq, layers, sweep)
    first = v.first_calls()
    graphs = {c: counter.frame_count for c, counter in v.compiled.items()}
    samples = barrier_rounds(v.keys, v.step, rounds)
    for key in first:  # graphs compiled in the rounds (one there would be timed unless in the warm-up round)
        first[key]["graphs_in_rounds"] = v.compiled[key.split("|")[0]].frame_count - graphs[key.split("|")[0]]
    measured, profiled = _measure(v)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, (measured, profiled))
    if rank != 0:
        return []
    params = sum(p.numel() for p in v.models["one process"].parameters())
    predicted = explain_context(1, seq, _HIDDEN, _HEADS, _KV, world, layers=layers, head_dim=_HEAD_DIM, params=params,
                                tensors=len(list(v.models["one process"].parameters())))
    rows = []
    for key, times in samples.items():
        variant, kind = key.split("|")
        if variant in v.compiled:
            rows.append(_compiled_row(v, key, samples, first[key], {k: max(m[1][k] for m in every) for k in profiled}))
            continue
        rows.append({"table": "steps", "seq": seq, "cp": world if variant in v.modes else 1,
                     "tp": world if variant == "tp" else 1,
                     "variant": variant, "batch": kind, "layers": layers, "train_step_ms": statistics.median(times),
                     "step_samples_ms": times, "peak_bytes": max(m[0][key][0] for m in every),
                     "counts": measured[key][1], "sent_bytes": measured[key][2],
                     "vs_same": _ratios(times, samples.get(f"one process|{kind}")),
                     "vs_plain": _ratios(times, samples.get("one process|plain")),
                     "predicted_bytes": predicted[variant]["step_bytes_per_rank"]
                     if variant in predicted and kind == "plain" else None})
    return rows


def context_rank(rank: int, world: int, sweep: ContextSweep, layers: int, rounds: int,
                 loss: bool) -> list[dict[str, Any]]:
    """Every measurement of this spawn (module docstring); rank 0 returns the rows, the others ``[]``."""
    rows = []
    for seq in sweep.seqs:
        rows += _step_rows(rank, world, seq, layers, rounds, sweep)
    if sweep.budget:
        rows += budget_rows(rank, world, sweep.budget, layers, one_process=world == min(sweep.cps))
    if loss and sweep.loss_chunk:
        rows += loss_rows(rank, world, sweep.loss_seq, sweep.loss_vocab, sweep.loss_chunk, layers, rounds)
    if loss and sweep.window:
        rows += window_rows(rank, world, sweep.window_seqs, sweep.window, layers, rounds, sweep.window_modes)
    return rows if rank == 0 else []


def context_phase(rounds: int, *, sweep: ContextSweep | None = None, layers: int = CONTEXT_LAYERS,
                  timeout: float = 900.0, progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """The context phase's rows: :func:`context_rank` on a spawn of ``cp`` gloo ranks per size of the sweep.

    Raises:
        ValueError: ``layers`` below 4, or a sweep :meth:`ContextSweep.check` refuses.
        tplower.testing.RankFailure: a rank failed (transformers missing included).
    """
    sweep = sweep or ContextSweep()
    sweep.check()
    if layers < 4:
        raise ValueError(f"context phase: layers={layers} (at least 4)")
    rows: list[dict[str, Any]] = []
    for i, cp in enumerate(sweep.cps):
        progress(f"context: tiny Llama ({layers} layers), cp={cp}, {', '.join(map(str, sweep.seqs))} tokens, "
                 f"{'/'.join(sweep.batches)} batches, both modes and one process"
                 + (f", compiled ({sweep.compile_backend}): {'/'.join(sweep.compile_modes)}"
                    if sweep.compile_backend is not None else ""))
        rows += run_processes(cp, context_rank, sweep, layers, rounds, i == 0, timeout=timeout)[0]
    return rows
