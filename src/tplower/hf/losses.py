"""What a trainer's loss is, and the weight that makes each ``dp`` rank's loss its part of one process's loss.

One process with ``dp`` times the per-device batch computes each micro-batch's loss over the whole micro-batch;
on a mesh each ``dp`` rank holds a part of it (:class:`tplower.hf.batches.Rounds`), and FSDP2 *sums* the ranks'
gradients (as the logged loss is summed). So each rank's loss is multiplied by its part's weight, chosen by
what the loss is (:class:`LossKind`), not by whether the model's ``forward`` takes a ``num_items_in_batch``:

=================  ===========================================================  ==================================
kind               the loss is                                                  this rank's weight
=================  ===========================================================  ==================================
``sum``            a sum over this rank's items divided by ``num_items_in_batch``  1 (the count is the global one);
                   (transformers' causal-LM loss, TRL's SFT loss, the label       0 for a stand-in micro-batch
                   smoother and ``compute_loss_func`` given the count)
``label_mean``     a mean over the micro-batch's labels other than ``-100``      this rank's labels / the round's
                   (a sequence-classification or token-classification head,     (one ``all_reduce`` over ``dp``)
                   a model's loss that took no count)
``example_mean``   a mean over the micro-batch's examples (a trainer's own      this rank's examples / the round's
                   ``compute_loss``: DPO, KTO, GRPO, a user's per-example       (from the sampler's
                   mean; unless it returns the model's own loss as it is)       :class:`~tplower.hf.batches.Share`)
=================  ===========================================================  ==================================

Everything else the trainer does with the loss (dividing by the gradient-accumulation steps or not, its
documented habit of not dividing a mean when the model accepts loss keywords) runs unchanged, as one process
runs it, so the mesh follows one process's run, not DDP's. (``Trainer.loss_is_scaled_for_ga`` says whether a
loss is divided by the accumulation steps already, not what it is a mean over: TRL's GRPO sets it for
per-sequence means. It is not read here.)
"""

from __future__ import annotations

import enum
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .batches import SequenceSplit, Share
from .layout import DataLayout

__all__ = ["LossKind", "LossRule", "Smoother", "is_causal_lm", "label_count"]


class LossKind(enum.Enum):
    """What a micro-batch's loss is a sum or a mean over (see the module docstring's table)."""

    SUM = "sum"
    LABEL_MEAN = "label_mean"
    EXAMPLE_MEAN = "example_mean"


def label_count(batch: Any, shifts: bool) -> torch.Tensor | None:
    """The labels a loss over ``batch`` averages: ``shift_labels`` where the batch has them, else ``labels``
    (without the first position of each row when ``shifts``: a causal LM predicts from position 1 on), not
    ``-100``; transformers' own rule for ``num_items_in_batch``. ``None`` without labels."""
    if not hasattr(batch, "get"):
        return None
    labels = batch.get("shift_labels")
    if not isinstance(labels, torch.Tensor):
        labels = batch.get("labels")
        if not isinstance(labels, torch.Tensor):
            return None
        labels = labels[..., 1:] if shifts else labels
    return labels.ne(-100).sum()


def _takes_count(model: nn.Module) -> bool:
    """Whether the model's own loss function divides by ``num_items_in_batch`` (transformers' ``ForCausalLMLoss``
    and ``ForMaskedLMLoss`` name it; ``ForSequenceClassificationLoss`` and ``ForTokenClassification`` are called
    without it and take a mean)."""
    loss = getattr(model, "loss_function", None)
    try:
        return loss is not None and "num_items_in_batch" in inspect.signature(loss).parameters
    except (TypeError, ValueError):
        return False


def _known_compute_loss(trainer: Any) -> bool:
    """Whether ``trainer``'s ``compute_loss`` is ``Trainer``'s or TRL's ``SFTTrainer``'s (whose kinds are known)."""
    from transformers import Trainer

    sft = getattr(sys.modules.get("trl.trainer.sft_trainer"), "SFTTrainer", None)  # loaded when the trainer is one
    return type(trainer).compute_loss in {Trainer.compute_loss, getattr(sft, "compute_loss", Trainer.compute_loss)}


