"""A model parallelized for a training stack: :func:`tplower.parallelize` on the training mesh, FSDP2 over ``dp``,
whole batches cut over ``cp`` at the model's door, and a record of which losses are already whole.

Shared by :func:`tplower.hf.prepare_trainer` and :func:`tplower.hf.prepare_accelerator`.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..core.support.errors import TPLowerError
from ..nn.parallelize import parallelize
from ..runtime.grad_sums import sum_context_in_fsdp
from ..state.full_state import placed_by_tplower, register_full_load
from .batches import SequenceSplit
from .layout import DataLayout

__all__ = ["ORDER", "TrainingModel", "bucket_compiled_sums", "model_axis", "parallelize_beside",
           "parallelize_for_training", "shard_over_dp"]

logger = logging.getLogger("tplower.hf")

#: the order of calls each entry needs, as its refusals say it
ORDER = {"prepare_trainer": "build the trainer with the model as loaded, then call prepare_trainer(trainer, mesh, "
                            "plan), then train()",
         "prepare_accelerator": "call prepare_accelerator(accelerator, model, mesh, plan) on the model as loaded, "
                                "then build the optimizer on model.parameters(), then accelerator.prepare(model, "
                                "optimizer, ...)"}


def model_axis(names: tuple[str, ...], plan: Any, experts: str | None, where: str) -> tuple[str, Any, str]:
    """The mesh axis the plan shards on, the plan and the experts mode for :func:`tplower.parallelize`.

    ``tp`` or ``ep``, whichever the mesh has; ``experts=None`` means ``"ep"`` on an ``ep`` axis, else ``"tp"``.
    Without either axis the plan is ``None`` (``"auto"`` then shards nothing: data and context parallelism only).

    Raises:
        TPLowerError: both ``tp`` and ``ep`` axes (experts are sharded over the tensor-parallel axis itself:
            name it ``ep`` for expert parallelism alone, ``tp`` with ``experts="ep"`` beside tensor parallelism);
            ``experts`` not ``"tp"``/``"ep"``/``None``; ``experts="tp"`` on an ``ep`` axis; a plan other than
            ``"auto"``/``None`` with neither axis; ``plan=None`` with one (nothing would be sharded over it).
    """
    present = [a for a in ("tp", "ep") if a in names]
    if len(present) == 2:
        raise TPLowerError(f"{where}: mesh axes {names} have both 'tp' and 'ep'; tplower shards experts over the one "
                           "tensor-parallel axis: use 'tp' with experts='ep' (expert and tensor parallelism on the "
                           "same ranks) or 'ep' alone")
    if experts not in (None, "tp", "ep"):
        raise TPLowerError(f"{where}: experts={experts!r}; allowed: None (from the mesh), 'tp' or 'ep'")
    axis = present[0] if present else "tp"
    mode = experts or ("ep" if axis == "ep" else "tp")
    if axis == "ep" and mode != "ep":
        raise TPLowerError(f"{where}: experts='tp' on an 'ep' mesh axis; name the axis 'tp' for tensor parallelism "
                           "inside the experts")
    if present and plan is None:
        raise TPLowerError(f"{where}: plan=None on a mesh with a {axis!r} axis {names}: nothing would be sharded "
                           f"over it (each of its ranks would hold the whole model and train on the same batch); "
                           f"pass plan='auto' (or a plan), or make the mesh without {axis!r}")
    if not present:
        if not (plan is None or (isinstance(plan, str) and plan.lower() == "auto")):
            raise TPLowerError(f"{where}: plan={plan!r} needs a 'tp' (or 'ep') mesh axis to shard on; the mesh "
                               f"has {names}")
        plan = None
    return axis, plan, mode


def shard_over_dp(model: nn.Module, layout: DataLayout, *, sum_gradients: bool, context: bool = False) -> int:
    """FSDP2 (``fully_shard``) over the ``dp`` axis: each decoder layer, then the whole model.

    The layers are the modules whose class a transformers model names in ``_no_split_modules`` (the classes
    accelerate's FSDP plugin wraps too); a model without it gets one FSDP2 group.

    Args:
        sum_gradients: ``True``: FSDP2 sums the gradients over ``dp`` (``set_gradient_divide_factor(1.0)`` with
            ``set_force_sum_reduction_for_comms(True)``),
            for losses divided by the whole global batch's token count; ``False``: it averages them (its
            default, DDP's rule, for losses that are each rank's own mean).
        context: the model was parallelized with ``context=layout.cp``: FSDP2 sums the gradients over ``cp`` too,
            in its own order, zeros for a parameter a rank did not use
            (:func:`tplower.runtime.grad_sums.sum_context_in_fsdp`), so ranks that call different modules get
            one process's gradients.

    Returns:
        The number of modules sharded (0 without a ``dp`` axis).
    """
    if layout.dp is None:
        return 0
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = layout.mesh[layout.dp]
    layers = set(getattr(model, "_no_split_modules", None) or ())
    targets = [m for m in model.modules() if m is not model and type(m).__name__ in layers] + [model]
    for module in targets:
        fully_shard(module, mesh=mesh)
    if sum_gradients:
        for module in targets:
            if isinstance(module, FSDPModule):  # a plain SUM (gloo has no PREMUL_SUM), divided by 1
                module.set_force_sum_reduction_for_comms(True)
                module.set_gradient_divide_factor(1.0)
    if context and layout.cp is not None:
        sum_context_in_fsdp(model, layout.mesh, layout.cp)
    return len(targets)


@dataclass(eq=False)
class TrainingModel:
    """What :func:`parallelize_for_training` did to a model, and what the stack's patches read.

    Attributes:
        model: the parallelized model.
        layout: the mesh's :class:`~tplower.hf.layout.DataLayout`.
        split: the ``cp`` batch splitter (``None`` without ``cp``).
        whole: the losses the model returned since :meth:`forget` (under ``cp``: each is the whole batch's,
            the same on every ``cp`` rank, since the context install sums the ranks' parts), recorded with
            ``record_losses`` or ``context``.
        counted: ``id`` of each loss in :attr:`whole` whose call was given a ``num_items_in_batch``.
        before: the model's parameters as they were before parallelization, by ``id`` (weak references: an
            optimizer built on them keeps them alive; see :meth:`replaced`).
    """

    model: nn.Module
    layout: DataLayout
    split: SequenceSplit | None
    whole: list[torch.Tensor] = field(default_factory=list)
    counted: set[int] = field(default_factory=set)
    before: dict[int, weakref.ref[torch.Tensor]] = field(default_factory=dict)

    def replaced(self, params: Iterable[torch.Tensor]) -> int:
        """How many of ``params`` are parameters the model had before it was parallelized (replaced since:
        an optimizer holding them would never move the model); identity, not value, is compared."""
        now = {id(p) for p in self.model.parameters()}
        return sum(1 for p in params if id(p) not in now and (ref := self.before.get(id(p))) is not None
                   and ref() is p)

    def _record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        loss = output.get("loss") if isinstance(output, Mapping) else None
        if isinstance(loss, torch.Tensor):
            self.whole.append(loss)
            if kwargs.get("num_items_in_batch") is not None:
                self.counted.add(id(loss))

    def forget(self) -> None:
        """Drop the recorded losses (call before each loss computation)."""
        self.whole.clear()
        self.counted.clear()

    def models_own(self, loss: Any) -> bool:
        """Whether ``loss`` is a loss the model returned since :meth:`forget` from a call given a count."""
        return any(loss is t and id(t) in self.counted for t in self.whole)

    def part(self, loss: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's part of the global batch's loss: summed over :attr:`DataLayout.split`, the whole.

        ``loss`` is what a loss computation returned; ``value`` (default ``loss``) a value derived from it by a
        constant factor (the detached, accumulation-scaled copy a trainer keeps). Under ``cp`` a loss the model
        returned is already whole over ``cp`` (see :attr:`whole`), so its part is ``value / cp``; a loss a trainer
        built from the model's per-token outputs (TRL's log-probabilities) is this rank's part as it is.
        """
        value = loss if value is None else value
        if self.layout.cp is not None and any(loss is t for t in self.whole):
            return value / self.layout.mesh.size(tuple(self.layout.mesh.mesh_dim_names or ()).index(self.layout.cp))
        return value


