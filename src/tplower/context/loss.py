"""The causal-LM loss of a context-parallel model in sequence chunks: no rank holds its ``[B, S/cp, V]`` logits.

At a real vocabulary the logits are a model's largest activation (8k tokens
x 32k vocabulary x 4 bytes: 1 GiB in one process, half of it per rank at
cp=2, and cross-entropy keeps as much again for its backward). With
``loss_chunk=c`` (:func:`~tplower.context.install.install_context`, or
``parallelize(..., context_loss_chunk=c)``), a model called with ``labels``:

* runs its decoder as always; a forward pre-hook on its output head
  (``get_output_embeddings()``) keeps the final hidden states ``[B, s, H]``
  and lets the head run on the first position only;
* then, for each chunk of ``c`` positions, computes the head, the post-head
  logit transforms the model's forward names (``final_logit_softcapping``,
  ``logit_scale``, ``logits_scaling``) and the model's own
  ``loss_function`` (the globally shifted labels and the whole batch's
  ``num_items_in_batch`` from :func:`tplower.shard_sequence`, so each chunk's
  value is its part of one process's mean), under activation checkpointing:
  a chunk's logits live only while its loss is computed, and again while its
  backward runs (ALST's tiled loss; Liger's fused linear cross-entropy does
  the same inside one kernel);
* checks that the model's own logits of the first position are what the
  chunks compute there (bit for bit), so a model whose forward changes its
  logits in another way after the head is refused rather than trained on a
  different loss.

The model's output then has the loss and no ``logits``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, MutableMapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..core.support.errors import TPLowerError
from ..core.support.fake import is_fake

__all__ = ["TiledLoss"]

_LABELS = ("labels", "shift_labels")


def _forward_names(model: nn.Module) -> tuple[str, ...]:
    forward = inspect.unwrap(type(model).forward)
    code = getattr(forward, "__code__", None)
    return tuple(code.co_names) if code is not None else ()


def _logit_transform(model: nn.Module, config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The elementwise changes the model's forward makes to the head's output (those it names), as one function."""
    names = _forward_names(model)
    steps: list[Callable[[torch.Tensor], torch.Tensor]] = []
    scaling = getattr(config, "logits_scaling", None)
    if "logits_scaling" in names and scaling is not None:
        steps.append(lambda t: t / scaling)
    scale = getattr(model, "logit_scale", None)
    if "logit_scale" in names and scale is not None:
        steps.append(lambda t: t * scale)
    cap = getattr(config, "final_logit_softcapping", None)
    if "final_logit_softcapping" in names and cap is not None:
        steps.append(lambda t: torch.tanh(t / cap) * cap)

    def apply(t: torch.Tensor) -> torch.Tensor:
        for step in steps:
            t = step(t)
        return t
    return apply


