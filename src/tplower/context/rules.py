"""Rules a model applies to the whole sequence, kept whole under context parallelism (or refused, naming them).

One process runs a few model-specific rules over the whole sequence that a
rank holding a piece of it would apply to that piece alone. Each is made
one process's here, or refused before any collective:

* **The head's labels** (:func:`head_kind`): a causal LM scores each token
  against the next token's label (``shard_sequence`` shifts the labels over
  the whole sequence before the cut); a masked LM or a token classifier
  scores each token against its own label (cut as they are:
  ``shift_labels=False``). The kind is read from transformers' own auto
  mappings (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, ``..._MASKED_LM_...``,
  ``..._TOKEN_CLASSIFICATION_...``) by the model's class or the outermost
  module whose class they name (a PEFT wrapper's model); the model's forward
  pre-hook refuses a batch whose labels were cut the other way.
* **The loss of a token head** (:func:`token_loss`): BERT's, RoBERTa's and
  ModernBERT's heads take the mean of their own tokens' losses; a rank's
  mean is weighted by its share of the whole batch's labels before the sum
  over the axis.
* **Sequence-level heads and encoder-decoder models are refused**: a
  classifier or a question-answering head pools or indexes the whole
  sequence (a rank would pool its piece's first token), and an
  encoder-decoder's cross-attention reads another sequence. A base model's
  pooler (BERT's ``pooler_output``, the first token through a dense layer)
  returns ``None`` under context parallelism, as a model built without one.
* **Positions a model numbers itself** (:class:`OwnPositions`): without
  ``position_ids`` ``shard_sequence`` numbers the tokens ``0 .. S-1``, as
  most models do (``cache_position``). RoBERTa's family numbers them from
  the pad token (``create_position_ids_from_input_ids`` of its embeddings):
  that function is run on the whole batch's ids and each rank takes its
  tokens' positions. A model whose forward numbers them from the padding
  mask (a ``cumsum``: OPT, BioGPT) matches ``0 .. S-1`` without padding; a
  padded batch without ``position_ids`` is refused for it.
* **Rope whose frequencies follow the sequence length**
  (:class:`WholeLengthRope`): transformers' ``dynamic`` (NTK) and ``longrope``
  (Phi-3) rotary modules pick their frequencies from ``max(position_ids) + 1``
  of the call (``dynamic_rope_update``); each rank passes its own positions,
  so the rotary module is given one more position, the whole batch's
  largest, and its output row for it is dropped again.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from ..core.support.errors import TPLowerError
from .discover import _in_scope, text_config
from .sequence import SPLIT_KEY, ContextSplit

__all__ = ["CAUSAL", "TOKEN", "ModelRules", "OwnPositions", "PooledOutput", "WholeLengthRope", "check_labels",
           "head_kind", "length_rope_modules", "poolers", "token_loss"]

#: head kinds: next-token labels (shifted over the whole sequence) and one label per token (cut as they are)
CAUSAL, TOKEN = "causal", "token"
#: transformers' auto mappings (``MODEL_FOR_<name>_MAPPING_NAMES``) of token-level heads and the kind of each
_TOKEN_HEADS = {"CAUSAL_LM": CAUSAL, "IMAGE_TEXT_TO_TEXT": CAUSAL, "MULTIMODAL_LM": CAUSAL, "MASKED_LM": TOKEN,
                "TOKEN_CLASSIFICATION": TOKEN}
#: heads that read the whole sequence at once, by mapping: why each is refused
_SEQUENCE_HEADS = {
    "SEQUENCE_CLASSIFICATION": "pools the sequence into one vector (its first or last token, or a mean)",
    "MULTIPLE_CHOICE": "pools each choice's sequence into one vector (its first token)",
    "QUESTION_ANSWERING": "picks answer start and end positions out of the whole sequence",
    "NEXT_SENTENCE_PREDICTION": "classifies the sequence pair from its pooled first token",
    "PRETRAINING": "combines heads, some over the whole sequence (BERT's next-sentence classifier on the pooled first "
                   "token)",
}


def _kinds() -> dict[str, str]:
    """Class name -> head kind (:data:`CAUSAL`, :data:`TOKEN`, ``"base"``, or why a sequence-level head is refused),
    from transformers' auto mappings."""
    from transformers.models.auto import modeling_auto

    out: dict[str, str] = {}
    base = {"TEXT_ENCODING": "base", "": "base"}  # models without a head (``""``: ``MODEL_MAPPING_NAMES``)
    for name, kind in (*_TOKEN_HEADS.items(), *_SEQUENCE_HEADS.items(), *base.items()):
        mapping = getattr(modeling_auto, f"MODEL_FOR_{name}_MAPPING_NAMES" if name else "MODEL_MAPPING_NAMES", {})
        for value in mapping.values():
            for cls in (value,) if isinstance(value, str) else value:
                out.setdefault(cls, kind)
    return out


