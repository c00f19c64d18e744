"""One training step of a layout, run on fake tensors over a fake process group: its memory, FLOPs and collectives.

:func:`trace_step` builds the model from its config under ``FakeTensorMode`` (no weight is allocated), makes the
layout's mesh on a fake process group of the layout's world size as rank 0 (collectives return at once), places
the model as :func:`tplower.hf.prepare_trainer` does (:func:`tplower.hf.model.parallelize_for_training`: the plan
on ``tp``, context parallelism on ``cp``, FSDP2 over ``dp``), makes what a first training step leaves behind
(:func:`_first_call`: the forward once, its output dropped; the optimizer's state by a step on zero gradients) and
runs one step of a one-micro-batch loop: the model's forward on the rank's rows with ``labels``,
``loss.backward()``, ``optimizer.step()``, ``optimizer.zero_grad()``, with Python's cyclic garbage collector held
off (:func:`_no_gc`: the peak is then the same every run). The peak is the largest seen throughout. That step is
counted for FLOPs (``torch.utils.flop_counter``'s formulas per operator, as ``FlopCounterMode`` applies them, in the
tracker's own mode: one mode on the stack, not two) and collectives
(:class:`tplower.core.lower.traffic.CollectiveTraffic`, by the mesh axis each runs on).

The real check (:func:`measure_step`, inside a real job) runs two whole steps on real tensors and counts the
second (its peak: the larger of the two); the tests hold the trace to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .memory import LiveTensors, _storage, layer_places

__all__ = ["StepTrace", "fake_world", "measure_step", "run_step", "trace_step"]

#: mesh axes in the order a mesh is made (the last varies fastest: tp's ranks are neighbours)
AXES = ("dp", "cp", "ep", "tp")


@dataclass
class StepTrace:
    """What one training step of one layout costs a rank.

    Attributes:
        peak_bytes: bytes of every tensor storage alive on the rank at the step's peak (parameters, gradients,
            optimizer state, the batch, activations and temporaries).
        split: ``peak_bytes`` by kind (:data:`tplower.planner.memory.KINDS`).
        flops: floating-point operations of the measured step (forward, backward, optimizer), this rank's.
        collectives: ``{axis: {kind: (count, bytes this rank sends)}}`` of the measured step; ``axis`` is a mesh
            axis name, or names joined by ``+`` for a group over several.
        ops: operator calls of the measured step (the dispatcher's count: a measure of per-op overhead).
        totals: bytes of the rank's ``parameters``, its ``gradients`` as backward leaves them and the
            ``optimizer``'s state after its step (the measured step's; each storage once).
        phases: the measured step's peak within each phase (``forward``, ``backward``, ``optimizer``), split as
            ``split``, and within each at each decoder layer's place (``"backward second"``, ...:
            :func:`tplower.planner.memory.layer_places`): where a step's peak lies moves with the layer count, the
            peak at one place grows linearly.
    """

    peak_bytes: int
    split: dict[str, int]
    flops: int
    collectives: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    ops: int = 0
    totals: dict[str, int] = field(default_factory=dict)
    phases: dict[str, dict[str, int]] = field(default_factory=dict)

    def scaled(self, other: StepTrace, layers: float) -> StepTrace:
        """``self + layers * (other - self)``: from traces of ``k`` (``self``) and ``k + 1`` (``other``) decoder
        layers, a trace of ``k + layers``."""
        def lin(a: float, b: float) -> int:
            return round(a + layers * (b - a))
        cols: dict[str, dict[str, tuple[int, int]]] = {}
        for axis in set(self.collectives) | set(other.collectives):
            a, b = self.collectives.get(axis, {}), other.collectives.get(axis, {})
            cols[axis] = {k: (lin(a.get(k, (0, 0))[0], b.get(k, (0, 0))[0]),
                              lin(a.get(k, (0, 0))[1], b.get(k, (0, 0))[1])) for k in set(a) | set(b)}
        totals = {k: lin(self.totals.get(k, 0), other.totals.get(k, 0)) for k in self.totals}
        phases = {p: {k: lin(self.phases[p].get(k, 0), other.phases[p].get(k, 0)) for k in self.phases[p]}
                  for p in self.phases if p in other.phases}
        if phases:  # each phase's peak counted on, then the largest: the step's peak may move to another phase
            split = max(phases.values(), key=lambda s: sum(s.values()))
        else:
            split = {k: lin(self.split.get(k, 0), other.split.get(k, 0)) for k in self.split}
        return StepTrace(sum(split.values()), split, lin(self.flops, other.flops), cols, lin(self.ops, other.ops),
                         totals, phases)


class _Meter(LiveTensors):
    """:class:`LiveTensors` that also counts operator calls and collectives (one mode, not three: each mode on
    the stack costs every operator a Python call) while :attr:`counting`."""

    def __init__(self, kinds: dict[str, Any]) -> None:
        from torch.utils.flop_counter import flop_registry

        from ..core.lower.traffic import CollectiveTraffic

        super().__init__(kinds)
        self.counting = False
        self.calls = self.flops = 0
        self.traffic = CollectiveTraffic()
        self.formulas = flop_registry  # FlopCounterMode's own formulas, by operator (matmuls, convolutions, sdpa)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.counting:
            ns = func.namespace
            self.calls += ns != "prim"  # prim.device and kin: fake tensors route them through modes, real do not
            if ns in ("c10d", "_c10d_functional") or (ns, func._opname) == ("tplower", "split_exchange"):
                self.traffic._count(ns, func._opname, args)
            formula = self.formulas.get(func._overloadpacket)
            if formula is not None:
                self.flops += int(formula(*args, **(kwargs or {}), out_val=out))
        return out


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[None]:
    """Within: the default process group is the ``fake`` backend's, ``world`` ranks, this process rank 0.

    Raises:
        RuntimeError: a default process group exists already (trace in a fresh process: :func:`plan_layout`
            starts one itself then).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world: a default process group exists already in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _axis_names(mesh: Any) -> dict[str, str]:
    """``{group name: axis}`` for each axis of ``mesh`` and each flattened run of its axes."""
    names = tuple(mesh.mesh_dim_names or ())
    out = {mesh.get_group(a).group_name: a for a in names}
    for i in range(len(names)):
        for j in range(i + 2, len(names) + 1):
            joined = "_".join(names[i:j])
            with contextlib.suppress(KeyError, RuntimeError, ValueError):
                out[mesh[joined].get_group().group_name] = "+".join(names[i:j])
    return out


