"""Batches of a training stack on a tplower mesh: cut over ``dp`` where they are loaded, over ``cp`` where the model
takes them, counted over the whole global batch, and predictions made whole.

* :func:`dp_data_loader`: accelerate's own ``prepare_data_loader`` (the public function, the sampler and RNG
  handling it gives every process) told the data-parallel degree and coordinate instead of the world's: each
  ``dp`` rank reads its own micro-batches, every rank of one tp/cp group the same ones. Batches are read on
  every rank (never dispatched from rank 0, which would slice them per process). A trainer's training batches
  come in :class:`Rounds` (``examples=True``; :class:`_Stream` for an iterable dataset): one process's
  micro-batch cut into ``dp`` parts, the last one too, each batch tagged with its share of its round
  (:data:`EXAMPLES_KEY`), where accelerate would repeat rows to even out the last round.
* :class:`SequenceSplit`: a forward pre-hook that passes a whole batch through :func:`tplower.shard_sequence`
  (padded, packed with ``position_ids``, TRL's padding-free batches alike), so a trainer's own code and its
  collators see the batch one process would; in evaluation the logits come back whole.
* :func:`global_count`: the number of label tokens a step's loss is divided by, summed over ``dp``, as one
  process counts its whole batch (transformers' ``num_items_in_batch``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset

from ..context.sequence import SPLIT_KEY, ContextSplit, gather_sequence, shard_sequence
from .layout import DataLayout

__all__ = ["EXAMPLES_KEY", "Rounds", "SequenceSplit", "Share", "dp_data_loader", "global_count", "share_of"]

#: the key under which a training batch of :class:`Rounds` carries its :class:`Share` from the sampler to the loss
EXAMPLES_KEY = "tplower_share"


@dataclass(frozen=True)
class Share:
    """A micro-batch's part of one process's micro-batch (its *round*).

    Attributes:
        mine: the examples of the round in this rank's micro-batch; 0 for a stand-in (a rank the round left
            without an example reads one of the round's rows so that it still takes part in every collective;
            its loss counts for nothing).
        whole: the examples in the round, over every ``dp`` rank (one process's micro-batch).
    """

    mine: int
    whole: int


class _Example(int):
    """A dataset index with the :class:`Share` of the micro-batch it is read into."""

    share: Share

    def __new__(cls, index: int, share: Share) -> _Example:
        out = super().__new__(cls, index)
        out.share = share
        return out

    def __reduce__(self) -> tuple[Any, ...]:  # to a DataLoader worker and back
        return (_Example, (int(self), self.share))


def _cut(n: int, dp: int) -> list[tuple[int, int]]:
    """``(start, size)`` of each of ``dp`` parts of ``n`` items, in order: equal parts when ``dp`` divides ``n``,
    else ``torch.tensor_split``'s (the first ``n % dp`` parts one item more)."""
    out, start = [], 0
    for r in range(dp):
        size = n // dp + (r < n % dp)
        out.append((start, size))
        start += size
    return out


class Rounds(BatchSampler):
    """One process's micro-batches, each yielded as ``dp`` parts in turn: part ``r`` is ``dp`` rank ``r``'s.

    A full micro-batch of ``dp * b`` examples gives rank ``r`` examples ``[r * b, (r + 1) * b)``, as accelerate's
    ``BatchSamplerShard`` does; a short one (the last) is cut as ``torch.tensor_split`` cuts, and a rank it leaves
    without an example gets a stand-in (the micro-batch's first example, its :attr:`Share.mine` 0). No example is
    read twice as a real one, none is left out. Every index is an int that carries its part's :class:`Share`
    (read by :class:`Tagged`).

    Args:
        batches: one process's batch sampler (a ``BatchSampler`` of ``dp * b``, or a trainer's own batch sampler
            made as for one process).
        dp: the ``dp`` degree (1 or more).
    """

    def __init__(self, batches: Iterable[list[int]], dp: int) -> None:
        if dp < 1:
            raise ValueError(f"Rounds: dp={dp} must be at least 1")
        self.batches, self.dp = batches, dp
        self.drop_last = bool(getattr(batches, "drop_last", False))
        # parts differ in size in the last round: accelerate's shard reads no batch size and evens nothing out
        self.batch_size = None  # type: ignore[assignment]

    @property  # type: ignore[override]
    def sampler(self) -> Any:
        """The examples' order: one process's sampler (accelerate replaces it with its seedable copy)."""
        return getattr(self.batches, "sampler", None)

    @sampler.setter
    def sampler(self, value: Any) -> None:
        if hasattr(self.batches, "sampler"):
            self.batches.sampler = value  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches:
            round_ = [int(i) for i in batch]
            n = len(round_)
            for start, size in _cut(n, self.dp):
                if size == 0:
                    yield [_Example(round_[0], Share(0, n))]
                else:
                    share = Share(size, n)
                    yield [_Example(i, share) for i in round_[start:start + size]]

    def __len__(self) -> int:
        return len(self.batches) * self.dp  # type: ignore[arg-type]


class _Stream(IterableDataset[Any]):
    """This ``dp`` rank's part of an iterable ``dataset``: its items read in rounds of ``dp * batch_size`` (one
    process's micro-batch), each cut as :class:`Rounds` cuts, each item with its part's :class:`Share`.

    Every rank reads the whole stream (in a ``DataLoader`` worker, the worker's own stream, as one process's
    worker reads it), so every rank makes one batch of each round.
    """

    def __init__(self, dataset: Any, batch_size: int, dp: int, rank: int, drop_last: bool) -> None:
        self.dataset, self.per_rank, self.dp, self.rank, self.drop_last = dataset, batch_size, dp, rank, drop_last

    def _mine(self, round_: list[Any]) -> Iterator[tuple[Any, Share]]:
        start, size = _cut(len(round_), self.dp)[self.rank]
        if size == 0:
            yield round_[0], Share(0, len(round_))
        for row in round_[start:start + size]:
            yield row, Share(size, len(round_))

    def __iter__(self) -> Iterator[tuple[Any, Share]]:
        round_: list[Any] = []
        for row in self.dataset:
            round_.append(row)
            if len(round_) == self.per_rank * self.dp:
                yield from self._mine(round_)
                round_ = []
        if round_ and not self.drop_last:
            yield from self._mine(round_)


class _Examples(Dataset[Any]):
    """``dataset`` read by :class:`Rounds`' indices: each row comes back with its part's :class:`Share`."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, Share | None]:
        return self.dataset[int(index)], getattr(index, "share", None)

    def __getitems__(self, indices: list[int]) -> list[tuple[Any, Share | None]]:
        many = getattr(self.dataset, "__getitems__", None)
        rows = many([int(i) for i in indices]) if many else [self.dataset[int(i)] for i in indices]
        return [(row, getattr(i, "share", None)) for row, i in zip(rows, indices, strict=True)]

    def __getattr__(self, name: str) -> Any:  # a trainer reading the dataset's own attributes finds them
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class Tagged:
    """A collate function: ``collate`` over the rows alone, the batch tagged with their :class:`Share` under
    :data:`EXAMPLES_KEY` (a batch that is not a mapping is returned untagged)."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, items: list[tuple[Any, Share | None]]) -> Any:
        batch = self.collate([row for row, _ in items])
        share = items[0][1] if items else None
        if share is not None and isinstance(batch, MutableMapping):
            batch[EXAMPLES_KEY] = share
        return batch


def share_of(batch: Any) -> Share | None:
    """Take a batch's :class:`Share` out of it (``None`` when it has none); the batch no longer carries it."""
    if isinstance(batch, MutableMapping):
        share = batch.pop(EXAMPLES_KEY, None)
        return share if isinstance(share, Share) else None
    return None


def _in_rounds(data_loader: DataLoader[Any], layout: DataLayout) -> tuple[DataLoader[Any], bool] | None:
    """``data_loader`` over this rank's parts of one process's micro-batches, and whether it is cut already (an
    iterable dataset: accelerate must not cut it again); ``None`` where its batches are not a kind it knows."""
    dp = layout.dp_size
    common: dict[str, Any] = dict(
        collate_fn=Tagged(data_loader.collate_fn), num_workers=data_loader.num_workers,
        pin_memory=data_loader.pin_memory, timeout=data_loader.timeout, worker_init_fn=data_loader.worker_init_fn,
        multiprocessing_context=data_loader.multiprocessing_context, generator=data_loader.generator,
        prefetch_factor=data_loader.prefetch_factor, persistent_workers=data_loader.persistent_workers,
        in_order=data_loader.in_order)
    if isinstance(data_loader.dataset, IterableDataset):
        if data_loader.batch_size is None:
            return None
        stream = _Stream(data_loader.dataset, data_loader.batch_size, dp, layout.dp_rank, data_loader.drop_last)
        return DataLoader(stream, batch_size=data_loader.batch_size, **common), True
    batches = data_loader.batch_sampler
    if batches is None:
        return None
    if type(batches) is BatchSampler:  # one process's: dp times the batch, over the same order
        batches = BatchSampler(batches.sampler, batches.batch_size * dp, batches.drop_last)
    return DataLoader(_Examples(data_loader.dataset), batch_sampler=Rounds(batches, dp), **common), False


def dp_data_loader(accelerator: Any, layout: DataLayout, data_loader: DataLoader[Any],
                   device_placement: bool | None = None,
                   slice_fn_for_dispatch: Callable[..., Any] | None = None, *,
                   examples: bool = False) -> DataLoader[Any]:
    """``accelerator.prepare_data_loader(data_loader)`` with the ``dp`` axis as its processes.

    Args:
        accelerator: an ``accelerate.Accelerator`` (its batch, RNG and placement settings are used).
        layout: the mesh's :class:`~tplower.hf.layout.DataLayout`.
        data_loader: a plain ``DataLoader`` (one already prepared is returned as it is).
        device_placement: as ``Accelerator.prepare_data_loader``'s.
        slice_fn_for_dispatch: accepted for signature parity; batches are never dispatched.
        examples: read the batches as one process's micro-batches cut into ``dp`` parts (a trainer's training
            batches, its sampler made as for one process: :class:`Rounds` over a map-style dataset, the stream
            of an iterable one cut alike; the last, short micro-batch cut over the ranks, not evened out by
            repeated rows; each batch tagged with its :class:`Share`); else accelerate's own sharding (the last
            batch evened out by repeating rows, as accelerate does for evaluation).

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
    even, processes, index = accelerator.even_batches, layout.dp_size, layout.dp_rank
    if examples and layout.dp_size > 1 and not accelerator.split_batches:
        rounds = _in_rounds(data_loader, layout)
        if rounds is None:
            warnings.warn("tplower: this training DataLoader's batches are neither a BatchSampler's nor an "
                          "iterable dataset's; accelerate cuts them over dp and fills a short last batch with "
                          "repeated rows, which that step weighs as well, unlike one process", stacklevel=2)
        else:
            data_loader, even = rounds[0], False
            processes, index = (1, 0) if rounds[1] else (processes, index)
    prepared: DataLoader[Any] = prepare_data_loader(
        data_loader, accelerator.device, num_processes=processes, process_index=index,
        split_batches=accelerator.split_batches, put_on_device=device_placement,
        rng_types=list(accelerator.rng_types), dispatch_batches=False, even_batches=even,
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
