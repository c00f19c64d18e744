"""``plan_layout``: every layout of a model on ``ranks`` ranks, each traced on fake tensors, ranked by predicted
step time.

A candidate is a mesh (``dp`` x ``cp`` x ``tp``, sizes whose product is ``ranks``), activation checkpointing (off /
per decoder layer), where ``cp > 1`` a context mode (``"ulysses"`` / ``"allgather"``) and the loss in chunks (off /
on), and for a mixture-of-experts model with ``tp > 1`` its experts over ``tp`` (``"tp"``: sharded inside each
expert; ``"ep"``: whole experts per rank, the routing taken as balanced). Each is placed as
:func:`tplower.hf.prepare_trainer` places it (FSDP2 over ``dp``) and one training step runs on fake tensors over a
fake process group (:func:`tplower.planner.trace.trace_step`): the per-rank peak of every tensor alive, the FLOPs,
the operator calls and the collectives per mesh axis are those of the real step (measured against real runs in
``tests/test_planner.py``). Nothing is allocated.

The time model (:func:`predict_seconds`): compute at the profile's matmul rate, plus each collective at its axis's
link (latency per ring step plus bytes over bandwidth; an axis is inside a node when it and the axes inside it
span at most ``gpus_per_node`` ranks: ``tp`` is innermost, then ``cp``, then ``dp``), plus the profile's cost
per operator call; no overlap of communication with compute is assumed. A step is ``global_batch / (dp x
micro_batch)`` micro-steps (gradient accumulation), each one traced micro-step.

Models with many identical decoder layers are traced with three and with four layers and the rest counted
(``layers="auto"`` above :data:`WHOLE_TRACE_LAYERS` layers): FLOPs, collectives and operator calls are linear in
the layer count when the layers are alike, and so is each phase's peak (forward, backward, optimizer), whose
largest is the step's, once the first and last layers (FSDP2 prefetches a neighbour) are apart from a middle one:
from three and four layers (``tests/test_planner.py`` checks it against a whole trace of six layers, with FSDP2 and
checkpointing, where the step's peak moves from one phase to another as layers are added; two and three were 10%
off there). Within a phase the peak can move as well, so each phase's peak is kept place by place too (each
decoder layer's place: :func:`tplower.planner.memory.layer_places`), each counted on, the largest taken.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.support.errors import TPLowerError
from .profile import DeviceProfile, load_profile
from .prune import Bound, gib
from .trace import AXES, StepTrace, trace_step
from .worker import run_tasks

__all__ = ["WHOLE_TRACE_LAYERS", "LayoutCandidate", "chunk_cost", "parse_bytes", "plan_layout", "predict_seconds"]

#: models with at most this many decoder layers are traced whole by ``layers="auto"`` (counting traces 3 + 4)
WHOLE_TRACE_LAYERS = 6

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str, arg: str = "memory_per_rank") -> int:
    """Bytes from an int or a string such as ``"80GiB"``, ``"80 GB"``, ``"512MiB"``.

    Raises:
        TPLowerError: not a positive amount with a known unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB).
    """
    if isinstance(value, bool):
        raise TPLowerError(f"{arg}={value!r}: give bytes (an int) or a string such as '80GiB'")
    if isinstance(value, int | float):
        if value <= 0:
            raise TPLowerError(f"{arg}={value!r} must be positive")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise TPLowerError(f"{arg}={value!r}: give bytes (an int) or a positive amount with a unit among "
                           f"{', '.join(u for u in _UNITS if u)} (e.g. '80GiB')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class LayoutCandidate:
    """One layout and what it costs a rank (a row of :func:`plan_layout`'s answer).

    Attributes:
        mesh: ``{axis: ranks}`` of the axes larger than 1, in mesh order (``dp``, ``cp``, ``tp``).
        checkpointing: activation checkpointing per decoder layer.
        context_mode: ``"ulysses"``/``"allgather"`` under ``cp``, else ``None``.
        loss_chunk: positions per chunk of the loss under ``cp`` (``parallelize(context_loss_chunk=)``), or ``None``.
        micro_batch: rows per ``dp`` rank per micro-step; accumulation: micro-steps per step.
        experts: a mixture-of-experts model's experts over ``tp``: ``"tp"`` (tensor parallelism inside each
            expert) or ``"ep"`` (whole experts per rank, tokens exchanged by ``all_to_all``); ``None`` otherwise.
        fits: traced, and ``peak_bytes`` within the memory per rank.
        peak_bytes: bytes of every tensor alive on a rank at the step's peak (parameters, gradients, optimizer
            state, the batch, activations and temporaries); 0 when refused before tracing.
        split: ``peak_bytes`` by kind (``parameters``, ``gradients``, ``optimizer``, ``batch``, ``activations``).
        collectives: ``{axis: {kind: (count, bytes this rank sends)}}`` per step (all micro-steps).
        collective_bytes: bytes a rank sends per step, all axes.
        flops: a rank's floating-point operations per step.
        predicted_step_s: predicted seconds per step (``inf`` when not traced).
        reason: why it does not run or fit ("" when it fits).
    """

    mesh: dict[str, int]
    checkpointing: bool
    context_mode: str | None
    loss_chunk: int | None
    micro_batch: int
    accumulation: int
    experts: str | None = None
    fits: bool = False
    peak_bytes: int = 0
    split: dict[str, int] = field(default_factory=dict)
    collectives: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    collective_bytes: int = 0
    flops: int = 0
    predicted_step_s: float = math.inf
    reason: str = ""

    def label(self) -> str:
        """A short name: ``dp2 x tp4, experts ep, checkpointing, ulysses, loss chunks 1024``."""
        parts = [" x ".join(f"{a}{n}" for a, n in self.mesh.items()) or "one rank"]
        if self.experts:
            parts.append(f"experts {self.experts}")
        if self.checkpointing:
            parts.append("checkpointing")
        if self.context_mode:
            parts.append(self.context_mode)
        if self.loss_chunk:
            parts.append(f"loss chunks {self.loss_chunk}")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping of every attribute (``predicted_step_s`` ``None`` when not traced)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["collectives"] = {a: {k: list(v) for k, v in kinds.items()} for a, kinds in self.collectives.items()}
        out["predicted_step_s"] = None if math.isinf(self.predicted_step_s) else self.predicted_step_s
        return out

    def code(self, device: str = "cuda") -> str:
        """The lines that run this layout with :func:`tplower.hf.prepare_trainer` (``device``: the mesh's type)."""
        names = tuple(self.mesh)
        sizes = tuple(self.mesh.values())
        lines = [f"mesh = init_device_mesh({device!r}, {sizes!r}, mesh_dim_names={names!r})"] if names else \
            ["# one rank: no mesh; train as usual"]
        args = ["trainer", "mesh", '"auto"' if "tp" in names else "None"]
        if self.experts:
            args.append(f"experts={self.experts!r}")
        if "cp" in names:
            args += ['context="cp"', f"context_mode={self.context_mode!r}"]
            if self.loss_chunk:
                args.append(f"context_loss_chunk={self.loss_chunk}")
        if names:
            lines.append(f"tplower.hf.prepare_trainer({', '.join(args)})")
        lines.append(f"# TrainingArguments(per_device_train_batch_size={self.micro_batch}, "
                     f"gradient_accumulation_steps={self.accumulation}, "
                     f"gradient_checkpointing={self.checkpointing})")
        return "\n".join(lines)


def _sizes(ranks: int, axes: Sequence[str]) -> list[dict[str, int]]:
    """Every ``{axis: n}`` over ``axes`` whose product is ``ranks``."""
    if not axes:
        return [{}] if ranks == 1 else []
    out = []
    for n in range(1, ranks + 1):
        if ranks % n == 0:
            out += [{axes[0]: n, **rest} for rest in _sizes(ranks // n, axes[1:])]
    return out


def _axis_links(sizes: dict[str, int], gpus_per_node: int | None) -> dict[str, bool]:
    """``{axis or joined axes: inside one node}`` (``tp`` innermost; see the module docstring)."""
    order = [a for a in AXES if sizes.get(a, 1) > 1]
    inside: dict[str, bool] = {}
    for i in range(len(order)):
        for j in range(i + 1, len(order) + 1):
            span = math.prod(sizes[a] for a in order[i:])
            inside["+".join(order[i:j])] = gpus_per_node is None or span <= gpus_per_node
    return inside


def predict_seconds(trace: StepTrace, sizes: dict[str, int], profile: DeviceProfile, dtype: torch.dtype,
                    gpus_per_node: int | None) -> float:
    """Seconds of one traced micro-step: compute + collectives + operator calls (see the module docstring)."""
    seconds = trace.flops / profile.rate(dtype) + trace.ops * profile.op_seconds
    inside = _axis_links(sizes, gpus_per_node)
    world = math.prod(sizes.values()) if sizes else 1
    for axis, kinds in trace.collectives.items():
        n = math.prod(sizes[a] for a in axis.split("+")) if axis in inside else world
        link = profile.intra if inside.get(axis, gpus_per_node is None or world <= gpus_per_node) else profile.inter
        for kind, (count, nbytes) in kinds.items():
            steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
            seconds += count * steps * link.latency_s + nbytes / link.bandwidth
    return seconds


def chunk_cost(config: Any, row: LayoutCandidate, seq_len: int) -> float:
    """The most bytes the loss in chunks (:class:`tplower.context.loss.TiledLoss`) can add to ``row``'s per-rank
    peak over the same layout without chunks (``inf`` for a config without an int ``hidden_size``).

    At each point of the chunked step the step without chunks holds as much, but for two things: the gradient of
    the final hidden states ``[B, s, H]`` (``s = seq_len / cp`` a rank's piece, ``B`` the micro-batch) arrives in
    pieces (each chunk's is a whole ``[B, s, H]`` tensor that autograd sums: at most two alive beside the one the
    head's backward makes), and each chunk's labels are copied (``int64 [B, s]`` over the chunks; shifted labels
    too). A chunk's logits and their loss's temporaries are at most the whole row's, which the step without chunks
    holds at its loss. The bound is twice that: four float32 ``[B, s, H]`` and four ``int64 [B, s]``
    (``tests/test_planner.py`` measures the difference on a small vocabulary, where chunks cost memory).
    """
    hidden = getattr(config, "hidden_size", None)
    if isinstance(hidden, bool) or not isinstance(hidden, int):
        return math.inf
    rows, piece = row.micro_batch, -(-seq_len // row.mesh.get("cp", 1))
    return 4 * rows * piece * hidden * 4 + 4 * rows * piece * 8


def _layers(config: Any, n: int) -> Any:
    """A copy of ``config`` with its first ``n`` decoder layers (``layer_types``, where a config lists each layer's
    kind, cut to match)."""
    small = copy.deepcopy(config)
    small.num_hidden_layers = n
    kinds = getattr(small, "layer_types", None)
    if isinstance(kinds, list) and len(kinds) > n:
        small.layer_types = kinds[:n]
    return small


def _trace(config: Any, sizes: dict[str, int], layers: str | int, **kw: Any) -> StepTrace:
    total = int(getattr(config, "num_hidden_layers", 1) or 1)
    whole = layers == "whole" or total <= 4 or (layers == "auto" and total <= WHOLE_TRACE_LAYERS)
    if whole:
        return trace_step(config, sizes, **kw)
    three, four = trace_step(_layers(config, 3), sizes, **kw), trace_step(_layers(config, 4), sizes, **kw)
    return three.scaled(four, total - 3)


def _task(config: Any, sizes: dict[str, int], layers: str | int, kw: dict[str, Any]) -> StepTrace | str:
    """One candidate's trace, or why it could not be traced (a refusal of :func:`tplower.parallelize`, short)."""
    try:
        return _trace(config, sizes, layers, **kw)
    except TPLowerError as exc:
        return str(exc).split("; ")[0]
    except Exception as exc:
        return f"could not be traced: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def _experts(config: Any) -> int:
    """Routed experts per layer of a mixture-of-experts config (the names transformers' configs use), else 0."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        n = getattr(config, name, None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return 0


def _config_of(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    if not hasattr(config, "num_hidden_layers") or not hasattr(config, "vocab_size"):
        raise TPLowerError(f"plan_layout: model_or_config={type(model_or_config).__name__}: give a transformers "
                           "causal-LM config (or a model with .config)")
    return config


def plan_layout(model_or_config: Any, ranks: int, *, memory_per_rank: int | str | None = None, seq_len: int,
                global_batch: int, micro_batch: int | None = None, dtype: torch.dtype | str = torch.bfloat16,
                optimizer: str = "adamw", device: str | DeviceProfile = "h100", gpus_per_node: int | None = None,
                axes: Sequence[str] = ("dp", "cp", "tp"), checkpointing: Sequence[bool] = (False, True),
                context_modes: Sequence[str] = ("ulysses", "allgather"), loss_chunk: int | None = 1024,
                layers: str | int = "auto", workers: int | None = None, prune: bool | None = None,
                progress: Callable[[int, int, str], None] | None = None) -> list[LayoutCandidate]:
    """Every layout of ``model_or_config`` on ``ranks`` ranks, traced, ranked (see the module docstring).

    Args:
        model_or_config: a transformers causal-LM config (``AutoConfig``), or a model (its ``.config`` is used;
            the model itself is not touched).
        ranks: the job's world size (at least 1).
        memory_per_rank: bytes per rank (int, or ``"80GiB"``); default: the profile's memory.
        seq_len: tokens per row; global_batch: rows per optimizer step over every ``dp`` rank.
        micro_batch: rows per ``dp`` rank per micro-step (default 1).
        dtype: the parameters' dtype (``torch.bfloat16`` or its name).
        optimizer: ``"adamw"`` or ``"sgd"``.
        device: a preset name (``"h100"``, ``"h200"``, ``"a100"``), a profile file (``tplower bench
            --calibrate``), or a :class:`~tplower.planner.profile.DeviceProfile`.
        gpus_per_node: ranks per node (``None``: one node).
        axes: the mesh axes to search, among ``"dp"``, ``"cp"``, ``"tp"``.
        checkpointing, context_modes: the variants to search (a mixture-of-experts config, one with
            ``num_experts``/``num_local_experts``/``n_routed_experts``, is searched with ``experts="tp"`` and
            ``"ep"`` on each ``tp`` size too).
        loss_chunk: positions per loss chunk for the chunked variant under ``cp`` (``None``: no chunked variant;
            none either where a rank's piece of the row, ``seq_len / cp``, is not longer).
        layers: ``"auto"``, ``"whole"`` (trace every layer) or ``"extrapolate"`` (three and four layers, then count).
        workers: processes tracing at once (``None``: 1 for up to 32 candidates, else up to 4, as the CPUs
            allow); with a process group in this process the traces always run in spawned processes.
        prune: per mesh, context mode and experts choice, trace the leanest variant (checkpointing, loss chunks)
            first, then only what could be the pick (:class:`~tplower.planner.prune.Bound`); the rest are listed,
            not traced, with the reason (``None``: for models traced by counting layers, whose traces are the long
            ones; ``False``: trace every candidate).
        progress: called ``progress(done, total, label)`` after each candidate.

    Returns:
        The candidates: those that fit, fastest first; then those that do not fit, smallest peak first; then
        those refused, each with its ``reason``.

    Raises:
        TPLowerError: an argument out of range (named, with the allowed values); no memory figure.

    With a process group in this process (inside a job) the traces run in worker interpreters, which make their
    own fake one.
    """
    config = _config_of(model_or_config)
    for name, value in (("ranks", ranks), ("seq_len", seq_len), ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TPLowerError(f"plan_layout: {name}={value!r} must be an int >= 1")
    micro = 1 if micro_batch is None else micro_batch
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        raise TPLowerError(f"plan_layout: micro_batch={micro_batch!r} must be an int >= 1 or None")
    bad = [a for a in axes if a not in ("dp", "cp", "tp")]
    if bad or not axes:
        raise TPLowerError(f"plan_layout: axes={tuple(axes)!r}: choose among 'dp', 'cp', 'tp'")
    if any(m not in ("ulysses", "allgather") for m in context_modes) or not context_modes:
        raise TPLowerError(f"plan_layout: context_modes={tuple(context_modes)!r}: choose among 'ulysses', "
                           "'allgather'")
    if layers not in ("auto", "whole", "extrapolate"):
        raise TPLowerError(f"plan_layout: layers={layers!r}: use 'auto', 'whole' or 'extrapolate'")
    if isinstance(dtype, str) and not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise TPLowerError(f"plan_layout: dtype={dtype!r} is not a torch dtype name ('bfloat16', 'float32')")
    dt: torch.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    profile = load_profile(device)
    memory = parse_bytes(memory_per_rank) if memory_per_rank is not None else profile.memory
    if memory is None:
        raise TPLowerError("plan_layout: memory_per_rank=None and the profile names no memory per rank; give "
                           "memory_per_rank (e.g. '80GiB')")
    foreach = True if profile.device == "cuda" else None
    order = [a for a in AXES if a in axes]
    moe = _experts(config) > 1
    rows: list[LayoutCandidate] = []
    for sizes in _sizes(ranks, order):
        cp = sizes.get("cp", 1)
        modes: Sequence[str | None] = tuple(context_modes) if cp > 1 else (None,)
        # a chunk as long as a rank's piece of the row is one chunk: no variant
        chunks: Sequence[int | None] = (None, loss_chunk) if cp > 1 and loss_chunk and \
            loss_chunk < seq_len // cp else (None,)
        kinds: Sequence[str | None] = ("tp", "ep") if moe and sizes.get("tp", 1) > 1 else (None,)
        for kind, ck, mode, chunk in itertools.product(kinds, checkpointing, modes, chunks):
            dp = sizes.get("dp", 1)
            rows.append(LayoutCandidate({a: n for a, n in sizes.items() if n > 1}, bool(ck), mode, chunk, micro,
                                        max(global_batch // (dp * micro), 1), kind))
    todo: list[tuple[LayoutCandidate, dict[str, int]]] = []
    for row in rows:
        sizes = {a: row.mesh.get(a, 1) for a in order}
        dp = sizes.get("dp", 1)
        if global_batch % (dp * micro):
            row.reason = f"global batch {global_batch} is not a multiple of dp {dp} x micro-batch {micro}"
        if not row.reason:
            todo.append((row, sizes))
    done = len(rows) - len(todo)
    if progress is not None and done:
        progress(done, len(rows), "refused before tracing")
    tasks = [(config, sizes, layers, dict(seq_len=seq_len, micro_batch=micro, dtype=dt,
                                           checkpointing=row.checkpointing, loss_chunk=row.loss_chunk,
                                           context_mode=row.context_mode, optimizer=optimizer, foreach=foreach,
                                           experts=row.experts))
             for row, sizes in todo]
    if workers is None:
        workers = 1 if len(tasks) <= 32 else min(os.cpu_count() or 1, 4)
    if workers < 1:
        raise TPLowerError(f"plan_layout: workers={workers!r} must be >= 1 or None")
    counted = layers == "extrapolate" or (layers == "auto" and int(config.num_hidden_layers) > WHOLE_TRACE_LAYERS)
    bound = Bound([row for row, _ in todo], memory, counted if prune is None else bool(prune),
                  lambda row: chunk_cost(config, row, seq_len))

    def follow(index: int, outcome: StepTrace | str) -> list[int]:
        nonlocal done
        row, sizes = todo[index]
        done += 1
        if isinstance(outcome, str):
            row.reason = outcome
        else:
            acc = row.accumulation
            row.peak_bytes, row.split, row.flops = outcome.peak_bytes, outcome.split, outcome.flops * acc
            row.collectives = {a: {k: (c * acc, b * acc) for k, (c, b) in kinds.items()}
                               for a, kinds in outcome.collectives.items()}
            row.collective_bytes = sum(b for kinds in row.collectives.values() for _, b in kinds.values())
            row.predicted_step_s = acc * predict_seconds(outcome, sizes, profile, dt, gpus_per_node)
            row.fits = row.peak_bytes <= memory
            if not row.fits:
                row.reason = f"{gib(row.peak_bytes)} > {gib(memory)}"
        if progress is not None:
            progress(done, len(rows), row.label())
        more, skipped = bound.after(index)
        for j in skipped:
            done += 1
            if progress is not None:
                progress(done, len(rows), todo[j][0].label())
        return more

    for _ in run_tasks(_task, tasks, bound.start, workers, follow):
        pass
    return sorted(rows, key=lambda r: (0 if r.fits else 1 if r.peak_bytes else 2,
                                       r.predicted_step_s if r.fits else r.peak_bytes))
