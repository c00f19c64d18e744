"""Which modules of a transformers model are its attention, and which token mixers context parallelism must refuse.

**The rule for attention.** A module is an attention module when its class's
``forward`` (decorators unwrapped) reads the global name
``ALL_ATTENTION_FUNCTIONS``: the module then computes its query, key and
value and hands them to transformers' attention interface
(``ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
eager_attention_forward)``), the one call context parallelism wraps. The
test reads the compiled code's global names, not source text or class names,
so it holds for every model that follows transformers' attention interface
(the same property transformers checks, by source text, before it lets an
implementation be switched), and for none that does not. The ``eager``
kernel is the one that forward passes as the default: the global its code
names ``*eager_attention_forward``.

**The scope.** A composite model (a vision or audio encoder beside the text
decoder) is walked without the subtrees of modules whose ``config`` is
neither the model's config nor its text config: context parallelism splits
the text sequence, and encoders keep their own implementation.
:func:`own_config` gives the model a config of its own before anything in it
changes.

**What is refused**, because it mixes tokens outside that call (a
recurrence or a convolution carries state from token to token, so the
sequence cannot be cut without exchanging it):

* a ``layer_types`` entry of the text config other than
  :data:`ATTENTION_LAYERS` (softmax attention whose mask transformers builds
  as causal or sliding-window causal) or :data:`TOKEN_WISE_LAYERS` (layers
  that mix no tokens): ``linear_attention`` (Mamba, gated delta nets),
  ``conv``, ``hybrid``, ``chunked_attention``, ``indexed_attention``, ...;
* an ``nn.Conv1d`` with a kernel longer than one token anywhere in scope (a
  short convolution over the sequence, inside attention or beside it);
* a decoder layer (transformers' ``GradientCheckpointingLayer``) that holds
  no attention module and is not declared token-wise: it mixes its tokens
  some other way, or not through the attention interface.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ..core.support.errors import TPLowerError

__all__ = ["ATTENTION_LAYERS", "TOKEN_WISE_LAYERS", "attention_modules", "check_mixers", "decoder_layers",
           "eager_kernel", "own_config", "text_config"]

#: ``layer_types`` entries that are softmax attention with a mask transformers builds for the whole sequence
ATTENTION_LAYERS = ("full_attention", "sliding_attention")
#: ``layer_types`` entries that mix no tokens (a dense or expert MLP block)
TOKEN_WISE_LAYERS = ("mlp", "moe")
_INTERFACE = "ALL_ATTENTION_FUNCTIONS"
_FIX = "train it without context= (tensor, data or expert parallelism only)"


def _code_names(cls: type) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The global and attribute names ``cls.forward``'s code reads, and that function's globals."""
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    return (tuple(code.co_names) if code is not None else ()), getattr(forward, "__globals__", {})


def is_attention(module: nn.Module) -> bool:
    """Whether ``module``'s forward calls transformers' attention interface (reads ``ALL_ATTENTION_FUNCTIONS``)."""
    return _INTERFACE in _code_names(type(module))[0]


def eager_kernel(module: nn.Module) -> Callable[..., Any] | None:
    """The ``eager`` function ``module``'s forward passes to the attention interface as its default, or ``None``.

    The one global of the forward's code named ``*eager_attention_forward``
    (``eager_attention_forward`` in nearly every model; ``simple_``,
    ``text_``, ``vision_`` prefixes in a few); ``None`` when there is not
    exactly one.
    """
    names, globs = _code_names(type(module))
    found = {n for n in names if n.endswith("eager_attention_forward") and callable(globs.get(n))}
    return globs[found.pop()] if len(found) == 1 else None


def text_config(model: nn.Module) -> Any:
    """The config of ``model``'s text decoder (``config.get_text_config(decoder=True)``, else ``config``).

    Raises:
        TPLowerError: ``model`` has no ``config`` (not a transformers model).
    """
    config = getattr(model, "config", None)
    if config is None:
        raise TPLowerError(f"context parallelism: {type(model).__name__} has no config; it takes a transformers "
                           "model (a PreTrainedModel, e.g. AutoModelForCausalLM.from_pretrained(...))")
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config