@contextlib.contextmanager
def as_real_tensors() -> Iterator[None]:
    """Within: transformers takes a fake tensor for a real one (``is_tracing`` no longer answers ``True`` for it),
    so a model chooses the paths it takes on real tensors (a causal mask left to the attention kernel, not
    materialized) and the trace's memory is the real step's. The one value such a path reads, whether the rows
    are packed documents, is answered as the planner's batch has it: they are not (whole rows)."""
    try:
        from transformers import masking_utils
        from transformers.utils import import_utils
    except ImportError:
        yield
        return
    saved = import_utils.is_fake_tensor, masking_utils.find_packed_sequence_indices
    import_utils.is_fake_tensor = lambda x: False
    masking_utils.find_packed_sequence_indices = lambda *args, **kwargs: None
    try:
        yield
    finally:
        import_utils.is_fake_tensor, masking_utils.find_packed_sequence_indices = saved


def build_mesh(sizes: Mapping[str, int], device: str = "cpu") -> Any:
    """The mesh of ``sizes`` (axes of size 1 left out, in :data:`AXES` order), or ``None`` for one rank."""
    from torch.distributed.device_mesh import init_device_mesh

    axes = [(a, sizes[a]) for a in AXES if sizes.get(a, 1) > 1]
    if not axes:
        return None
    return init_device_mesh(device, tuple(n for _, n in axes), mesh_dim_names=tuple(a for a, _ in axes))


def place(model: nn.Module, mesh: Any, *, context_mode: str | None, loss_chunk: int | None,
          checkpointing: bool, experts: str | None = None) -> Any:
    """``model`` placed on ``mesh`` as :func:`tplower.hf.prepare_trainer` places it; the
    :class:`~tplower.hf.model.TrainingModel` (``None`` for one rank)."""
    if checkpointing:  # transformers 5.x renamed it (the old name warns)
        hf: Any = model
        if hasattr(hf, "activation_checkpointing_enable"):
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mesh is None:
        return None
    from ..hf.model import parallelize_for_training

    names = tuple(mesh.mesh_dim_names)
    context = "cp" if "cp" in names else None
    options: dict[str, Any] = {}
    if context is not None and loss_chunk:
        options["context_loss_chunk"] = loss_chunk
    plan = "auto" if ("tp" in names or "ep" in names) else None
    return parallelize_for_training(model, mesh, plan, context=context, context_mode=context_mode or "ulysses",
                                    experts=experts, sum_gradients=True, where="plan_layout", **options)