def parallelize_for_training(model: nn.Module, mesh: DeviceMesh, plan: Any, *, context: str | None,
                             context_mode: str, experts: str | None, sum_gradients: bool, where: str,
                             record_losses: bool = False, **options: Any) -> TrainingModel:
    """Parallelize ``model`` in place for training on ``mesh``; refusals come before anything is changed.

    :func:`tplower.parallelize` with the plan on the ``tp``/``ep`` axis (:func:`model_axis`) and ``context``
    (skipped on a mesh with ``dp`` alone, where it would have nothing to do), then :func:`shard_over_dp`, then
    (with ``context``) the whole-batch splitter and the loss record.

    Args:
        record_losses: record the losses the model returns (:attr:`TrainingModel.whole`; always under ``cp``).
        options: passed to :func:`tplower.parallelize` (``overlap``, ``strict``, ``cover``, ...).

    Raises:
        TPLowerError: the mesh (:meth:`DataLayout.of`), the axes and experts (:func:`model_axis`), a model
            already parallelized or already wrapped for data parallelism (``DistributedDataParallel``, as
            ``accelerator.prepare`` wraps it), and every refusal of :func:`tplower.parallelize`.
    """
    layout = DataLayout.of(mesh, context, where)
    axis, plan, mode = model_axis(tuple(mesh.mesh_dim_names or ()), plan, experts, where)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TPLowerError(f"{where}: the model is wrapped in DistributedDataParallel already (accelerator.prepare "
                           f"or Trainer wrapped it); {ORDER[where]}")
    if placed_by_tplower(model):
        raise TPLowerError(f"{where}: the model is parallelized already; pass the model as loaded and let {where} "
                           f"parallelize it (it takes plan, context and experts): {ORDER[where]}")
    before: dict[int, weakref.ref[torch.Tensor]] = {id(p): weakref.ref(p) for p in model.parameters()}
    if plan is not None or context is not None:  # a dp mesh alone: FSDP2 is all there is to do
        parallelize(model, mesh, plan, axis=axis, experts=mode, context=context, context_mode=context_mode,
                    **options)
    shard_over_dp(model, layout, sum_gradients=sum_gradients, context=context is not None)
    register_full_load(model)  # whole tensors load into FSDP2's shards too (a resume on a mesh of dp alone)
    split = SequenceSplit(model, layout) if context is not None else None
    record = TrainingModel(model, layout, split, before=before)
    if context is not None or record_losses:
        model.register_forward_hook(record._record, with_kwargs=True)
    return record


