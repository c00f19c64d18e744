"""What :mod:`tplower.plans.derive` reads of a module: its plan-key name, projection widths and styles, its forward's
parameters, why a module no rule places is left whole, and the names that make an attention or an MLP (read by
:mod:`tplower.nn.partners` too)."""

from __future__ import annotations

import inspect

from torch import nn

from ..families.conv1d import is_conv1d

__all__ = ["ATTENTION_OUTPUTS", "MLP_PAIRS", "QKV_NAMES", "features", "glob", "is_linear", "is_projection", "join",
           "split_style", "takes", "whole_reason"]

#: an attention's separate query, key and value projections (children of one module), as models name them
QKV_NAMES: tuple[tuple[str, str, str], ...] = (
    ("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"), ("q_lin", "k_lin", "v_lin"))
#: an attention's output projection beside its query/key/value projections (BERT's and ViT's is the attention's
#: sibling ``output.dense`` instead)
ATTENTION_OUTPUTS = ("o_proj", "out_proj", "o", "out_lin", "dense")
#: an MLP's up (and gate) projections and the down projection that consumes them (children of one module)
MLP_PAIRS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("gate_proj", "up_proj"), "down_proj"), (("up_proj",), "down_proj"), (("fc1",), "fc2"), (("lin1",), "lin2"),
    (("dense_h_to_4h",), "dense_4h_to_h"), (("wi_0", "wi_1"), "wo"), (("wi",), "wo"), (("c_fc",), "c_proj"),
    (("gate_up_proj",), "down_proj"))


def glob(name: str) -> str:
    """``name`` with every layer index a ``*`` (``layers.3.mlp`` -> ``layers.*.mlp``): a plan key for all layers."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def join(prefix: str, name: str) -> str:
    """``prefix.name``, or ``name`` at the root."""
    return f"{prefix}.{name}" if prefix else name


def is_linear(module: nn.Module | None) -> bool:
    """Whether ``module`` is an ``nn.Linear``."""
    return isinstance(module, nn.Linear)


def is_projection(module: nn.Module | None) -> bool:
    """An ``nn.Linear`` or a transformers ``Conv1D`` (the same map, weight stored ``[in, out]``)."""
    return is_linear(module) or is_conv1d(module)


def features(module: nn.Module, side: str) -> int:
    """``in`` or ``out`` features of an ``nn.Linear`` or a ``Conv1D``."""
    if is_conv1d(module):
        return int(getattr(module, "nx" if side == "in" else "nf"))
    return int(getattr(module, "in_features" if side == "in" else "out_features"))


def split_style(module: nn.Module, split: str) -> str:
    """``colwise``/``rowwise`` for an ``nn.Linear``, ``conv1d_colwise``/``conv1d_rowwise`` for a ``Conv1D``."""
    return f"conv1d_{split}" if is_conv1d(module) else split


def takes(module: nn.Module, name: str) -> bool:
    """Whether the module's ``forward`` has a parameter called ``name``."""
    try:
        return name in inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False


def whole_reason(module: nn.Module) -> str:
    """Why the final pass leaves a module with parameters of its own whole (no rule placed it)."""
    name = type(module).__name__
    if "norm" in name.lower():
        return f"{name}: a norm, on whole activations (every rank normalizes the same values)"
    if isinstance(module, nn.Embedding):
        return f"{name}: an embedding (positions, types) added to whole activations"
    if isinstance(module, nn.modules.conv._ConvNd):
        return f"{name}: a convolution, which no rule splits"
    if is_projection(module):
        return (f"{name}: a projection no rule names (not a query/key/value, output, up/gate or down projection of "
                "a known name)")
    own = sorted(n for n, _ in module.named_parameters(recurse=False))
    return f"{name}: parameters {own} that no rule places"