def own_config(model: nn.Module) -> None:
    """Give ``model`` its own deep copy of its config, in place: every module attribute that held the config, or
    any config inside it (a multimodal model's text config), holds the copy's counterpart, so a later change of
    the model's config (its attention implementation) reaches no config object the caller holds, nor another
    model built from it. A model without a transformers ``PretrainedConfig`` is left as it is."""
    from transformers import PretrainedConfig

    original = getattr(model, "config", None)
    if not isinstance(original, PretrainedConfig):
        return
    memo: dict[int, Any] = {}
    copy.deepcopy(original, memo)  # memo: id(every object copied) -> its copy
    for module in model.modules():
        for key, value in list(module.__dict__.items()):
            if isinstance(value, PretrainedConfig) and id(value) in memo:
                module.__dict__[key] = memo[id(value)]


def _in_scope(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """``named_modules`` without the subtrees of modules whose ``config`` is not the model's or its text config."""
    own = (id(getattr(model, "config", None)), id(text_config(model)))

    def walk(module: nn.Module, path: str) -> Iterator[tuple[str, nn.Module]]:
        config = module.__dict__.get("config")
        if path and config is not None and hasattr(config, "to_dict") and id(config) not in own:
            return
        yield path, module
        for name, child in module.named_children():
            yield from walk(child, f"{path}.{name}" if path else name)

    yield from walk(model, prefix)


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of every attention module of ``model``'s text decoder (the rule in the module notes)."""
    return [(path, m) for path, m in _in_scope(model) if path and is_attention(m)]


def decoder_layers(model: nn.Module) -> list[tuple[str, int, nn.Module]]:
    """``(path, index, layer)`` of every transformers decoder layer in scope (the text decoder's, those
    ``num_hidden_layers`` counts), with its index in its list, in model order; ``[]`` without transformers'
    ``GradientCheckpointingLayer``."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # older transformers: no common base class to recognize a layer by
        return []
    out: list[tuple[str, int, nn.Module]] = []
    for path, module in _in_scope(model):
        if isinstance(module, nn.ModuleList):
            out += [(f"{path}.{i}", i, layer) for i, layer in enumerate(module)
                    if isinstance(layer, GradientCheckpointingLayer)]
    return out


def check_mixers(model: nn.Module, found: list[tuple[str, nn.Module]]) -> None:
    """Refuse a model whose text decoder mixes tokens anywhere but in the attention modules ``found``.

    Raises:
        TPLowerError: naming the layer (its path and class) and its kind: a
            ``layer_types`` entry that is not softmax attention, a convolution
            over the sequence, or a decoder layer without an attention module.
    """
    config = text_config(model)
    kinds = list(getattr(config, "layer_types", None) or ())
    layers = decoder_layers(model)
    by_index = {i: (path, layer) for path, i, layer in layers}
    for i, kind in enumerate(kinds):
        if kind not in ATTENTION_LAYERS + TOKEN_WISE_LAYERS:
            path, layer = by_index.get(i, (f"layer {i}", None))
            what = f"{path} ({type(layer).__name__})" if layer is not None else path
            raise TPLowerError(f"context parallelism: {what} is a {kind!r} layer (config.layer_types[{i}]), not "
                               f"softmax attention: only {' and '.join(ATTENTION_LAYERS)} layers split over the "
                               f"sequence (a recurrent, convolutional or token-selecting mixer carries state from "
                               f"token to token); {_FIX}")
    for path, module in _in_scope(model):
        if isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1:
            raise TPLowerError(f"context parallelism: {path} is a convolution over the sequence (nn.Conv1d, kernel "
                               f"{module.kernel_size[0]}), a token mixer that is not softmax attention; {_FIX}")
    paths = [p for p, _ in found]
    for path, i, layer in layers:
        kind = kinds[i] if i < len(kinds) else None
        if kind not in TOKEN_WISE_LAYERS and not any(p.startswith(path + ".") for p in paths):
            raise TPLowerError(f"context parallelism: {path} ({type(layer).__name__}) holds no module that calls "
                               "transformers' attention interface (ALL_ATTENTION_FUNCTIONS), so it mixes its tokens "
                               f"some other way{f' (layer type {kind!r})' if kind else ''}; {_FIX}")
