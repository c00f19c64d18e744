"""A rank that holds no token of a sequence shorter than the pieces: one placeholder token in, its row dropped out.

A model's own code cannot reshape an empty sequence into heads, so the
context-parallel model's forward pre-hook gives such a rank one placeholder
token (:func:`placeholder`) and its forward hook drops that row from the
outputs again (:func:`drop_placeholder`). The exchanges never let another
rank's query see it, and its label counts for nothing, so every gradient
through it is an exact zero.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch

__all__ = ["drop_placeholder", "placeholder"]


def placeholder(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A rank with no token runs one placeholder token: ``[B, 0]`` entries become ``[B, 1]`` (id 0, position 0, label
    ``-100``, attended), since a model's own code cannot reshape an empty sequence into heads.

    The exchanges drop it as they drop the padding of uneven pieces (no other rank's query sees it), its own query
    may attend to every key (a finite row), and its label counts for nothing, so every gradient through it is an
    exact zero; the forward hook drops its row from the outputs.
    """
    out = dict(kwargs)
    for key, fill in (("input_ids", 0), ("position_ids", 0), ("token_type_ids", 0), ("attention_mask", 1),
                      ("labels", -100), ("shift_labels", -100), ("inputs_embeds", 0)):
        t = out.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == 0:
            out[key] = t.new_full((t.shape[0], 1, *t.shape[2:]), fill)
    return out


def drop_placeholder(output: Any) -> Any:
    """The outputs of a rank with no token without the placeholder's row (``[B, 1, ...]`` -> ``[B, 0, ...]``)."""

    def drop(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == 1:
            return t.narrow(1, 0, 0)
        if isinstance(t, tuple) and all(isinstance(x, torch.Tensor) for x in t):
            return tuple(drop(x) for x in t)
        return t

    if isinstance(output, MutableMapping):
        for key in ("logits", "last_hidden_state", "hidden_states"):
            if output.get(key) is not None:
                output[key] = drop(output[key])
        return output
    if isinstance(output, tuple):
        return tuple(x if isinstance(x, torch.Tensor) and x.dim() == 0 else drop(x) for x in output)
    return output
