"""Calls a parallelized model cannot answer rightly, refused (or warned of) before its forward runs.

:func:`tplower.parallelize` puts one forward pre-hook on the model
(:func:`install_call_checks`, ahead of every other hook, so before any
collective, on every rank alike: each check reads only the call's own
keywords and what ``parallelize`` decided):

* a batch part from :func:`tplower.shard_sequence` (its ``context_split``)
  given to a model parallelized without context parallelism: each rank would
  run its own tokens as if they were the whole sequence (a wrong loss, no
  error). Refused, naming ``parallelize(..., context=axis)``.
* ``labels`` given to a model whose plan leaves the logits sharded (e.g.
  ``lm_head: colwise``, the vocabulary split over tp): the model's own loss
  reads the local logits as whole rows and transformers ends in a batch-size
  mismatch. Refused, naming :func:`tplower.vocab_parallel_cross_entropy` and
  ``colwise_gather_output``.
* packed documents (position ids that restart, no ``attention_mask``) run
  with a KV cache (``use_cache`` on, the config's default): transformers then
  does not look for the documents and they attend across each other, in one
  process as in tensor parallelism, while context parallelism always gives
  each its own attention. Warned of, naming ``use_cache=False``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Shard

from ..context.install import _accepts, installed_context
from ..context.sequence import SPLIT_KEY, ContextSplit
from ..core.support.errors import TPLowerError
from .resolve import ResolvedPlan

__all__ = ["install_call_checks", "packed_documents", "sharded_logits"]

#: the keywords a transformers model computes its own loss from
_LABELS = ("labels", "shift_labels")


def sharded_logits(model: nn.Module, resolved: ResolvedPlan) -> tuple[str, str, int] | None:
    """``(module, axis, dim)`` where the plan leaves the model's output embeddings' output (its logits) sharded on
    ``dim`` over ``axis``; ``None`` when the logits come out whole (or the model names no output embeddings)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module):
        return None
    qual = next((q for q, m in model.named_modules() if m is head), None)
    for mp in resolved:
        if mp.qual != qual:
            continue
        for op in mp.form.outputs:
            for name, p in zip(resolved.names, op.dst, strict=False):
                if isinstance(p, Shard):
                    return mp.qual, name, p.dim
    return None


def packed_documents(kwargs: dict[str, Any]) -> bool:
    """Whether a call's ``position_ids`` hold packed documents (a position that does not follow the one before)
    with no ``attention_mask``: the rule by which transformers looks for documents (without a cache)."""
    positions = kwargs.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[1] < 2:
        return False
    if kwargs.get("attention_mask") is not None:
        return False
    return bool((positions.diff(dim=1) != 1).any())


def _cache_on(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether the model will hold a KV cache in this call: a cache given, ``use_cache`` given true, or not given
    and the config's ``use_cache`` on (transformers' default)."""
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        return True
    use = kwargs.get("use_cache")
    if use is None:
        use = getattr(getattr(model, "config", None), "use_cache", False)
    return bool(use)


class _CallChecks:
    """The model's forward pre-hook: the refusals and the warning of the module docstring.

    Attributes:
        logits: :func:`sharded_logits` of the model, or ``None``.
        context: the context-parallel axis installed on the model, or ``None``.
        caches: the model's forward takes ``use_cache`` (a decoder that may hold a KV cache).
    """

    def __init__(self, logits: tuple[str, str, int] | None, context: str | None, caches: bool) -> None:
        self.logits, self.context, self.caches = logits, context, caches

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        split = kwargs.get(SPLIT_KEY)
        if self.context is None and isinstance(split, ContextSplit):
            raise TPLowerError(
                f"{type(module).__name__} was parallelized without context parallelism, but is called with a batch "
                f"part that shard_sequence cut over axis {split.axis!r} ({split.layout.size} ranks): each rank would "
                "run its own tokens as the whole sequence (a wrong loss); parallelize it with "
                f"context={split.axis!r} (tplower.parallelize(model, mesh, plan, context={split.axis!r})), or call "
                "it with the whole batch")
        if self.logits is not None and any(kwargs.get(k) is not None for k in _LABELS):
            raise TPLowerError(self._labels_message(type(module).__name__))
        if self.context is None and self.caches and not torch.compiler.is_compiling() \
                and _cache_on(module, kwargs) and packed_documents(kwargs):
            warnings.warn(f"tplower: {type(module).__name__} runs packed documents (position_ids that restart, no "
                          "attention_mask) with a KV cache (use_cache on, the config's default): transformers then "
                          "lets each document attend to the ones before it, in one process too, while context "
                          "parallelism always gives each document its own attention; pass use_cache=False to train "
                          "on packed documents", stacklevel=2)

    def _labels_message(self, owner: str) -> str:
        assert self.logits is not None
        qual, axis, dim = self.logits
        if self.context is not None:
            call = (f"vocab_parallel_cross_entropy(out.logits, part['labels'], mesh, axis={axis!r}, "
                    f"context={self.context!r}, num_items_in_batch=part['num_items_in_batch']) (shard_sequence's "
                    "labels, shifted already)")
        else:
            call = (f"vocab_parallel_cross_entropy(out.logits[:, :-1], labels[:, 1:], mesh, axis={axis!r}) (a "
                    "causal LM's labels shifted by one)")
        return (f"{owner}: the plan leaves the logits of {qual!r} sharded over {axis!r} (dim {dim}: this rank's piece "
                "of the vocabulary), which the model's own loss from labels cannot read; call the model without labels "
                f"and take the loss with tplower.{call}, or plan {qual!r} as 'colwise_gather_output' (whole logits)")


def install_call_checks(model: nn.Module, resolved: ResolvedPlan) -> None:
    """Put the checks of the module docstring on ``model`` as a forward pre-hook that runs before every other."""
    record = installed_context(model)
    hook = _CallChecks(sharded_logits(model, resolved), record.axis if record is not None else None,
                       _accepts(model, "use_cache"))
    model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