def run_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
             steps: int = 2, fake: Any = None, mesh: Any = None, placed: Any = None,
             cheap_first: bool = False) -> StepTrace:
    """Run ``steps`` training steps of ``model`` on ``batch`` and measure them (see the module docstring).

    Args:
        model: placed already (:func:`place`); its parameters and buffers are counted as held.
        optimizer: built on ``model.parameters()``; its state is counted as held once it exists.
        batch: this rank's whole micro-batch (``input_ids``, ``labels``: ``[rows, seq]`` int64); cut over ``cp``
            by the model's own splitter.
        steps: at least 2 (the last is the one counted for FLOPs and collectives); 1 after ``cheap_first``.
        fake: the ``FakeTensorMode`` the model's tensors belong to, or ``None`` for real tensors.
        mesh: the layout's mesh (names the collectives' axes), or ``None``.
        placed: :func:`place`'s result: under ``cp`` the batch is cut first, on real tensors (the cut reads the
            batch's values), as the model's own splitter would cut it.
        cheap_first: instead of a whole first step, what a first step leaves behind (:func:`_first_call`), then
            one step, measured: about 40% less work than two whole steps (:func:`trace_step` does this; the tests
            check it against two whole real steps).

    Returns:
        The :class:`StepTrace`.
    """
    params = list(model.parameters())
    if placed is not None and placed.split is not None:
        batch = placed.split.cut(batch)

    def states() -> Iterator[Any]:
        for s in optimizer.state.values():
            yield from (v for v in s.values() if isinstance(v, torch.Tensor))

    tracker = _Meter({"parameters": lambda: params, "gradients": lambda: (p.grad for p in params),
                      "optimizer": states, "batch": lambda: batch.values()})
    tracker.hold([*params, *model.buffers(), *(v for v in batch.values() if isinstance(v, torch.Tensor))])
    hooks = layer_places(model, tracker)
    with fake if fake is not None else contextlib.nullcontext(), _no_gc():
        if cheap_first:
            with tracker:
                _first_call(model, batch, params, optimizer, placed)
            tracker.hold(states())
            steps = 1
        for step in range(steps):
            last = tracker.counting = step == steps - 1
            if placed is not None:
                placed.forget()  # the losses recorded for the trainer, as prepare_trainer's loop drops them
            with tracker:
                tracker.phase, tracker.places = "forward" if last else None, ("start",)
                loss = model(**batch).loss
                tracker.phase, tracker.places = "backward" if last else None, ("start",)
                loss.backward()
                del loss
                grads = _bytes(p.grad for p in params)
                tracker.phase, tracker.places = "optimizer" if last else None, ("start",)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            tracker.hold(states())
    for h in hooks:
        h.remove()
    axes = _axis_names(mesh) if mesh is not None else {}
    cols: dict[str, dict[str, tuple[int, int]]] = {}
    for (group, kind), (count, nbytes) in tracker.traffic.by_group.items():
        axis = axes.get(group, "other")
        before = cols.setdefault(axis, {}).get(kind, (0, 0))
        cols[axis][kind] = (before[0] + count, before[1] + nbytes)
    totals = {"parameters": _bytes(params), "gradients": grads, "optimizer": _bytes(states())}
    return StepTrace(tracker.peak, dict(tracker.peak_split), tracker.flops, cols, tracker.calls,
                     totals, {p: dict(v) for p, v in tracker.phases.items()})