def _known(model: nn.Module, kinds: Mapping[str, str]) -> tuple[type, str] | None:
    """The class that decides ``model``'s kind: its own (or a base class's), else the outermost module's that the
    mappings name (a wrapper's model)."""
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls.__name__ in kinds:
                return cls, kinds[cls.__name__]
    return None


def head_kind(model: nn.Module) -> str | None:
    """:data:`CAUSAL`, :data:`TOKEN`, or ``None`` (a model without a labelled head, or one transformers' auto
    mappings do not name), refusing what context parallelism cannot run as one process.

    Raises:
        TPLowerError: an encoder-decoder model (``config.is_encoder_decoder``:
            its cross-attention reads the encoder's whole sequence); a head
            that pools or indexes the whole sequence (sequence
            classification, multiple choice, question answering,
            next-sentence prediction), naming the class and the way out.
    """
    name = type(model).__name__
    for config in (getattr(model, "config", None), text_config(model)):
        if getattr(config, "is_encoder_decoder", False):
            raise TPLowerError(f"context parallelism: {name} is an encoder-decoder model "
                               "(config.is_encoder_decoder=True): its decoder's cross-attention reads the encoder's "
                               "states of another sequence, which context parallelism does not split or exchange; "
                               "train it without context= (tensor or data parallelism)")
    found = _known(model, _kinds())
    if found is None:
        return None
    cls, kind = found
    if kind not in (CAUSAL, TOKEN, "base"):
        head = name if cls is type(model) else f"{name} (a {cls.__name__})"
        raise TPLowerError(f"context parallelism: {head} has a sequence-level head: it {kind}, and under context "
                           "parallelism each rank holds a piece of the sequence; parallelize its base model (or a "
                           "token-level head: causal LM, masked LM, token classification) and pool "
                           "tplower.gather_sequence(hidden, mesh) yourself")
    return None if kind == "base" else kind


def check_labels(model: nn.Module, kind: str | None, split: ContextSplit, axis: str) -> None:
    """Refuse labels cut for the other kind of head (alike on every rank: the split is the same on each)."""
    if kind is None or split.shifted is None or split.shifted == (kind == CAUSAL):
        return
    name = type(model).__name__
    if kind == CAUSAL:
        raise TPLowerError(f"{name} is a causal LM: each token predicts the next token's label, but "
                           "shard_sequence cut the labels unshifted (shift_labels=False); call "
                           f"shard_sequence(batch, mesh, {axis!r}) (shift_labels=True, the default)")
    raise TPLowerError(f"{name} scores each token against its own label (a masked LM or token classifier), but "
                       "shard_sequence shifted the labels as next-token targets; call "
                       f"shard_sequence(batch, mesh, {axis!r}, shift_labels=False)")


def token_loss(loss: torch.Tensor, labels: torch.Tensor, count: Any) -> torch.Tensor:
    """This rank's part of a token head's whole loss: its mean over its ``n`` labels (``!= -100``, as
    ``CrossEntropyLoss`` counts them) times ``n / count``; ``0`` where the rank holds no label (its mean is
    ``nan``, and its gradient an exact zero). Summed over the axis: the whole batch's mean (or the sum over
    ``count``, a given ``num_items_in_batch``)."""
    n = (labels != -100).sum()
    share = loss * n.to(loss.dtype) / torch.as_tensor(count, dtype=loss.dtype, device=loss.device)
    return torch.where(n > 0, share, torch.zeros((), dtype=loss.dtype, device=loss.device))


def _length_dependent(rope_type: Any) -> bool:
    """transformers' ``dynamic_rope_update`` condition: a ``*dynamic*`` or ``longrope`` type (per layer type too)."""
    types = rope_type.values() if isinstance(rope_type, Mapping) else (rope_type,)
    return any(isinstance(t, str) and ("dynamic" in t or t == "longrope") for t in types)


def length_rope_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The rotary modules of ``model``'s text decoder whose frequencies follow the sequence length."""
    for path, module in _in_scope(model):
        if _length_dependent(getattr(module, "rope_type", None)) and \
                any(name.endswith("inv_freq") for name, _ in module.named_buffers(recurse=False)):
            yield path, module  # inv_freq, or one per layer type (Gemma 3's full_attention_inv_freq, ...)