@dataclass(frozen=True)
class LossRule:
    """A trainer's loss kinds, read once at :func:`tplower.hf.prepare_trainer`.

    Attributes:
        known: the trainer's ``compute_loss`` is ``Trainer``'s or ``SFTTrainer``'s.
        token_loss: the user vouched (``prepare_trainer(..., token_loss=True)``) that the loss is a sum over
            tokens divided by ``num_items_in_batch``.
        model_counts: the model's own loss divides by ``num_items_in_batch`` when it is given one.
        sft: the trainer is TRL's ``SFTTrainer`` (its loss is its own sum over tokens, not the model's).
        shifts: label counts skip each row's first position (a causal LM's loss).
    """

    known: bool
    token_loss: bool
    model_counts: bool
    sft: bool
    shifts: bool

    @classmethod
    def of(cls, trainer: Any, model: nn.Module, token_loss: bool) -> LossRule:
        """The rule of ``trainer`` whose model (before parallelization) is ``model``."""
        from transformers import Trainer

        known = _known_compute_loss(trainer)
        sft = known and type(trainer).compute_loss is not Trainer.compute_loss
        shifts = bool(getattr(trainer, "_loss_shifts_labels", is_causal_lm(model)))
        return cls(known, token_loss, _takes_count(_base(model)), sft, shifts)

    def kind(self, trainer: Any, counted: bool, models_own: bool) -> LossKind:
        """The kind of the loss ``trainer.compute_loss`` returned.

        Args:
            trainer: the trainer.
            counted: ``compute_loss`` was passed a ``num_items_in_batch``.
            models_own: the returned loss is the very tensor the model returned as its ``loss`` in a call given
                that count (a subclass that only adds to ``super().compute_loss`` returns it).
        """
        if self.token_loss:
            return LossKind.SUM
        if not self.known:  # a trainer's own loss (DPO's, GRPO's, a user's): a mean over its examples, unless
            return LossKind.SUM if models_own and self.model_counts else LossKind.EXAMPLE_MEAN  # the model's
        if trainer.compute_loss_func is not None:
            return LossKind.SUM if counted else LossKind.EXAMPLE_MEAN
        if trainer.label_smoother is not None or self.sft:
            return LossKind.SUM if counted else LossKind.LABEL_MEAN
        given = counted and bool(getattr(trainer, "model_accepts_loss_kwargs", False))
        return LossKind.SUM if given and self.model_counts else LossKind.LABEL_MEAN

    def weight(self, kind: LossKind, share: Share | None, batch: Any, layout: DataLayout) -> float:
        """This ``dp`` rank's weight for a micro-batch ``batch`` of ``share`` (``None``: a whole part of a full
        round). Collective over ``dp`` for :attr:`LossKind.LABEL_MEAN` with labels; 1 without a ``dp`` axis."""
        if layout.dp is None:
            return 1.0
        stand_in = share is not None and share.mine == 0
        if kind is LossKind.SUM:
            return 0.0 if stand_in else 1.0
        count = label_count(batch, self.shifts) if kind is LossKind.LABEL_MEAN else None
        if count is not None:
            mine = torch.zeros_like(count) if stand_in else count
            whole = layout.sum_over(mine, (layout.dp,))
            return float(mine) / max(float(whole), 1.0)
        if share is None:
            return 1.0 / layout.dp_size
        return share.mine / share.whole


def _base(model: nn.Module) -> nn.Module:
    """A PEFT model's base transformers model (its loss function and class), else ``model``."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` (or a PEFT model's base) is of a class transformers maps as a causal LM (its own test in
    ``Trainer.compute_loss``, read before FSDP2 renames the class)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(_base(model)).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


class Smoother:
    """A trainer's ``label_smoother`` that shifts as the model's own class asks, whatever wraps it.

    transformers' ``Trainer.compute_loss`` shifts the labels for the smoother when the unwrapped model's class
    name is a causal LM's; FSDP2 renames the class (``FSDPLlamaForCausalLM``), which would smooth unshifted
    labels. Under ``cp`` each rank's labels are its piece, shifted already (:func:`tplower.shard_sequence`), so
    nothing is shifted again, and logits made whole for evaluation are cut back to the piece first.
    ``num_items_in_batch`` and everything else pass to the smoother unchanged.

    Args:
        smoother: the trainer's ``LabelSmoother``.
        causal: the model (before parallelization) is a causal LM.
        split: under ``cp``, the batch splitter (its last cut is the labels' piece); else ``None``.
    """

    def __init__(self, smoother: Any, causal: bool, split: SequenceSplit | None) -> None:
        self.smoother, self.shift, self.split = smoother, causal and split is None, split
        self.epsilon = getattr(smoother, "epsilon", None)
        self.ignore_index = getattr(smoother, "ignore_index", -100)

    def __call__(self, model_output: Any, labels: torch.Tensor, shift_labels: bool = False,
                 **kwargs: Any) -> torch.Tensor:
        cut = self.split.ours if self.split is not None else None
        logits = model_output["logits"] if isinstance(model_output, Mapping) else model_output[0]
        if cut is not None and logits.dim() >= 2 and logits.shape[1] != labels.shape[-1]:  # whole for evaluation
            model_output = {"logits": logits.index_select(1, cut.local_index.to(logits.device))}
        loss: torch.Tensor = self.smoother(model_output, labels, shift_labels=self.shift, **kwargs)
        return loss

    @classmethod
    def install(cls, trainer: Any, causal: bool, split: SequenceSplit | None) -> None:
        """Replace ``trainer.label_smoother`` (when it has one) by a :class:`Smoother` (``causal``: the model is a
        causal LM, :func:`is_causal_lm` before parallelization)."""
        if trainer.label_smoother is not None and not isinstance(trainer.label_smoother, cls):
            trainer.label_smoother = cls(trainer.label_smoother, causal, split)
