"""Joining a module's outputs to its moved inputs and local parameters in autograd (:func:`tie_outputs`).

The rule it keeps: every collective a forward issued on a rank has its
backward issued on that rank, whatever the data.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.lower.collectives import keep_backward

__all__ = ["tie_outputs"]


def tie_outputs(out: Any, moved: list[Any], local_params: list[Any]) -> Any:
    """Each tensor ``out`` returns, joined in autograd to the moved inputs and the local parameters.

    The rule: every collective a forward issued on a rank has its backward
    issued on that rank, whatever the data. A module's own compute may leave
    an input or a parameter out of its result for data alone (transformers'
    eager experts loop over the experts that got a token: on a rank with no
    token the result is ``zeros_like``, and no expert weight is touched);
    then the input move's backward collective, or a parameter's gradient
    reduction, would run on the other ranks and not on this one, and they
    would wait for it. Joined (:func:`tplower.core.lower.collectives.keep_backward`),
    they get autograd's zero gradient here (a parameter's ``.grad`` is then
    zero, as one process's would be) and every backward collective runs.
    """
    tied = [t for t in (*moved, *local_params) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tied:
        return out
    if isinstance(out, torch.Tensor):
        return keep_backward(out, *tied)
    if isinstance(out, tuple | list):
        items = [keep_backward(v, *tied) if isinstance(v, torch.Tensor) else v for v in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    return out