class WholeLengthRope:
    """Forward hooks of a rotary module whose frequencies follow ``max(position_ids) + 1`` of its call.

    The pre-hook appends one position to the call's ``position_ids`` (last
    dim): the whole batch's largest (``ContextSplit.position_ids.max()``),
    so transformers' ``dynamic_rope_update`` picks the frequencies (and the
    ``attention_scaling``) one process picks for the whole sequence, and
    its cached state moves as one process's does; the forward hook drops the
    appended row of ``cos`` and ``sin`` (``[..., s + 1, D] -> [..., s, D]``).
    Each kept row depends on its own position only, so it is one process's.

    Args:
        live: the installed model's running batch (``{"context_split": split}`` during its forward).
        path: the module's path, for messages.
    """

    def __init__(self, live: dict[str, Any], path: str) -> None:
        self.live, self.path = live, path

    def before(self, module: nn.Module, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        split = self.live.get(SPLIT_KEY)
        if not isinstance(split, ContextSplit):
            return None
        where = "position_ids" if "position_ids" in kwargs else 1
        positions = kwargs.get("position_ids") if where == "position_ids" else \
            (args[1] if len(args) > 1 else None)
        if not isinstance(positions, torch.Tensor):
            raise TPLowerError(f"context parallelism: {self.path} ({type(module).__name__}) picks its rope "
                               f"frequencies from the sequence length (rope_type {module.rope_type!r}) but was "
                               "called without position_ids to give the whole sequence's length to; train it "
                               "without context=, or with a rope_type that does not depend on the length")
        top = split.position_ids.max().to(positions.device, positions.dtype)
        longer = torch.cat([positions, top.expand(*positions.shape[:-1], 1)], dim=-1)
        if where == "position_ids":
            return args, {**kwargs, "position_ids": longer}
        return (args[0], longer, *args[2:]), kwargs

    def after(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if not isinstance(self.live.get(SPLIT_KEY), ContextSplit):
            return output

        def drop(t: Any) -> Any:
            return t.narrow(-2, 0, t.shape[-2] - 1) if isinstance(t, torch.Tensor) else t

        return tuple(drop(t) for t in output) if isinstance(output, tuple) else drop(output)


def _numbers_from_mask(cls: type) -> bool:
    """Whether ``cls.forward`` takes ``position_ids`` and ``attention_mask`` and calls ``cumsum`` (it numbers the
    tokens from the padding mask when no positions are given)."""
    code = getattr(inspect.unwrap(getattr(cls, "forward", None) or (lambda: None)), "__code__", None)
    if code is None:
        return False
    params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return "cumsum" in code.co_names and "position_ids" in params and "attention_mask" in params


class OwnPositions:
    """The whole sequence's positions for a model that numbers its tokens itself when none are given.

    Args:
        model: the model being installed; its text decoder's modules are read once.
    """

    def __init__(self, model: nn.Module) -> None:
        self.from_ids: Any = None  # the module whose create_position_ids_from_input_ids numbers the tokens
        self.from_mask: str | None = None
        for path, module in _in_scope(model):
            if self.from_ids is None and callable(getattr(module, "create_position_ids_from_input_ids", None)) \
                    and isinstance(getattr(module, "padding_idx", None), int):
                self.from_ids = module
            if self.from_mask is None and _numbers_from_mask(type(module)):
                self.from_mask = f"{path or 'the model'} ({type(module).__name__})"

    def __call__(self, model: nn.Module, kwargs: dict[str, Any], split: ContextSplit) -> dict[str, Any]:
        """``kwargs`` with this rank's part of the model's own positions of the whole batch, where it has them.

        Raises:
            TPLowerError: a padded batch without ``position_ids`` for a model
                that numbers its tokens from the padding mask (alike on every
                rank: the split is the same on each).
        """
        if split.given_positions:
            return kwargs
        m = self.from_ids
        if m is not None:
            b, s = split.position_ids.shape
            whole = m.create_position_ids_from_input_ids(split.input_ids, m.padding_idx) \
                if split.input_ids is not None else \
                m.create_position_ids_from_inputs_embeds(split.position_ids.new_empty((b, s, 0)), m.padding_idx)
            index = split.local_index.to(split.position_ids.device)
            return {**kwargs, "position_ids": whole.to(split.position_ids.device).index_select(1, index)}
        mask = split.attention_mask
        if self.from_mask is not None and mask is not None and not bool(mask.all()):
            raise TPLowerError(f"{type(model).__name__}: {self.from_mask} numbers the tokens from the padding mask "
                               "when no position_ids are given, and a rank holds a piece of it; pass the whole "
                               "batch's position_ids to shard_sequence (as one process numbers them, e.g. "
                               "attention_mask.cumsum(1) - 1 where the mask is 1)")
        return kwargs


class PooledOutput:
    """A pooler's forward hook and what the model's forward hook makes of it: no pooled output.

    The pooler reads the sequence's first token, which under context
    parallelism is each rank's piece's first token; its output (BERT's
    ``pooler_output``) is replaced by ``None`` in the model's outputs, as a
    model built without a pooler (``add_pooling_layer=False``) returns.
    """

    KEY = "pooled"

    def __init__(self, live: dict[str, Any]) -> None:
        self.live = live

    def seen(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.live[self.KEY] = output

    @staticmethod
    def drop(output: Any, pooled: Any) -> Any:
        """``output`` with the entry that is ``pooled`` (by identity) set to ``None``."""
        if pooled is None:
            return output
        if isinstance(output, MutableMapping):
            for key in [k for k, v in output.items() if v is pooled]:
                output[key] = None
            return output
        if isinstance(output, tuple):
            return tuple(None if x is pooled else x for x in output)
        return output


def poolers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The modules of ``model``'s text decoder that a base model keeps as its ``pooler``."""
    for path, module in _in_scope(model):
        if path == "pooler" or path.endswith(".pooler"):
            yield path, module


class ModelRules:
    """The rules of one installed model, applied by its forward hooks (:mod:`tplower.context.install`).

    Args:
        model: the model being installed (its head's kind and its own position numbering are read once).
        live: the model's running batch, shared with its attention modules (``{"context_split": split}`` during
            its forward; the rules leave a token head's count and a pooler's output there for the forward hook).
        axis: the context-parallel axis, for messages.

    Raises:
        TPLowerError: an encoder-decoder model or a sequence-level head (:func:`head_kind`).
    """

    COUNT = "num_items_in_batch"

    def __init__(self, model: nn.Module, live: dict[str, Any], axis: str) -> None:
        self.kind, self.positions, self.live, self.axis = head_kind(model), OwnPositions(model), live, axis

    def hooks(self, model: nn.Module) -> list[Any]:
        """Register the module hooks: rope given the whole sequence's length, poolers' outputs dropped."""
        handles = []
        for path, m in length_rope_modules(model):
            rope = WholeLengthRope(self.live, path)
            handles += [m.register_forward_pre_hook(rope.before, with_kwargs=True),
                        m.register_forward_hook(rope.after, with_kwargs=True)]
        pooled = PooledOutput(self.live)
        return handles + [m.register_forward_hook(pooled.seen) for _, m in poolers(model)]

    def before(self, model: nn.Module, kwargs: dict[str, Any], split: ContextSplit) -> dict[str, Any]:
        """The model's call as its rules take it (before any collective; alike on every rank).

        Raises:
            TPLowerError: ``encoder_hidden_states`` given; labels cut for the other kind of head
                (:func:`check_labels`); a padded batch without positions for a model that numbers them from
                the mask (:class:`OwnPositions`); a token head's labels without ``num_items_in_batch``.
        """
        name = type(model).__name__
        if kwargs.get("encoder_hidden_states") is not None:
            raise TPLowerError(f"{name}: encoder_hidden_states given: cross-attention reads another sequence, which "
                               "context parallelism does not split or exchange; call it without encoder states, or "
                               "train it without context=")
        check_labels(model, self.kind, split, self.axis)
        kwargs = self.positions(model, kwargs, split)
        if self.kind == TOKEN and kwargs.get("labels") is not None:  # the head's own mean, weighted after it
            if kwargs.get(self.COUNT) is None:
                raise TPLowerError(f"{name}: labels without num_items_in_batch; call it with every entry of "
                                   f"shard_sequence(batch, mesh, {self.axis!r}, shift_labels=False)")
            self.live[self.COUNT] = kwargs[self.COUNT]
            kwargs = {k: v for k, v in kwargs.items() if k != self.COUNT}
        return kwargs

    def after(self, output: Any, labels: Any) -> tuple[Any, Callable[[torch.Tensor], torch.Tensor] | None]:
        """The model's outputs without a pooled first token, and what makes a token head's loss this rank's part
        of the whole mean (``None``: the loss already is)."""
        output = PooledOutput.drop(output, self.live.get(PooledOutput.KEY))
        count = self.live.get(self.COUNT)
        if count is None or not isinstance(labels, torch.Tensor):
            return output, None
        return output, lambda loss: token_loss(loss, labels, count)