def parallelize_beside(model: nn.Module, tm: TrainingModel, plan: Any, *, experts: str | None, where: str,
                       **options: Any) -> None:
    """Place ``model``, a model a trainer holds beside the one it trains (TRL's reference model), as
    :func:`parallelize_for_training` placed ``tm.model``: :func:`tplower.parallelize` with the same plan on the same
    axis, then FSDP2 over ``dp``. Its parameters are then the same DTensors, shard for shard, as the trained
    model's, so code that mixes the two parameter by parameter (TRL's ``SyncRefModelCallback``, an EMA update) runs
    on local shards; its forward takes whole batches (no context split: a reference scores whole sequences) and,
    under FSDP2, shards the parameters again when it ends (no backward follows to do it).

    Raises:
        TPLowerError: every refusal of :func:`tplower.parallelize` (the plan does not fit ``model``).
    """
    layout = tm.layout
    axis, plan, mode = model_axis(tuple(layout.mesh.mesh_dim_names or ()), plan, experts, where)
    if placed_by_tplower(model):
        return
    if plan is not None:
        parallelize(model, layout.mesh, plan, axis=axis, experts=mode, **options)
    if shard_over_dp(model, layout, sum_gradients=True):
        # FSDP2 keeps its root's parameters whole after a forward, for the backward a reference never runs:
        # shard them again, so the reference's parameters are the trained model's layout between steps
        model.register_forward_hook(lambda module, args, output: module.reshard())  # type: ignore[operator]
    register_full_load(model)


def bucket_compiled_sums(backend: str | None) -> bool:
    """Let inductor join a compiled context-parallel step's gradient sums into buckets.

    Eager, the sums over ``cp`` run as one pass at the end of backward (:mod:`tplower.runtime.grad_sums`); in a
    compiled step each parameter's sum is an ``all_reduce`` of its own in the backward graph (38 in the bench's 4-layer
    Llama), each paying a collective's latency. Inductor's ``bucket_all_reduces_fx = "all"`` joins independent
    ones into buckets (a sum is elementwise: the same gradients). It is a process-wide setting of
    ``torch._inductor.config``: set here only where it is still ``"none"`` (a user's own choice stays), and
    logged. Users of a plain ``torch.compile`` set it the same way before compiling: a compile's ``options`` are
    not seen while the step is traced, and on gloo a small sum then runs as one ``all_to_all``
    (:mod:`tplower.core.lower.exchange`), which inductor does not join.

    Args:
        backend: the compile backend (``TrainingArguments.torch_compile_backend``; ``None``: inductor, as
            transformers defaults it).

    Returns:
        Whether the setting was changed (``False`` for another backend or a setting made already).
    """
    if (backend or "inductor") != "inductor":
        return False
    import torch._inductor.config as inductor

    if inductor.bucket_all_reduces_fx != "none":
        return False
    inductor.bucket_all_reduces_fx = "all"
    logger.info("tplower: torch._inductor.config.bucket_all_reduces_fx = 'all' (a compiled context-parallel "
                "step's per-parameter gradient sums over cp go as buckets)")
    return True
