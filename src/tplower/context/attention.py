"""Attention over a sequence split on a context-parallel axis: two transitions around the model's own kernel.

A parallelized model's config names ``"tplower_context"`` as its attention
implementation (transformers' ``AttentionInterface``, per model: no other
model in the process changes), so every attention layer calls
:func:`context_attention` with its rotated query, key and value of this rank's
tokens. That function reads the layer's :class:`ContextAttention` (attached to
the attention module when it was parallelized) and the batch's
:class:`~tplower.context.sequence.ContextSplit`, exchanges, and calls the
implementation the model had (``eager``, ``sdpa``, ...) unchanged:

* ``ulysses``: ``[B, H, s, D]`` ``S(seq) -> S(heads)`` (an ``all_to_all``: every
  rank gets ``H/n`` heads of the whole sequence), attention over the whole
  sequence in its own order, then the output ``S(heads) -> S(seq)`` back;
* ``allgather``: key and value ``S(seq) -> R`` (an ``all_gather``; their
  gradient, partial over the ranks' queries, is reduce-scattered back), the
  local queries attend to the whole sequence;
* ``hybrid``: Ulysses inside groups of the axis, all-gather across them
  (:mod:`tplower.context.exchange`); a layer with a dense mask runs the
  all-gather mode over the whole axis.

Pieces of uneven length are padded to the longest before the exchange and
the padding dropped after it. A causal ``sdpa`` layer takes no
whole-sequence mask: the batch's runs (:mod:`tplower.context.runs`: packed
documents, padding on either side) run the kernel once each, with no mask, or
with a sliding window in blocks of the window, each against the keys its
queries see with a band mask (:mod:`tplower.context.kernels`). Every other
layer's mask is transformers' own
for the whole sequence (``create_causal_mask`` or ``create_sliding_window_causal_mask``
with the batch's global ``attention_mask`` and ``position_ids``, so padding,
sliding windows and packed documents are as one process builds them; an
encoder's bidirectional attention, ``is_causal`` false, takes
``create_bidirectional_mask`` with the whole padding mask), built
once per batch and kind of layer; the all-gather mode takes the rows of its
queries. Packed documents (no ``attention_mask``, position ids restarting)
each get their own causal attention, as transformers gives them without a
cache; one process does not look for them when it holds a cache
(``use_cache`` on, the config's default outside training) or when the
model's forward builds its masks without the position ids (gpt-oss, afmoe).

Under ``torch.compile`` a batch with an ``attention_mask`` or ``position_ids``
takes the dense mask even where it has runs: the runs are Python numbers
whose count and kinds change with the layout, and a graph that read them
would recompile per layout, while transformers' mask functions build the
mask from the batch's tensors in the graph (one graph for every layout, an
``[B, 1, S, S]`` mask). A plain batch (neither) keeps its one causal run.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..core.support.errors import TPLowerError
from .exchange import allgather, hybrid, ulysses
from .runs import windowed
from .sequence import SPLIT_KEY, ContextSplit, traced_split

__all__ = ["ATTR", "IMPLEMENTATION", "MODES", "ContextAttention", "context_attention", "register"]

#: the attention implementation name a context-parallel model's config takes
IMPLEMENTATION = "tplower_context"
#: the attribute of an attention module that holds its :class:`ContextAttention`
ATTR = "_tplower_context"
MODES = ("ulysses", "allgather", "hybrid")


@dataclass(frozen=True, eq=False)
class ContextAttention:
    """How one attention module runs under context parallelism.

    Attributes:
        mesh: the device mesh; ``axis`` its context-parallel axis.
        axis: the axis name.
        mode: ``ulysses``, ``allgather`` or ``hybrid``.
        inner: the implementation the model had (``eager``, ``sdpa``, ...).
        kernel: its function (the model's own ``eager_attention_forward`` for ``eager``).
        config: the model's config as the inner implementation sees it (masks are built from it; one
            copy shared by the modules of one config, so one mask serves them all).
        per_head: names of the module's own parameters that may hold one entry per query head (e.g.
            gpt-oss's ``sinks``): under Ulysses the kernel sees rank ``r``'s slice of those whose leading
            dim is the local head count.
        causal: the module's ``is_causal`` (an encoder's bidirectional attention: ``False``).
        sub_mesh: the hybrid mode's mesh: ``axis`` split into the two axes
            :func:`~tplower.context.exchange.hybrid_axes` names (``None`` in the other modes).
        live: the batch the model is running now (``{"context_split": split}``, set by the model's forward
            pre-hook and emptied after its forward; one dict shared by the model's modules): read when a model's
            layer does not pass its keyword arguments down to attention.
    """

    mesh: DeviceMesh
    axis: str
    mode: str
    inner: str
    kernel: Callable[..., Any]
    config: Any
    per_head: tuple[str, ...] = ()
    live: dict[str, Any] = field(default_factory=dict)
    causal: bool = True
    sub_mesh: DeviceMesh | None = None


def inner_config(config: Any, inner: str) -> Any:
    """A shallow copy of ``config`` whose attention implementation reads ``inner`` (sub-configs untouched)."""
    mine = copy.copy(config)
    mine.__dict__["_attn_implementation_internal"] = inner
    return mine


def _mask(ca: ContextAttention, split: ContextSplit, like: torch.Tensor, window: Any) -> Any:
    """transformers' mask for this layer's kind, as this mode's kernel takes it (cached per batch).

    Ulysses: the mask one process builds for the whole sequence (the kernel
    sees the whole sequence in its own order, as one process does), so
    ``sdpa`` skips a plain causal mask (``None``, the kernel's ``is_causal``)
    exactly where one process skips it. All-gather: the rows of this rank's
    queries of the whole mask (never skipped: the queries are a slice); the
    whole mask is dropped once its rows are taken. A boolean mask becomes the
    additive mask ``sdpa`` would convert it to in every layer (``0``, and
    ``-inf`` where masked: the same values, made once a batch), which CPU
    ``sdpa`` runs on its flash path (a boolean one sends it to its math path,
    which holds every score). Only the masks that have no runs
    (:mod:`tplower.context.runs`) are built: sliding windows, encoders,
    ``eager``, padding with holes.
    """
    from transformers.masking_utils import (
        create_bidirectional_mask,
        create_bidirectional_sliding_window_mask,
        create_causal_mask,
        create_sliding_window_causal_mask,
    )

    key = (id(ca.config), window, ca.mode, ca.causal, like.dtype, like.device)
    if key not in split.cache:
        b, s = split.position_ids.shape[0], split.layout.length
        embeds = torch.empty((b, s, 1), dtype=like.dtype, device=like.device)
        # the layer's own window as its attention call passes it: a key within window - 1 positions of the query
        config = ca.config if window is None else _Windowed(ca.config, window if ca.causal else window - 1)
        mask = split.attention_mask.to(like.device) if split.attention_mask is not None else None
        if ca.causal:
            make = create_sliding_window_causal_mask if window is not None else create_causal_mask
            whole = make(config=config, inputs_embeds=embeds, attention_mask=mask, cache=None,
                         position_ids=split.position_ids.to(like.device), allow_is_causal_skip=ca.mode == "ulysses")
        else:  # an encoder: every token sees every other one of its row, padding aside
            make = create_bidirectional_sliding_window_mask if window is not None else create_bidirectional_mask
            whole = make(config=config, inputs_embeds=embeds, attention_mask=mask,
                         allow_is_bidirectional_skip=ca.mode == "ulysses")
            if whole is None and ca.mode == "allgather":  # nothing masked: the queries' rows see every key
                whole = torch.ones((b, 1, s, s), dtype=torch.bool, device=like.device)
        if ca.mode == "allgather":
            assert isinstance(whole, torch.Tensor), "a mask built without the causal skip is a tensor"
            whole = whole.index_select(2, split.local_index.to(like.device))
        if isinstance(whole, torch.Tensor) and whole.dtype == torch.bool:  # additive, once (-inf where masked):
            # what sdpa makes of it in every layer; a boolean mask sends CPU sdpa to its math path ([S, S] scores)
            whole = torch.zeros(whole.shape, dtype=like.dtype, device=like.device).masked_fill_(
                whole.logical_not(), float("-inf"))
        if ca.mode == "allgather":
            if not whole.shape[2]:  # a rank with no token: its placeholder query may see every key (a finite row)
                whole = whole.new_zeros((*whole.shape[:2], 1, whole.shape[3]))
        split.cache[key] = whole
    return split.cache[key]


class _Windowed:
    """A model's config as transformers' mask functions read it, but for ``sliding_window``.

    A layer passes its window to the attention call as the flash-attention
    path reads it, ``window_size=(w - 1, w - 1)``: a key is seen within
    ``w - 1`` positions of its query (Mistral's and Gemma's causal layers,
    Gemma 3's bidirectional ones, ModernBERT's ``sliding_window + 1``). That
    is the model's own mask rule for every window kind: transformers'
    causal sliding mask keeps ``q - k < window`` and its bidirectional one
    ``|q - k| <= window``, so the latter takes ``w - 1``. A view, not a
    copy: a config whose ``sliding_window`` is a property (ModernBERT's reads
    ``local_attention``) would ignore a value written into a copy.
    """

    def __init__(self, config: Any, sliding_window: int) -> None:
        self._config = config
        self.sliding_window = sliding_window

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _runs(ca: ContextAttention, split: ContextSplit, like: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    """The batch's runs (:attr:`ContextSplit.runs`) where this layer takes them: ``sdpa`` (no mask means
    ``is_causal`` to it), causal, no position bias, for the all-gather and hybrid modes' offset blocks a CPU tensor
    and no dropout, and under ``torch.compile`` a plain batch (module docstring); ``None`` otherwise (the dense
    mask). A layer with a sliding
    window takes them through it (:func:`~tplower.context.runs.windowed`: blocks of the window, each against the
    keys it sees, no whole-sequence mask)."""
    if ca.inner != "sdpa" or not ca.causal or not getattr(ca.config, "is_causal", True) \
            or kwargs.get("position_bias") is not None:
        return None  # (a config whose is_causal is off makes transformers' causal mask bidirectional)
    window = kwargs.get("sliding_window")
    if ca.mode != "ulysses" and (like.device.type != "cpu" or kwargs.get("dropout")):
        return None
    if window is not None and (kwargs.get("dropout") or not isinstance(window, int) or window < 1):
        return None
    if torch.compiler.is_compiling() and (split.attention_mask is not None or split.given_positions):
        return None  # the dense mask, made in the graph from the batch's tensors: no guard on the layout
    runs = split.runs
    if window is None or runs is None:
        return runs
    if ("runs", window) not in split.cache:
        split.cache[("runs", window)] = windowed(runs, window)
    return split.cache[("runs", window)]


def context_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' attention call for a context-parallel model: exchange, the model's kernel, exchange back.

    ``query`` ``[B, H, s, D]``, ``key``/``value`` ``[B, H_kv, s, D]`` of this
    rank's ``s`` tokens; ``attention_mask`` is ``None`` (transformers builds
    no mask for an implementation it has no mask function for; a module that
    passes one built its own). Returns ``([B, s, H, D], None)``, as the
    model's own implementation returns its output. Ulysses with ``H_kv`` not
    divisible by the axis size repeats each key/value head ``n/gcd(H_kv, n)``
    times before the exchange (the ranks that share a head each get a copy;
    the repeat's backward sums their gradients).

    Raises:
        TPLowerError: the module was not parallelized with a context axis, or
            the call carries no ``context_split`` (the model was called with a
            batch that did not come from :func:`tplower.shard_sequence`, or it
            does not pass its keyword arguments down to attention), the module
            passed a mask of its own, or Ulysses meets a query head count
            that the axis size does not divide (alike on every rank of the axis).
    """
    ca = module.__dict__.get(ATTR)
    if not isinstance(ca, ContextAttention):
        raise TPLowerError(f"{type(module).__name__}: its attention runs as {IMPLEMENTATION!r} but it was not "
                           "parallelized with context=; parallelize the model with context='cp'")
    split = kwargs.pop(SPLIT_KEY, None) or ca.live.get(SPLIT_KEY)
    if not isinstance(split, ContextSplit):
        raise TPLowerError(f"{type(module).__name__}: a context-parallel model takes the batch from "
                           "tplower.shard_sequence(batch, mesh) (its 'context_split' entry reached no attention "
                           "call: call model(**part) with every entry of the part; a layer that drops its keyword "
                           "arguments cannot be recomputed by activation checkpointing under context parallelism)")
    split = traced_split(split)
    if attention_mask is not None:
        raise TPLowerError(f"{type(module).__name__}: its forward passes an attention mask of its own (a "
                           f"{type(attention_mask).__name__} built from this rank's tokens, not by transformers' "
                           "mask functions for the model); context parallelism builds each layer's mask for the "
                           "whole sequence and cannot keep this one: train this model without context=")
    runs = _runs(ca, split, query, kwargs)
    if runs is None and ca.mode == "hybrid":  # a dense mask: the all-gather mode's rows over the whole axis
        ca = dataclasses.replace(ca, mode="allgather")
    mask = runs if runs is not None else _mask(ca, split, query, kwargs.get("sliding_window"))
    return _MODES[ca.mode](ca, split, module, query, key, value, mask, kwargs), None


_MODES = {"ulysses": ulysses, "allgather": allgather, "hybrid": hybrid}


def register() -> None:
    """Register :func:`context_attention` with transformers' attention interface as :data:`IMPLEMENTATION`."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, context_attention)
