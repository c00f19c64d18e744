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
  local queries attend to the whole sequence.

Pieces of uneven length are padded to the longest before the exchange and
the padding dropped after it. The mask is transformers' own for the whole
sequence (``create_causal_mask`` or ``create_sliding_window_causal_mask``
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
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..core.lower.redistribute import redistribute_local
from ..core.support.errors import TPLowerError
from .sequence import SPLIT_KEY, ContextSplit

__all__ = ["ATTR", "IMPLEMENTATION", "MODES", "ContextAttention", "context_attention", "register"]

#: the attention implementation name a context-parallel model's config takes
IMPLEMENTATION = "tplower_context"
#: the attribute of an attention module that holds its :class:`ContextAttention`
ATTR = "_tplower_context"
MODES = ("ulysses", "allgather")


@dataclass(frozen=True, eq=False)
class ContextAttention:
    """How one attention module runs under context parallelism.

    Attributes:
        mesh: the device mesh; ``axis`` its context-parallel axis.
        axis: the axis name.
        mode: ``ulysses`` or ``allgather``.
        inner: the implementation the model had (``eager``, ``sdpa``, ...).
        kernel: its function (the model's own ``eager_attention_forward`` for ``eager``).
        config: the model's config as the inner implementation sees it (masks are built from it; one
            copy shared by the modules of one config, so one mask serves them all).
        per_head: names of the module's own parameters that may hold one entry per query head (e.g.
            gpt-oss's ``sinks``): under Ulysses the kernel sees rank ``r``'s slice of those whose leading
            dim is the local head count.
        causal: the module's ``is_causal`` (an encoder's bidirectional attention: ``False``).
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


def inner_config(config: Any, inner: str) -> Any:
    """A shallow copy of ``config`` whose attention implementation reads ``inner`` (sub-configs untouched)."""
    mine = copy.copy(config)
    mine.__dict__["_attn_implementation_internal"] = inner
    return mine


def _pad_seq(t: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    extra = width - t.shape[dim]
    if not extra:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _mask(ca: ContextAttention, split: ContextSplit, like: torch.Tensor, window: Any) -> Any:
    """transformers' mask for this layer's kind, as this mode's kernel takes it (cached per batch).

    Ulysses: the mask one process builds for the whole sequence (the kernel
    sees the whole sequence in its own order, as one process does), so
    ``sdpa`` skips a plain causal mask (``None``, the kernel's ``is_causal``)
    exactly where one process skips it. All-gather: the rows of this rank's
    queries of the whole mask (never skipped: the queries are a slice); the
    whole mask is dropped once its rows are taken, and a boolean one becomes
    the additive mask ``sdpa`` would convert it to in every layer (``0``, and
    ``-inf`` where masked: the same values, made once a batch).
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
            if whole.dtype == torch.bool:  # what sdpa would make of it in every layer, once (-inf where masked)
                whole = torch.zeros(whole.shape, dtype=like.dtype, device=like.device).masked_fill_(
                    whole.logical_not(), float("-inf"))
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


class _KernelView:
    """The attention module as the kernel reads it under Ulysses: the module itself, but for ``overrides``.

    The kernel reads a few attributes of the module (``num_key_value_groups``,
    ``training``, ``is_causal``, per-head parameters such as ``sinks``); after
    the exchange it holds ``1/n`` of the heads, so the per-head ones must be
    this rank's slice and the group size that of the heads it holds.
    """

    def __init__(self, module: Any, overrides: dict[str, Any]) -> None:
        self._module = module
        self._overrides = overrides

    def __getattr__(self, name: str) -> Any:
        if name in self._overrides:
            return self._overrides[name]
        return getattr(self._module, name)


def _heads_view(ca: ContextAttention, module: Any, rank: int, n: int, h_q: int, groups: int | None,
                kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The module and keyword arguments the kernel gets for heads ``[rank*h_q/n, (rank+1)*h_q/n)``."""
    overrides: dict[str, Any] = {}
    if groups is not None and hasattr(module, "num_key_value_groups"):
        overrides["num_key_value_groups"] = groups
    per = h_q // n
    swap: dict[int, torch.Tensor] = {}
    for name in ca.per_head:
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == h_q:
            overrides[name] = swap[id(t)] = t.narrow(0, rank * per, per)
    if not overrides:
        return module, kwargs
    kw = {k: swap.get(id(v), v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return _KernelView(module, overrides), kw


def _ulysses(ca: ContextAttention, split: ContextSplit, module: Any, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, mask: Any, kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    layout, n, axis = split.layout, split.layout.size, ca.axis
    width, local = max(layout.lengths), q.shape[2]
    order = layout.padded_order.to(q.device)
    h_q, h_kv = q.shape[1], k.shape[1]
    if h_q % n or h_q % h_kv:
        raise TPLowerError(f"{type(module).__name__}: context_mode='ulysses' splits the heads over the {n} ranks "
                           f"of axis {axis!r}, but this rank holds {h_q} query heads and {h_kv} key/value heads "
                           f"({h_q} does not divide by {n}); use context_mode='allgather' (it splits no heads)")
    # key/value heads fewer than (or not divisible by) n: repeat each r times, so every rank gets whole groups
    rep = 1 if h_kv % n == 0 else n // math.gcd(h_kv, n)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    view, kw = _heads_view(ca, module, split.rank, n, h_q, h_q // (h_kv * rep) if rep > 1 else None, kwargs)

    def to_heads(t: torch.Tensor) -> torch.Tensor:  # [B, h, s, D] S(2) -> [B, h/n, S, D] S(1), in global order
        padded = _pad_seq(t, 2, width)
        shape = (padded.shape[0], padded.shape[1], width * n, padded.shape[3])
        whole = redistribute_local(padded, ca.mesh, {axis: "S(2)"}, {axis: "S(1)"}, global_shape=shape)
        return whole.index_select(2, order)

    out, _ = ca.kernel(view, to_heads(q), to_heads(k), to_heads(v), mask, **kw)  # [B, S, H/n, D]
    padded = out.new_zeros((out.shape[0], width * n, *out.shape[2:])).index_copy(1, order, out)
    shape = (padded.shape[0], width * n, padded.shape[2] * n, padded.shape[3])
    back = redistribute_local(padded, ca.mesh, {axis: "S(2)"}, {axis: "S(1)"}, global_shape=shape)
    return back.narrow(1, 0, local), None


def _allgather(ca: ContextAttention, split: ContextSplit, module: Any, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, mask: Any, kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    layout, n, axis = split.layout, split.layout.size, ca.axis
    width = max(layout.lengths)
    order = layout.padded_order.to(q.device)

    def whole(t: torch.Tensor) -> torch.Tensor:  # [B, h, s, D] S(2) -> R, in global order
        padded = _pad_seq(t, 2, width)
        shape = (padded.shape[0], padded.shape[1], width * n, padded.shape[3])
        return redistribute_local(padded, ca.mesh, {axis: "S(2)"}, {axis: "R"}, grad={axis: "P(sum)"},
                                  global_shape=shape).index_select(2, order)

    out, _ = ca.kernel(module, q, whole(k), whole(v), mask, **kwargs)  # mask: the rows of the local queries
    return out, None


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
    if attention_mask is not None:
        raise TPLowerError(f"{type(module).__name__}: its forward passes an attention mask of its own (a "
                           f"{type(attention_mask).__name__} built from this rank's tokens, not by transformers' "
                           "mask functions for the model); context parallelism builds each layer's mask for the "
                           "whole sequence and cannot keep this one: train this model without context=")
    mask = _mask(ca, split, query, kwargs.get("sliding_window"))
    run = _ulysses if ca.mode == "ulysses" else _allgather
    return run(ca, split, module, query, key, value, mask, kwargs)


def register() -> None:
    """Register :func:`context_attention` with transformers' attention interface as :data:`IMPLEMENTATION`."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, context_attention)
