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
sliding windows and packed documents are as one process builds them), built
once per batch and kind of layer; the all-gather mode takes the rows of its
queries.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..core.errors import TPLowerError
from ..core.redistribute import redistribute_local
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
        config: the model's config as the inner implementation sees it (masks are built from it).
    """

    mesh: DeviceMesh
    axis: str
    mode: str
    inner: str
    kernel: Callable[..., Any]
    config: Any


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
    """transformers' mask of the whole sequence for this layer's kind (cached per batch)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    key = (ca.inner, window is not None, like.dtype, like.device)
    if key not in split.cache:
        b, s = split.position_ids.shape[0], split.layout.length
        embeds = torch.empty((b, s, 1), dtype=like.dtype, device=like.device)
        make = create_sliding_window_causal_mask if window is not None else create_causal_mask
        mask = split.attention_mask.to(like.device) if split.attention_mask is not None else None
        split.cache[key] = make(config=ca.config, inputs_embeds=embeds, attention_mask=mask, cache=None,
                                position_ids=split.position_ids.to(like.device), allow_is_causal_skip=False)
    return split.cache[key]


def _ulysses(ca: ContextAttention, split: ContextSplit, module: Any, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, mask: Any, kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    layout, n, axis = split.layout, split.layout.size, ca.axis
    width, local = max(layout.lengths), q.shape[2]
    order = layout.padded_order.to(q.device)

    def to_heads(t: torch.Tensor) -> torch.Tensor:  # [B, h, s, D] S(2) -> [B, h/n, S, D] S(1), in global order
        padded = _pad_seq(t, 2, width)
        shape = (padded.shape[0], padded.shape[1], width * n, padded.shape[3])
        whole = redistribute_local(padded, ca.mesh, {axis: "S(2)"}, {axis: "S(1)"}, global_shape=shape)
        return whole.index_select(2, order)

    out, _ = ca.kernel(module, to_heads(q), to_heads(k), to_heads(v), mask, **kwargs)  # [B, S, H/n, D]
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

    rows = mask.index_select(2, split.local_index.to(q.device)) if isinstance(mask, torch.Tensor) else mask
    out, _ = ca.kernel(module, q, whole(k), whole(v), rows, **kwargs)
    return out, None


def context_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' attention call for a context-parallel model: exchange, the model's kernel, exchange back.

    ``query`` ``[B, H, s, D]``, ``key``/``value`` ``[B, H_kv, s, D]`` of this
    rank's ``s`` tokens (``attention_mask``, built by the model for the local
    tokens alone, is not used). Returns ``([B, s, H, D], None)``, as the
    model's own implementation returns its output.

    Raises:
        TPLowerError: the module was not parallelized with a context axis, or
            the call carries no ``context_split`` (the model was called with a
            batch that did not come from :func:`tplower.shard_sequence`, or it
            does not pass its keyword arguments down to attention).
    """
    ca = module.__dict__.get(ATTR)
    if not isinstance(ca, ContextAttention):
        raise TPLowerError(f"{type(module).__name__}: its attention runs as {IMPLEMENTATION!r} but it was not "
                           "parallelized with context=; parallelize the model with context='cp'")
    split = kwargs.pop(SPLIT_KEY, None)
    if not isinstance(split, ContextSplit):
        raise TPLowerError(f"{type(module).__name__}: a context-parallel model takes the batch from "
                           "tplower.shard_sequence(batch, mesh) (its 'context_split' entry reached no attention "
                           "call: call model(**part) with every entry of the part)")
    mask = _mask(ca, split, query, kwargs.get("sliding_window"))
    run = _ulysses if ca.mode == "ulysses" else _allgather
    return run(ca, split, module, query, key, value, mask, kwargs)


def register() -> None:
    """Register :func:`context_attention` with transformers' attention interface as :data:`IMPLEMENTATION`."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, context_attention)
