"""Batches of a training stack on a tplower mesh: cut over ``dp`` where they are loaded, over ``cp`` where the model
takes them, counted over the whole global batch, and predictions made whole.

* :func:`dp_data_loader`: accelerate's own ``prepare_data_loader`` (the public function, the sampler and RNG
  handling it gives every process) told the data-parallel degree and coordinate instead of the world's: each
  ``dp`` rank reads its own micro-batches, every rank of one tp/cp group the same ones. Batches are read on
  every rank (never dispatched from rank 0, which would slice them per process).
* :class:`SequenceSplit`: a forward pre-hook that passes a whole batch through :func:`tplower.shard_sequence`
  (padded, packed with ``position_ids``, TRL's padding-free batches alike), so a trainer's own code and its
  collators see the batch one process would; in evaluation the logits come back whole.
* :func:`global_count`: the number of label tokens a step's loss is divided by, summed over ``dp``, as one
  process counts its whole batch (transformers' ``num_items_in_batch``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..context.sequence import SPLIT_KEY, ContextSplit, gather_sequence, shard_sequence
from .layout import DataLayout

__all__ = ["SequenceSplit", "dp_data_loader", "global_count"]


def dp_data_loader(accelerator: Any, layout: DataLayout, data_loader: DataLoader[Any],
                   device_placement: bool | None = None,
                   slice_fn_for_dispatch: Callable[..., Any] | None = None) -> DataLoader[Any]:
    """``accelerator.prepare_data_loader(data_loader)`` with the ``dp`` axis as its processes.

    Args:
        accelerator: an ``accelerate.Accelerator`` (its batch, RNG and placement settings are used).
        layout: the mesh's :class:`~tplower.hf.layout.DataLayout`.
        data_loader: a plain ``DataLoader`` (one already prepared is returned as it is).
        device_placement: as ``Accelerator.prepare_data_loader``'s.
        slice_fn_for_dispatch: accepted for signature parity; batches are never dispatched.

    Returns:
        accelerate's ``DataLoaderShard`` over ``layout.dp_size`` processes, this rank reading
        ``layout.dp_rank``'s share (the sampler's order is synchronized from rank 0, as accelerate does).
    """
    from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard, prepare_data_loader

    prepared_already = isinstance(data_loader, (DataLoaderShard, DataLoaderDispatcher))
    if prepared_already:
        return data_loader
    if device_placement is None:
        device_placement = bool(accelerator.device_placement)
    prepared: DataLoader[Any] = prepare_data_loader(
        data_loader, accelerator.device, num_processes=layout.dp_size, process_index=layout.dp_rank,
        split_batches=accelerator.split_batches, put_on_device=device_placement,
        rng_types=list(accelerator.rng_types), dispatch_batches=False, even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler, data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking, use_stateful_dataloader=accelerator.use_stateful_dataloader)
    return prepared


def global_count(local: torch.Tensor | int | None, layout: DataLayout) -> torch.Tensor | None:
    """The label tokens of the whole global batch: ``local`` (this dp rank's micro-batches) summed over ``dp``.

    Returns:
        A 0-d ``int64`` tensor, the same on every rank; ``None`` when ``local`` is (the loss takes no count).
    """
    if local is None:
        return None
    count = torch.as_tensor(local).detach().to(torch.int64).reshape(())
    return layout.sum_over(count, (layout.dp,) if layout.dp else ())


def _split(kwargs: Mapping[str, Any], layout: DataLayout) -> dict[str, Any]:
    """``kwargs`` through :func:`tplower.shard_sequence` over ``cp`` (a given ``num_items_in_batch`` is kept);
    labels the collator shifted already (``shift_labels``) are cut too, never shifted again."""
    assert layout.cp is not None
    out = shard_sequence(kwargs, layout.mesh, layout.cp)
    given = kwargs.get("shift_labels")
    if isinstance(given, torch.Tensor):
        split: ContextSplit = out[SPLIT_KEY]
        out["labels"] = out["shift_labels"] = given.index_select(1, split.local_index.to(given.device))
    return out


class SequenceSplit:
    """Hooks on a model: a whole batch given as keywords is cut over ``cp`` before the model sees it, and in
    evaluation (``model.eval()``) the ``logits`` of such a call come back whole.

    The forward pre-hook cuts a call's keywords with :meth:`cut`; a call that carries ``context_split`` already
    (a batch :meth:`cut` or :func:`tplower.shard_sequence` made) or has no ``input_ids``/``inputs_embeds`` passes
    unchanged. It is registered first (``prepend``), so the context install's own pre-hook sees the cut batch.
    The forward hook gathers ``logits`` (:func:`tplower.gather_sequence`, collective over ``cp``) of the calls
    that carry the last batch :meth:`cut` made, in evaluation only: a training step keeps each rank's own rows
    (the loss is computed there; whole logits would cost ``cp`` times their memory). A batch the user cut with
    :func:`tplower.shard_sequence` is theirs: its logits stay pieces. :meth:`remove` takes both hooks off again.
    """

    def __init__(self, model: nn.Module, layout: DataLayout) -> None:
        if layout.cp is None:
            raise ValueError("SequenceSplit needs a layout with a context-parallel axis")
        self.layout = layout
        self.ours: ContextSplit | None = None
        self.handles = (model.register_forward_pre_hook(self.before, with_kwargs=True, prepend=True),
                        model.register_forward_hook(self.after, with_kwargs=True))

    def cut(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's piece of a whole ``batch`` (:func:`tplower.shard_sequence` over ``cp``), remembered as this
        splitter's own (:meth:`after` makes the logits of calls with it whole in evaluation); ``batch`` itself
        (the same object) when it carries ``context_split`` already or has no ``input_ids``/``inputs_embeds``.
        Collective over ``cp`` when it cuts."""
        if SPLIT_KEY in batch or not any(isinstance(batch.get(k), torch.Tensor)
                                         for k in ("input_ids", "inputs_embeds")):
            return batch
        out = _split(batch, self.layout)
        self.ours = out[SPLIT_KEY]
        return out

    def before(self, module: nn.Module, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The pre-hook: ``kwargs`` through :meth:`cut` (see the class docstring)."""
        return args, self.cut(kwargs)

    def after(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        """The hook: in evaluation, ``output["logits"]`` whole over ``cp`` for a call with :meth:`cut`'s last batch."""
        ours = self.ours
        if ours is None or kwargs.get(SPLIT_KEY) is not ours or module.training:
            return output
        logits = output.get("logits") if isinstance(output, MutableMapping) else None
        if isinstance(logits, torch.Tensor) and logits.dim() >= 2:
            assert self.layout.cp is not None
            output["logits"] = gather_sequence(logits, self.layout.mesh, self.layout.cp, dim=1, split=ours)
        return output

    def remove(self) -> None:
        """Take both hooks off the model."""
        for handle in self.handles:
            handle.remove()
