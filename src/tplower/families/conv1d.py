"""Transformers' ``Conv1D`` (GPT-2, GPT, ...) on local parameters: ``x @ weight + bias`` with ``weight`` ``[in, out]``.

``Conv1D`` is a linear layer whose weight is stored transposed (``[nx, nf]``)
and whose ``forward`` reshapes its output to the module's own ``nf``. Under
a column split each rank holds ``nf / n`` output columns, under a row split
the bias is added once after the output reduction (``deferred_bias``, the
bias is ``None`` during the local compute), so neither fits ``forward``:
:func:`conv1d_forward` is the plan's ``local_compute`` for the
``conv1d_colwise`` and ``conv1d_rowwise`` styles (:mod:`tplower.plans.styles`),
sized from the local weight and adding the bias only when it is there.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["conv1d_forward", "is_conv1d"]


def is_conv1d(module: nn.Module | None) -> bool:
    """Whether ``module`` is a transformers ``Conv1D``: a 2-D ``weight`` of shape ``[nx, nf]`` and a bias ``[nf]``.

    Recognised by its class name and its ``nf``/``nx`` attributes, so transformers need not be imported.
    """
    if module is None or type(module).__name__ != "Conv1D":
        return False
    weight, nf, nx = getattr(module, "weight", None), getattr(module, "nf", None), getattr(module, "nx", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2 and tuple(weight.shape) == (nx, nf)


def conv1d_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x @ module.weight (+ module.bias)`` on whatever local parameters the module holds now.

    Args:
        module: a ``Conv1D`` whose ``weight`` is ``[in, out]`` (the local shard) and ``bias`` ``[out]`` or ``None``
            (a bias deferred until after the output reduction).
        x: ``[..., in]``.

    Returns:
        ``[..., out]``, ``out`` the local weight's column count.
    """
    weight, bias = module._parameters["weight"], module._parameters.get("bias")
    assert weight is not None, "a Conv1D always has a weight"
    flat = x.reshape(-1, x.size(-1))
    out = flat @ weight if bias is None else torch.addmm(bias, flat, weight)
    return out.view(*x.shape[:-1], weight.shape[1])