class TiledLoss:
    """The tiled loss of one model (see the module docstring): a pre-hook on its head and the chunked loss.

    Args:
        model: the causal LM; ``config``: its text config (``vocab_size`` and the logit transforms).
        chunk: positions per chunk (``[B, chunk, V]`` logits at a time), at least 1.
        arg: ``caller: argument`` the refusals name (:func:`tplower.parallelize` calls it
            ``context_loss_chunk``).

    Raises:
        TPLowerError: ``chunk`` below 1, or a model without an output head (``get_output_embeddings()``).
    """

    def __init__(self, model: nn.Module, config: Any, chunk: int, arg: str = "install_context: loss_chunk") -> None:
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise TPLowerError(f"{arg}={chunk!r} must be an int >= 1 (positions per chunk of the logits), or None "
                               "for the whole logits")
        getter = getattr(model, "get_output_embeddings", None)
        head = getter() if callable(getter) else None
        if not isinstance(head, nn.Module):
            raise TPLowerError(f"{arg}= computes the loss from the model's output head in chunks, but "
                               f"{type(model).__name__} has none (get_output_embeddings() is "
                               f"{type(head).__name__}); drop {arg.partition(': ')[2]}")
        self.model, self.head, self.chunk = model, head, chunk
        self.vocab = getattr(config, "vocab_size", None)
        self.transform = _logit_transform(model, config)
        self.state: dict[str, Any] = {}

    def attach(self) -> Any:
        """Register the head's forward pre-hook; returns its handle."""
        return self.head.register_forward_pre_hook(self._capture)

    def begin(self, name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The model's keywords without its labels (kept here for :meth:`finish`) when it was called with some."""
        self.state.clear()
        if kwargs.get("labels") is None:
            return kwargs
        if kwargs.get("return_dict") is False:
            raise TPLowerError(f"{name}: loss_chunk= returns the loss in the model's output dict; call it without "
                               "return_dict=False")
        if kwargs.get("num_items_in_batch") is None:
            raise TPLowerError(f"{name}: loss_chunk= sums the chunks' losses, each divided by the whole batch's "
                               "label count; call the model with tplower.shard_sequence's part (it passes "
                               "num_items_in_batch)")
        self.state.update({k: kwargs.get(k) for k in (*_LABELS, "num_items_in_batch")})
        return {k: v for k, v in kwargs.items() if k not in _LABELS}

    def _capture(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if "labels" not in self.state or "hidden" in self.state or not args:
            return None  # not a tiled call, or the chunks' own calls
        hidden = args[0]
        self.state["hidden"] = hidden
        return (hidden.narrow(1, 0, 1), *args[1:])

    def _chunk_loss(self, hidden: torch.Tensor, labels: torch.Tensor, shift: torch.Tensor | None,
                    count: Any) -> torch.Tensor:
        """One chunk's part of the loss: the head, the logit transforms, the model's ``loss_function``."""
        logits = self.transform(self.head(hidden))
        loss: torch.Tensor = self.model.loss_function(  # type: ignore[operator]
            logits=logits, labels=labels, vocab_size=self.vocab or logits.shape[-1], num_items_in_batch=count,
            shift_labels=shift)
        return loss

    def finish(self, name: str, output: Any) -> None:
        """Put this rank's part of the loss, chunk by chunk, in ``output`` (and no logits); nothing without labels."""
        state = self.state
        if "labels" not in state:
            return
        hidden = state.get("hidden")
        if not isinstance(hidden, torch.Tensor) or not isinstance(output, MutableMapping):
            raise TPLowerError(f"{name}: loss_chunk= found no call of its output head with the final hidden "
                               "states; drop loss_chunk for this model")
        mine = self.transform(self.head(hidden.narrow(1, 0, 1))).detach()
        theirs = output.get("logits")
        if not isinstance(theirs, torch.Tensor) or theirs.shape != mine.shape or (
                not is_fake(mine) and not torch.equal(theirs, mine)):  # fake: no values to compare (planner)
            raise TPLowerError(f"{name}: its forward changes the logits after the output head in a way loss_chunk= "
                               "does not repeat (the first position's logits differ); drop loss_chunk for this "
                               "model")
        total = self.chunked(hidden, state["labels"], state["shift_labels"], state["num_items_in_batch"])
        state.clear()
        output["logits"] = None
        output["loss"] = total

    def chunked(self, hidden: torch.Tensor, labels: torch.Tensor, shift_labels: torch.Tensor | None,
                count: Any) -> torch.Tensor:
        """The loss of ``hidden`` ``[B, s, H]`` (the final hidden states) in chunks of :attr:`chunk` positions.

        ``labels``/``shift_labels`` ``[B, s]`` and ``count`` (``num_items_in_batch``) as the model's
        ``loss_function`` takes them; each chunk runs under non-reentrant checkpointing. Returns the sum of the
        chunks' values (a scalar): the model's loss on these positions.
        """
        total: torch.Tensor | None = None
        for at in range(0, hidden.shape[1], self.chunk):
            n = min(self.chunk, hidden.shape[1] - at)
            part = checkpoint(self._chunk_loss, hidden.narrow(1, at, n), labels.narrow(1, at, n).contiguous(),
                              shift_labels.narrow(1, at, n).contiguous() if shift_labels is not None else None,
                              count, use_reentrant=False)
            total = part if total is None else total + part  # type: ignore[operator]
        assert total is not None, "a sequence of at least one position"
        return total