def _first_call(model: nn.Module, batch: dict[str, torch.Tensor], params: list[Any],
                optimizer: torch.optim.Optimizer, placed: Any) -> None:
    """What a first training step leaves behind, without its backward: the forward once with gradients enabled
    (what runs at a model's first call: tplower's coverage probe and its ``all_reduce``, FSDP2's lazy setup and
    gathers), its output dropped; FSDP2 as a backward leaves it (resharded, no forward order recorded: its
    backward prefetches by that order); the optimizer's state, made by a step on zero gradients."""
    import gc

    from torch.distributed.fsdp import FSDPModule

    model(**batch)
    if placed is not None:
        placed.forget()  # (the loss it recorded holds the forward's graph)
    # the dropped forward's graph, held in reference cycles: the youngest generation holds every object made since
    # the collector was held off (a full collection costs 0.2 s once the fake tensor cache is large)
    gc.collect(0)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
            state = m._get_fsdp_state()
            state._state_ctx.iter_forward_root = None
            for group in state._fsdp_param_groups:
                group.comm_ctx.post_forward_order.clear()
                group._post_forward_indices.clear()
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Within: no cyclic garbage collection (the youngest generation collected first). Some tensors are freed
    only by the collector (FSDP2's pre-backward hooks leave each hooked output's autograd node in a reference
    cycle, and with it what the node saved), so when a collection happens inside a step moves its peak from run to
    run; without one the peak is the same every run, the most the step can hold (a run whose collector fires
    mid-step peaks lower: by 0-6% in ``tests/test_planner.py``)."""
    import gc

    gc.collect(0)
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the storages of ``tensors`` (each once; DTensors by their local tensor; ``None`` skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = _storage(t)
        if st is not None:
            seen[id(st)] = int(st.nbytes())
    return sum(seen.values())


def _batch(vocab: int, rows: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _optimizer(model: nn.Module, name: str, foreach: bool | None) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-4, foreach=foreach)
    raise ValueError(f"optimizer={name!r}: use 'adamw' or 'sgd'")


def trace_step(config: Any, sizes: Mapping[str, int], *, seq_len: int, micro_batch: int, dtype: torch.dtype,
               checkpointing: bool = False, loss_chunk: int | None = None, context_mode: str | None = None,
               optimizer: str = "adamw", foreach: bool | None = None, experts: str | None = None) -> StepTrace:
    """The :class:`StepTrace` of one layout, on fake tensors (see the module docstring).

    Args:
        config: a transformers ``PretrainedConfig`` of a causal LM (``AutoModelForCausalLM.from_config``).
        sizes: ``{axis: ranks}`` over :data:`AXES` (missing axes are 1); their product is the world traced.
        seq_len: tokens per row; micro_batch: rows per ``dp`` rank per step.
        dtype: the parameters' dtype.
        checkpointing: activation checkpointing per decoder layer (transformers' ``gradient_checkpointing_enable``,
            non-reentrant).
        loss_chunk: under ``cp``: positions per chunk of the loss (``parallelize(context_loss_chunk=)``).
        context_mode: under ``cp``: ``"ulysses"`` or ``"allgather"``.
        optimizer: ``"adamw"`` or ``"sgd"``; foreach: passed to it (``None``: its default for the device).
        experts: a mixture-of-experts model's experts on the ``tp``/``ep`` axis: ``"tp"`` (tensor parallelism
            inside each expert) or ``"ep"`` (whole experts per rank); ``None``: as :func:`tplower.parallelize`
            picks from the axis's name. Under expert parallelism the routing is taken as balanced (every rank
            sends each expert the same number of rows: :func:`tplower.core.ops.dispatch.plan_dispatch`), as a
            fake step has no router values.

    Raises:
        TPLowerError: every refusal of :func:`tplower.parallelize` for this layout (heads that do not divide, ...).
        RuntimeError: a default process group exists in this process.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    world = 1
    for n in sizes.values():
        world *= n
    # FakeTensorMode's cache of operator outputs (by operator and argument metadata; shared by every trace in the
    # process) serves the layers after the first, the second step and the next candidate: 1.6x faster per trace
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_world(world) if world > 1 else contextlib.nullcontext(), as_real_tensors():
        with fake:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.train()
        mesh = build_mesh(sizes)
        placed = place(model, mesh, context_mode=context_mode, loss_chunk=loss_chunk, checkpointing=checkpointing,
                       experts=experts)
        with fake:
            opt = _optimizer(model, optimizer, foreach)
        return run_step(model, opt, _batch(config.vocab_size, micro_batch, seq_len), fake=fake, mesh=mesh,
                        placed=placed, cheap_first=True)


def measure_step(model: nn.Module, mesh: Any, *, seq_len: int, micro_batch: int, checkpointing: bool = False,
                 loss_chunk: int | None = None, context_mode: str | None = None, optimizer: str = "adamw",
                 foreach: bool | None = None, experts: str | None = None) -> StepTrace:
    """The same step on real tensors, in a real job: ``model`` (as loaded, the same on every rank) is placed on
    ``mesh`` (``None``: one process) and run; collective over ``mesh`` (every rank calls it). The check of
    :func:`trace_step`'s prediction."""
    model.train()
    placed = place(model, mesh, context_mode=context_mode, loss_chunk=loss_chunk, checkpointing=checkpointing,
                   experts=experts)
    opt = _optimizer(model, optimizer, foreach)
    vocab = int(getattr(model, "config").vocab_size)  # noqa: B009 - a transformers model's config
    return run_step(model, opt, _batch(vocab, micro_batch, seq_len), mesh=mesh, placed=placed)
