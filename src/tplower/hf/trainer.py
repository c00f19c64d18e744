"""``prepare_trainer``: transformers' ``Trainer`` (and every subclass: TRL's ``SFTTrainer``, ``DPOTrainer``, a
user's own) trains a tplower model as one process trains the whole model.

The trainer is changed through instance attributes only (its class is untouched), each a public method a
``Trainer`` subclass may override, wrapping what the instance had (so a subclass's own override still runs
inside):

* ``get_batch_samples``: ``num_items_in_batch``, counted by the trainer's own rule on this rank's micro-batches
  of the step, summed over ``dp``: the whole global batch's count, as one process counts it. (The trainer's own
  cross-process sum is turned off: ``args.average_tokens_across_devices = False``; it would count each tp/cp
  group once per rank.)
* ``compute_loss``: each ``dp`` rank's loss weighted to be its part of one process's micro-batch loss, by what the
  loss is (:mod:`tplower.hf.losses`: a sum over the global count, a mean over labels, a mean over examples); in
  evaluation the same global count of the batch. Under
  ``cp`` the trainer's ``compute_loss`` gets this rank's piece of the batch (:func:`tplower.shard_sequence`'s
  output: labels shifted over the whole sequence, then cut), and ``accelerator.gather_for_metrics`` inside it
  gathers every ``dp`` and ``cp`` rank's value, so per-token metrics (TRL's ``mean_token_accuracy``,
  ``entropy``) count the whole global batch's tokens once, in training and evaluation alike.
* ``training_step``, ``prediction_step``: the loss each returns summed over ``dp`` (and ``cp`` for a loss built
  from per-token outputs), so the trainer's logged loss and ``eval_loss`` are one process's (the model's logits
  come back whole over ``cp`` in evaluation: :class:`tplower.hf.batches.SequenceSplit`).
* ``gather_function``: evaluation gathers over ``dp`` only.
* ``get_train_dataloader``: made as one process with ``dp`` times the batch makes it, each micro-batch then cut
  over the ``dp`` ranks (:class:`~tplower.hf.batches.Rounds`: a short last batch cut too, no row repeated);
  ``_track_num_input_tokens`` (private) counts a stand-in batch as nothing.
* ``label_smoother``: :class:`~tplower.hf.losses.Smoother` (shifted as the model's own class asks).
* ``callback_handler.call_event``: a callback mixing whole tensors into DTensor parameters ends in one line
  (:func:`tplower.hf.callbacks.guard_callbacks`).
* TRL's ``ref_model`` is placed as the trained model (:func:`~tplower.hf.model.parallelize_beside`); a generating
  trainer's generation batch is counted over ``dp`` (:mod:`tplower.hf.generation`); the ranks of a tp/cp/ep group
  take one random stream (:meth:`~tplower.hf.layout.DataLayout.same_random_streams`).
* ``get_total_train_batch_size``: the rows of a step over ``dp`` alone (``num_train_samples``, samples per
  second), not every rank.
* ``save_model``: every rank gathers the whole weights, rank 0 writes them (``from_pretrained`` loads the
  folder in one process).
* the optimizer's and scheduler's checkpoint (:func:`_checkpoint_methods`, the one private pair): tplower's
  ``optimizer_dcp/``, or a one-process run's ``optimizer.pt`` (each rank takes its shards).

The accelerator is patched by :func:`tplower.hf.accelerator.patch_accelerator` (no DDP, batches over ``dp``) and
:func:`~tplower.hf.accelerator.count_data_processes` (``num_processes`` the ``dp`` size).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..core.support.errors import TPLowerError
from .accelerator import (
    check_accelerator,
    count_data_processes,
    one_process,
    patch_accelerator,
    pieces_gathered,
    training_batches,
)
from .batches import EXAMPLES_KEY, Share, global_count, share_of
from .callbacks import guard_callbacks
from .generation import check_generation, fit_generation
from .layout import DataLayout
from .losses import LossRule, Smoother, is_causal_lm
from .model import ORDER, TrainingModel, bucket_compiled_sums, parallelize_beside, parallelize_for_training
from .saving import (
    OPTIMIZER_FILE,
    OPTIMIZER_FOLDER,
    SCHEDULER_FILE,
    load_optimizer,
    load_scheduler,
    load_whole_optimizer,
    optimizer_format,
    save_optimizer,
    save_scheduler,
    writes_whole,
)

__all__ = ["prepare_trainer"]

#: the Trainer methods (private, no public route) that write and read the optimizer's and scheduler's state
CHECKPOINT_METHODS = ("_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler")


def _check_trainer(trainer: Any, context: str | None, token_loss: bool) -> None:
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        raise TypeError(f"prepare_trainer: trainer must be a transformers.Trainer (or a subclass such as TRL's "
                        f"SFTTrainer), got {type(trainer).__name__}")
    if trainer.optimizer is not None or trainer.lr_scheduler is not None:
        raise TPLowerError("prepare_trainer: the trainer holds an optimizer or scheduler already, built on the "
                           "parameters before parallelization (they would never change); pass no optimizers=(...) "
                           "(optimizer_cls_and_kwargs is fine: train() builds it after the call), and "
                           f"{ORDER['prepare_trainer']}")
    check_accelerator(trainer.accelerator, "prepare_trainer")
    missing = [name for name in CHECKPOINT_METHODS if not callable(getattr(type(trainer), name, None))]
    if missing:
        raise TPLowerError(f"prepare_trainer: this transformers release has no Trainer.{missing[0]}, through which "
                           "tplower checkpoints the optimizer's shards; use the transformers version tplower is "
                           "tested with (5.24, 5.25)")
    if not isinstance(token_loss, bool):
        raise TypeError(f"prepare_trainer: token_loss must be True or False, got {token_loss!r}")
    if context is not None and not token_loss:
        _check_token_loss(trainer)
    if context is not None and trainer.compute_loss_func is not None:
        raise TPLowerError("prepare_trainer: context parallelism leaves each rank the logits of its own tokens and "
                           "their labels, shifted already; a compute_loss_func may shift them again or reduce over "
                           "the whole sequence: drop it (label_smoothing_factor works), or pass context=None")


def _check_token_loss(trainer: Any) -> None:
    """Under ``cp`` each rank's loss must be its tokens' part of a sum over tokens (divided by the global count):
    transformers' own ``compute_loss`` and TRL's ``SFTTrainer``'s are; a loss of per-sequence sums (DPO's, KTO's,
    GRPO's log-probabilities summed over each completion) taken on a piece of each sequence is not, and would be
    silently wrong."""
    from transformers import Trainer

    sft = getattr(sys.modules.get("trl.trainer.sft_trainer"), "SFTTrainer", None)  # loaded when the trainer is one
    known = {Trainer.compute_loss, getattr(sft, "compute_loss", Trainer.compute_loss)}
    if type(trainer).compute_loss not in known:
        raise TPLowerError(f"prepare_trainer: context parallelism gives each rank a piece of every sequence; "
                           f"{type(trainer).__name__}.compute_loss is not a loss tplower knows to be a sum over "
                           "tokens (Trainer's, TRL's SFTTrainer's), and one built from per-sequence sums (DPO, KTO, "
                           "GRPO) would be silently wrong on pieces: pass token_loss=True if yours is a sum over "
                           "tokens divided by num_items_in_batch (one that only calls super() is), else "
                           "context=None (tp, ep and dp work with it)")


def _checkpoint_methods(trainer: Any, tm: TrainingModel) -> None:
    """The trainer's optimizer and scheduler checkpoint, through DCP (each rank its shards) and rank 0's file.

    transformers (checked on 5.24) saves the optimizer with ``torch.save`` on the main process only and loads
    that one file on every rank, through the private methods :data:`CHECKPOINT_METHODS`; there is no public hook
    for it. They are replaced on the instance here, and ``tests/test_hf_stacks.py`` fails loudly when a release
    renames them. A resume reads tplower's :data:`~tplower.hf.saving.OPTIMIZER_FOLDER` or, in a folder a
    one-process run wrote, its :data:`~tplower.hf.saving.OPTIMIZER_FILE` (whole tensors: each rank takes its
    shards); the scheduler's file either way. A folder with neither optimizer state loads none (transformers'
    own rule).
    """
    def save(output_dir: str) -> None:
        save_optimizer(tm.model, trainer.optimizer, os.path.join(output_dir, OPTIMIZER_FOLDER))
        save_scheduler(trainer.lr_scheduler, os.path.join(output_dir, SCHEDULER_FILE))

    def load(checkpoint: str | None) -> None:
        found = None if checkpoint is None else optimizer_format(checkpoint)
        if checkpoint is None or found is None:
            return
        if found == "dcp":
            load_optimizer(tm.model, trainer.optimizer, os.path.join(checkpoint, OPTIMIZER_FOLDER))
        else:
            load_whole_optimizer(trainer.optimizer, os.path.join(checkpoint, OPTIMIZER_FILE))
        load_scheduler(trainer.lr_scheduler, os.path.join(checkpoint, SCHEDULER_FILE))

    trainer._save_optimizer_and_scheduler = save
    trainer._load_optimizer_and_scheduler = load


def _stand_in(batch: Any) -> bool:
    share = batch.get(EXAMPLES_KEY) if isinstance(batch, Mapping) else None
    return isinstance(share, Share) and share.mine == 0


def _loss_methods(trainer: Any, tm: TrainingModel, rule: LossRule) -> None:
    """``get_batch_samples``, ``compute_loss``, ``training_step`` and ``prediction_step`` (module docstring)."""
    layout = tm.layout
    get_batch_samples, compute_loss = trainer.get_batch_samples, trainer.compute_loss
    training_step, prediction_step = trainer.training_step, trainer.prediction_step
    last: dict[str, Any] = {}

    def batch_samples(epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list[Any], Any]:
        batches, local = get_batch_samples(epoch_iterator, num_batches, device)
        if local is not None and any(_stand_in(b) for b in batches):  # a stand-in's labels count for nothing
            real = [b for b in batches if not _stand_in(b)]
            local = get_batch_samples(iter(real), len(real), device)[1] if real else None
            local = torch.zeros((), dtype=torch.int64, device=device) if local is None else local
        return batches, global_count(local, layout)

    def loss_of(model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                num_items_in_batch: Any = None) -> Any:
        share = share_of(inputs) or last.pop("share", None)
        if not model.training:  # evaluation: the trainer counts the rank's batch alone; count the global one
            num_items_in_batch = batch_samples(iter([inputs]), 1, trainer.args.device)[1]
        tm.forget()
        pieces = tm.split.cut(inputs) if tm.split is not None else inputs  # under cp: this rank's piece
        with pieces_gathered(trainer.accelerator, layout) if pieces is not inputs else contextlib.nullcontext():
            result = compute_loss(model, pieces, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        loss = result[0] if return_outputs else result
        kind = rule.kind(trainer, num_items_in_batch is not None, tm.models_own(loss))
        weight = rule.weight(kind, share, inputs, layout)
        if weight != 1.0:  # this dp rank's part of one process's micro-batch loss (tplower.hf.losses)
            loss = loss * weight
            result = (loss, *result[1:]) if return_outputs else loss
        last["loss"] = loss
        return result

    def step(model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        share = last["share"] = share_of(inputs)  # the sampler's tag leaves the batch before the trainer reads it
        last["stand-in"] = id(inputs) if share is not None and share.mine == 0 else None
        value = training_step(model, inputs, num_items_in_batch)
        last.pop("share", None)
        mine = tm.part(last.pop("loss"), value) if "loss" in last else value
        tm.forget()
        return layout.sum_over(mine.detach(), layout.split)

    def predict(model: Any, inputs: dict[str, Any], prediction_loss_only: bool,
                ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        last.clear()
        loss, logits, labels = prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if loss is not None and "loss" in last:
            loss = layout.sum_over(tm.part(last["loss"], loss).detach(), layout.split)
        tm.forget()
        return loss, logits, labels

    track = getattr(trainer, "_track_num_input_tokens", None)  # transformers' private counter (5.24)

    def tokens_of(inputs: Any) -> Any:
        """``num_input_tokens_seen``: a stand-in's tokens count for nothing (its rank still joins the count)."""
        if _stand_in(inputs) or id(inputs) == last.get("stand-in"):  # counted after training_step took the tag
            inputs = {k: v[:0] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        return track(inputs) if track is not None else None

    if callable(track):
        trainer._track_num_input_tokens = tokens_of
    trainer.get_batch_samples = batch_samples
    trainer.compute_loss = loss_of
    trainer.training_step = step
    trainer.prediction_step = predict


class _OneProcess:
    """A ``PartialState`` seen by data code as one process's: ``num_processes`` 1, ``process_index`` 0; every other
    attribute is the state's own."""

    num_processes, process_index = 1, 0

    def __init__(self, state: Any) -> None:
        self._state = state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


def _loader_method(trainer: Any, tm: TrainingModel) -> None:
    """``get_train_dataloader``: made as one process makes it, then cut over ``dp``.

    While the trainer builds its training ``DataLoader``, ``args.world_size``, ``accelerator.num_processes`` and
    ``args.process_index`` read 1, 1 and 0 and ``args.per_device_train_batch_size`` reads ``dp`` times its
    value, so samplers sized or split by them
    (``group_by_length``'s mega-batches, ``batch_rebalance``, the workers' seeds) order the rows as one process
    with ``dp`` times the batch orders them; the loader's own batch size stays the per-device one, and
    :func:`~tplower.hf.batches.dp_data_loader` cuts each of one process's micro-batches into the ``dp`` ranks'
    parts (:class:`~tplower.hf.batches.Rounds`)."""
    get_train_dataloader, args, layout = trainer.get_train_dataloader, trainer.args, tm.layout

    def train_loader() -> Any:
        state, batch = args.__dict__.get("distributed_state"), args.per_device_train_batch_size
        if state is not None:
            args.distributed_state, args.per_device_train_batch_size = _OneProcess(state), batch * layout.dp_size
        try:
            with training_batches(trainer.accelerator, layout), one_process(trainer.accelerator):
                return get_train_dataloader()
        finally:
            args.per_device_train_batch_size = batch
            if state is not None:
                args.distributed_state = state

    trainer.get_train_dataloader = train_loader


#: the attributes under which TRL's trainers hold a model beside the trained one (a reference model), placed like it
BESIDE = ("ref_model",)
def _batch_size_method(trainer: Any, tm: TrainingModel) -> None:
    """``get_total_train_batch_size``: the stack's count (every process reads its own rows) over ``dp`` alone."""
    total = trainer.get_total_train_batch_size
    world = tm.layout.mesh.size()

    def total_rows(args: Any) -> int:
        return int(total(args)) * tm.layout.dp_size // world

    trainer.get_total_train_batch_size = total_rows


def _save_method(trainer: Any, tm: TrainingModel) -> None:
    save_model = trainer.save_model

    def save(output_dir: str | None = None, _internal_call: bool = False) -> None:
        with writes_whole(tm.model):
            save_model(output_dir, _internal_call)

    trainer.save_model = save


def prepare_trainer(trainer: Any, mesh: DeviceMesh | str, plan: Any = "auto", *, context: str | None = None,
                    context_mode: str = "ulysses", experts: str | None = None, token_loss: bool = False,
                    layout: Mapping[str, Any] | None = None, **options: Any) -> Any:
    """Parallelize ``trainer.model`` on ``mesh`` and make ``trainer`` train it as one process trains the whole model.

    Call it on every rank, after the trainer is built (with the model as loaded, the same weights on every rank)
    and before ``train()``, ``evaluate()`` or ``predict()``. Afterwards, against one process's plain ``Trainer``
    on the same global batches: the same losses (logged), gradient norms, parameters, ``eval_loss`` and
    predictions, whatever the loss is (a token sum, a sequence classifier's mean, label smoothing, TRL's DPO and
    GRPO losses, a user's per-example mean: :mod:`tplower.hf.losses`) and with a short last batch; TRL's
    reference model is placed as the model; a ``PeftModel``'s ``save_model`` writes its adapters as one process
    does; ``save_model`` writes a folder ``from_pretrained`` loads in one process; checkpoints hold the
    whole weights (``model.safetensors``), the optimizer's shards (DCP, ``optimizer_dcp/``), the scheduler and
    each rank's RNG, and ``train(resume_from_checkpoint=...)`` continues as the uninterrupted run (from a
    one-process run's checkpoint too: its ``optimizer.pt`` is read whole, each rank taking its shards). No
    ``accelerate.ParallelismConfig`` is involved (none may be set).

    Args:
        trainer: a ``transformers.Trainer`` or any subclass, without an optimizer yet.
        mesh: every rank of the job, axes among ``dp`` (data parallel: FSDP2 shards the parameters over it, each
            coordinate reads its own micro-batches of ``per_device_train_batch_size``), ``cp`` (context
            parallel), ``tp`` (tensor parallel) and ``ep`` (expert parallel); the ranks of one tp/cp/ep group
            read the same batches. ``"auto"``: the mesh :func:`tplower.plan_layout` predicts fastest among those
            that fit (:func:`tplower.planner.auto.auto_mesh`: ``tp`` with a plan, ``cp`` with ``context="cp"``,
            checkpointing as the trainer's arguments say), logged with its predicted peak.
        plan: as :func:`tplower.parallelize`'s, on the ``tp``/``ep`` axis (``"auto"``: the model's own plan;
            with neither axis, nothing is sharded by a plan).
        context: ``"cp"`` (the mesh's context-parallel axis; required when it has one) or ``None``: every
            batch the model is called with is cut by :func:`tplower.shard_sequence` (padded, packed with
            ``position_ids``, TRL's padding-free batches); the trainer's ``compute_loss`` gets the cut batch.
            With ``torch_compile`` (inductor) it sets ``torch._inductor.config.bucket_all_reduces_fx = "all"``
            where unset (:func:`~tplower.hf.model.bucket_compiled_sums`: the gradient sums over cp in buckets).
        context_mode: ``"ulysses"`` or ``"allgather"`` (:func:`tplower.parallelize`).
        experts: ``"ep"`` (expert parallelism over the ``tp``/``ep`` axis), ``"tp"``, or ``None``: ``"ep"`` on an
            ``ep`` axis, else ``"tp"``.
        token_loss: ``True`` vouches that the trainer's own ``compute_loss`` is a sum over tokens divided by
            ``num_items_in_batch`` (one that only adds to ``super().compute_loss`` is), so ``context`` takes it;
            without it, ``context`` takes only ``Trainer``'s and ``SFTTrainer``'s.
        layout: with ``mesh="auto"``: options of the search (``memory_per_rank``, ``seq_len``, ``device``,
            ``gpus_per_node``, ``dtype``, ``workers``, ``loss_chunk``).
        options: passed to :func:`tplower.parallelize` (``overlap``, ``strict``, ``cover``, ...).

    Returns:
        ``trainer`` itself (its model parallelized in place; see the module docstring for what changed).

    Raises:
        TypeError: ``trainer`` is not a ``transformers.Trainer``; ``mesh`` not a ``DeviceMesh``; ``token_loss``
            not a bool.
        TPLowerError: before anything is changed: the trainer already holds an optimizer or scheduler; its
            accelerator has a ``ParallelismConfig``, FSDP or DeepSpeed; the mesh's axes, a mesh smaller than
            the job, an axis the call would not use (``cp`` without ``context="cp"``, ``tp``/``ep`` with
            ``plan=None``), ``context`` other than ``"cp"``; a model already parallelized; with ``context``, a
            ``compute_loss`` other than ``Trainer``'s or ``SFTTrainer``'s without ``token_loss=True`` (a
            per-sequence loss such as DPO's would be wrong on pieces of each sequence) or a
            ``compute_loss_func``; a generating trainer's arguments TRL's world-wide gather would skew
            (:func:`tplower.hf.generation.check_generation`); KTO's KL term (``calculate_KL``) over ``dp`` (its
            pairs are made per device batch); and every refusal of :func:`tplower.parallelize`.
            Later, at a resume: a checkpoint folder the ranks see differently, or a one-process ``optimizer.pt``
            whose parameter groups are not the trainer's; in training, a callback that mixes a whole tensor
            into the model's DTensor parameters (one line naming it, on every rank).
    """
    _check_trainer(trainer, context, token_loss)
    if isinstance(mesh, str):
        if mesh != "auto":
            raise TPLowerError(f"prepare_trainer: mesh={mesh!r}: give a DeviceMesh or 'auto'")
        from ..planner.auto import auto_mesh

        mesh, context = auto_mesh(trainer, plan, context, context_mode, layout)
    elif layout is not None:
        raise TPLowerError("prepare_trainer: layout= is read with mesh='auto' only; drop it or pass mesh='auto'")
    mesh = cast(DeviceMesh, mesh)  # not a DeviceMesh: DataLayout.of raises the TypeError
    data = DataLayout.of(mesh, context, "prepare_trainer")
    check_generation(trainer.args, data)
    if getattr(trainer, "calculate_KL", False) and data.dp_size > 1:
        raise TPLowerError(f"prepare_trainer: {type(trainer).__name__} pairs each completion with another of its "
                           "per-device batch for its KL term when it prepares the dataset, so at dp="
                           f"{data.dp_size} the pairs are not those of one process with dp times the batch; "
                           "train it on a mesh without 'dp' (tp, ep), or with a loss_type without the KL term")
    rule, causal = LossRule.of(trainer, trainer.model, token_loss), is_causal_lm(trainer.model)
    tm = parallelize_for_training(trainer.model, mesh, plan, context=context, context_mode=context_mode,
                                  experts=experts, sum_gradients=True, where="prepare_trainer",
                                  record_losses=not rule.known, **options)
    for name in BESIDE:  # TRL's reference model, placed as the trained model is (shard for shard)
        other = getattr(trainer, name, None)
        if isinstance(other, nn.Module) and other is not tm.model:
            parallelize_beside(other, tm, plan, experts=experts, where="prepare_trainer", **options)
    if context is not None and getattr(trainer.args, "torch_compile", False):
        bucket_compiled_sums(trainer.args.torch_compile_backend)
    patch_accelerator(trainer.accelerator, tm.layout, tm.model)
    count_data_processes(trainer.accelerator, tm.layout)
    fit_generation(trainer.args, tm.layout)
    trainer.args.average_tokens_across_devices = False
    Smoother.install(trainer, causal, tm.split)
    _loss_methods(trainer, tm, rule)
    _loader_method(trainer, tm)
    trainer.gather_function = lambda value, **_: trainer.accelerator.gather_for_metrics(value)
    _batch_size_method(trainer, tm)
    _save_method(trainer, tm)
    _checkpoint_methods(trainer, tm)
    guard_callbacks(trainer)
    tm.layout.same_random_streams()  # a tp/cp/ep group draws as one process (GRPO seeds each process apart)
    return trainer
