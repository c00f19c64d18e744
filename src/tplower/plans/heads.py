"""Attention head counts: the config's, and an attention module's attributes that hold them.

:func:`config_head_counts` gives the counts that every plan splitting attention must divide over tp (each rank
owns whole query and key/value heads; ``parallelize`` refuses a plan that splits attention otherwise, and
``"derive"`` leaves such attention whole); :func:`head_attrs` finds the integer attributes that a split
attention module must divide (``local_attrs``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TypeGuard

from torch import nn

__all__ = ["HEAD_COUNTS", "config_head_counts", "config_heads", "head_attrs"]

_WIDTH_ATTRS = ("all_head_size", "inner_dim", "split_size")
_HEAD_WORDS = re.compile(r"(^|_)(heads?|n_head|num_heads)($|_)")
#: the config's head counts that every plan splitting attention must divide over tp
HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")


def head_attrs(module: nn.Module, heads: Iterable[int], width: int) -> dict[str, str]:
    """The integer attributes of an attention module that count heads or hold the projections' width."""
    counts = set(heads)
    out = {}
    for name, value in vars(module).items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            continue
        if (_HEAD_WORDS.search(name) and value in counts and "dim" not in name and "size" not in name) or (
                name in _WIDTH_ATTRS and value == width):
            out[name] = "divide"
    return out


def _text_config(model: nn.Module) -> object | None:
    config = getattr(model, "config", None)
    return config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config


def _positive(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def config_heads(model: nn.Module) -> set[int]:
    """Every head count the model's (text) config names (query, key/value, encoder, decoder), as a set."""
    text = _text_config(model)
    names = (*HEAD_COUNTS, "num_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads")
    return {v for k in names if _positive(v := getattr(text, k, None))}


def config_head_counts(model: nn.Module) -> dict[str, int]:
    """``{name: count}`` of the :data:`HEAD_COUNTS` the model's (text) config sets to a positive integer."""
    text = _text_config(model)
    return {k: v for k in HEAD_COUNTS if _positive(v := getattr(text, k, None))}
