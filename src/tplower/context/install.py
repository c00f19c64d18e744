"""Context parallelism installed on a transformers model: attention wrapped, the loss made whole, caches refused.

:func:`install_context` turns a model as shipped into one that takes its
batch from :func:`~tplower.context.sequence.shard_sequence` and gives one
process's answer:

* every attention module of the text decoder (:mod:`tplower.context.discover`)
  gets a :class:`~tplower.context.attention.ContextAttention` holding the
  kernel the model ran (``eager``: the modeling file's own
  ``eager_attention_forward``; ``sdpa``: transformers' registered function),
  and the text config's attention implementation becomes
  ``"tplower_context"`` (transformers' setter carries it to the config's
  sub-configs), so those modules call
  :func:`~tplower.context.attention.context_attention`; the model gets its
  own copy of its config first, so the caller's config object (and any other
  model built from it) is left as it was;
* a forward pre-hook on the model refuses a call without the batch's
  ``context_split`` and any KV cache (``generate()``, ``use_cache=True``, a
  given ``past_key_values``), and turns the cache off otherwise; it also
  leaves the split where the attention modules find it when a layer calls
  them without its keyword arguments (Nemotron's decoder layer does), until
  the forward ends; a rank that holds no token (a sequence shorter than the
  pieces) runs one placeholder token that no other rank sees and whose
  gradient is an exact zero, and its outputs drop that row again;
* a forward hook makes the loss whole: each rank's ``loss`` is its partial
  sum (transformers' causal-LM loss divides by ``num_items_in_batch``, the
  whole batch's count, which ``shard_sequence`` passes), so it moves
  ``P(sum) -> R`` over the axis (an ``all_reduce``; gradient ``R``: each
  rank's local loss keeps gradient 1, as one process's per-token terms do);
* the model-specific rules one process applies to the whole sequence
  (:class:`~tplower.context.rules.ModelRules`: rope, positions, labels, a
  token head's loss, poolers; encoder-decoders and sequence-level heads
  refused).

Parameters stay as they are: their gradients are this rank's tokens' part
(partial over the axis); whoever replicates them over the axis reduces them
(``parallelize`` sums them; FSDP2 over a mesh that includes the axis averages
them, so there the loss's gradient is ``grad_scale`` = the axis size).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..core.lower.redistribute import redistribute_local
from ..core.support.errors import TPLowerError
from ..core.support.words import closest
from .attention import ATTR, IMPLEMENTATION, MODES, ContextAttention, inner_config, register
from .discover import attention_modules, check_mixers, eager_kernel, own_config, text_config
from .exchange import hybrid_axes, hybrid_degree
from .loss import TiledLoss
from .placeholder import drop_placeholder, placeholder
from .rules import CAUSAL, ModelRules
from .sequence import SPLIT_KEY, ContextSplit, _axis, traced_split

__all__ = ["INNER", "INSTALL_ATTR", "ContextInstall", "install_context", "installed_context"]

#: the attribute of the model that holds its :class:`ContextInstall`
INSTALL_ATTR = "_tplower_context_install"
#: attention implementations context parallelism runs inside: their mask is a 4-D tensor it builds whole
INNER = ("eager", "sdpa")
_CACHE_KEYS = ("past_key_values", "cache")
#: install_context's arguments by the names :func:`tplower.parallelize` gives them
_PARALLELIZE = {"mode": "context_mode", "loss_chunk": "context_loss_chunk", "ulysses": "context_ulysses"}
_NO_CACHE = ("generate() and KV caches do not run under context parallelism (the cache would hold this rank's "
             "tokens only); generate with a model parallelized without context=")


@dataclass(frozen=True, eq=False)
class ContextInstall:
    """What :func:`install_context` did to a model.

    Attributes:
        mesh, axis, mode: as given.
        modules: paths of the attention modules that run under context parallelism.
        inner: the attention implementation the model had (``eager`` or ``sdpa``; both, joined by ``/``, when
            its modules differ).
        handles: the model's forward pre-hook and forward hook (and the output head's pre-hook with a
            tiled loss).
    """

    mesh: DeviceMesh
    axis: str
    mode: str
    modules: tuple[str, ...]
    inner: str
    handles: tuple[Any, ...]


def installed_context(model: nn.Module) -> ContextInstall | None:
    """The :class:`ContextInstall` of ``model``, or ``None`` when context parallelism is not installed."""
    record = model.__dict__.get(INSTALL_ATTR)
    return record if isinstance(record, ContextInstall) else None


def _kernel(path: str, module: nn.Module, inner: str) -> Any:
    if inner == "eager":
        kernel = eager_kernel(module)
        if kernel is None:
            raise TPLowerError(f"context parallelism: {path} ({type(module).__name__}) names no single "
                               "*eager_attention_forward function for the attention interface to default to; "
                               "load the model with attn_implementation='sdpa'")
        return kernel
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[inner]


def _inner(path: str, module: nn.Module) -> str:
    """The attention implementation ``module`` runs now, refused unless it is one of :data:`INNER`."""
    config = getattr(module, "config", None)
    inner = getattr(config, "_attn_implementation", None) or "eager"
    if inner == IMPLEMENTATION:
        raise TPLowerError(f"context parallelism: {path} already runs as {IMPLEMENTATION!r}; install it once "
                           "(parallelize a fresh model)")
    if inner in INNER:
        return str(inner)
    why = ("FlexAttention has no backward on CPU (torch 2.13) and its block masks are not row-sliced by context "
           "parallelism" if inner == "flex_attention" else
           "its mask is not a 4-D tensor context parallelism can build for the whole sequence")
    raise TPLowerError(f"context parallelism: {path} runs attn_implementation={inner!r}: {why}; load the model with "
                       f"attn_implementation='sdpa' (or 'eager'): one of {list(INNER)}")


def _head_counts(module: nn.Module) -> tuple[int | None, int | None]:
    """Query and key/value heads of ``module`` (its attributes, else its config's), ``None`` if unknown."""
    config = getattr(module, "config", None)

    def first(names: tuple[str, ...]) -> int | None:
        for owner in (module, config):
            for name in names:
                value = getattr(owner, name, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
        return None
    heads = first(("num_heads", "num_attention_heads", "n_heads"))
    return heads, first(("num_key_value_heads", "num_kv_heads", "n_kv_heads")) or heads


def _check_ulysses(path: str, module: nn.Module, n: int, axis: str, tp_size: int, mode: str = "ulysses") -> None:
    heads, kv = _head_counts(module)
    if heads is None or heads % tp_size:
        return  # unknown here: the attention call checks the heads it receives
    local = heads // tp_size
    if local % n:
        kv_local = f"{kv // tp_size if kv and kv % tp_size == 0 else kv}"
        raise TPLowerError(f"context parallelism: context_mode={mode!r} splits the heads over the {n} ranks of "
                           f"axis {axis!r}, but {path} ({type(module).__name__}) has {local} query heads per rank "
                           f"({heads} heads / tp {tp_size}; {kv_local} key/value heads), which {n} does not divide; "
                           "use context_mode='allgather' (it splits no heads), or a cp size that divides "
                           f"{local}")


def _named(caller: str, arg: str) -> str:
    """``caller: arg``, the argument by the name the caller's user wrote: :func:`tplower.parallelize`'s ``context_*``
    names, else :func:`install_context`'s own."""
    return f"{caller}: {_PARALLELIZE.get(arg, arg) if caller == 'parallelize' else arg}"


def _hybrid_degree(found: list[tuple[str, nn.Module]], n: int, axis: str, tp_size: int, given: int | None,
                   caller: str = "install_context") -> int:
    """The hybrid mode's Ulysses degree ``U`` (a divisor of ``n``): ``given``, or the largest that divides every
    attention module's query and key/value heads per rank (no repeated key/value head), else its query heads."""
    if given is not None:
        if not isinstance(given, int) or isinstance(given, bool) or given < 1 or n % given:
            raise TPLowerError(f"{_named(caller, 'ulysses')}={given!r} must be a divisor of the {n} ranks of axis "
                               f"{axis!r} (the hybrid mode's Ulysses degree: one of "
                               f"{[d for d in range(1, n + 1) if n % d == 0]})")
        return given
    counts = [_head_counts(m) for _, m in found]
    return hybrid_degree(n, [(h // tp_size, kv // tp_size if kv % tp_size == 0 else 1) for h, kv in counts
                             if h is not None and kv is not None and h % tp_size == 0])


def _per_head(module: nn.Module) -> tuple[str, ...]:
    """Names of ``module``'s own (not its children's) parameters and buffers: the candidates for per-head slices."""
    return tuple(n for n, _ in module.named_parameters(recurse=False)) + tuple(
        n for n, _ in module.named_buffers(recurse=False))


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _refuse_cache(kwargs: Mapping[str, Any]) -> None:
    if any(kwargs.get(k) is not None for k in _CACHE_KEYS) or kwargs.get("use_cache"):
        raise TPLowerError(f"context parallelism: {_NO_CACHE}")


class _Hooks:
    """The model's forward pre-hook (refusals, no cache) and forward hook (the whole loss)."""

    def __init__(self, mesh: DeviceMesh, axis: str, size: int, no_cache: bool, live: dict[str, Any],
                 grad_scale: int, rules: ModelRules | None = None, tiled: TiledLoss | None = None) -> None:
        self.mesh, self.axis, self.size, self.no_cache, self.live = mesh, axis, size, no_cache, live
        self.grad_scale, self.rules, self.tiled = grad_scale, rules, tiled

    def before(self, module: nn.Module, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        _refuse_cache(kwargs)
        split = kwargs.get(SPLIT_KEY)
        if not isinstance(split, ContextSplit):
            raise TPLowerError(f"{type(module).__name__} runs under context parallelism: call it with the batch "
                               f"from tplower.shard_sequence(batch, mesh, {self.axis!r}) as keywords "
                               "(model(**part)); it was called without 'context_split'")
        if split.axis != self.axis or split.layout.size != self.size:
            raise TPLowerError(f"{type(module).__name__}: the batch was split over axis {split.axis!r} "
                               f"({split.layout.size} ranks); the model runs over {self.axis!r} ({self.size}); "
                               f"call shard_sequence(batch, mesh, {self.axis!r})")
        split = traced_split(split)
        if self.rules is not None:
            kwargs = self.rules.before(module, kwargs, split)
        if not split.layout.local_length(split.rank):
            kwargs = placeholder(kwargs)
        if self.tiled is not None:
            kwargs = self.tiled.begin(type(module).__name__, kwargs)
        self.live[SPLIT_KEY] = split
        if self.no_cache and "use_cache" not in kwargs:
            kwargs = {**kwargs, "use_cache": False}
        return args, kwargs

    def after(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        # before the live batch is cleared: the rules read what the call left there
        output, weigh = self.rules.after(output, kwargs.get("labels")) if self.rules else (output, None)
        self.live.clear()
        if self.tiled is not None:
            self.tiled.finish(type(module).__name__, output)
        split = kwargs.get(SPLIT_KEY)
        if isinstance(split, ContextSplit) and not traced_split(split).layout.local_length(split.rank):
            output = drop_placeholder(output)
        if isinstance(output, MutableMapping):
            if output.get("aux_loss") is not None:
                raise TPLowerError(f"{type(module).__name__}: the router's auxiliary load-balancing loss is a "
                                   "statistic of the whole batch's tokens that each rank computes from its own; "
                                   "call the model without output_router_logits under context parallelism")
            loss = output.get("loss")
            if isinstance(loss, torch.Tensor):
                output["loss"] = self.whole(weigh(loss) if weigh else loss)
            return output
        if isinstance(output, tuple) and output and kwargs.get("labels") is not None \
                and isinstance(output[0], torch.Tensor) and output[0].dim() == 0:
            return (self.whole(weigh(output[0]) if weigh else output[0]), *output[1:])
        return output

    def whole(self, loss: torch.Tensor) -> torch.Tensor:
        """``P(sum) -> R`` over the axis: the sum of the ranks' partial losses; gradient ``R`` (identity), times
        ``grad_scale`` (the value unchanged) when the parameters' gradients are averaged over the axis later."""
        out = redistribute_local(loss, self.mesh, {self.axis: "P(sum)"}, {self.axis: "R"}, grad={self.axis: "R"})
        if self.grad_scale == 1:
            return out
        return out.detach() + self.grad_scale * (out - out.detach())


def install_context(model: nn.Module, mesh: DeviceMesh, axis: str = "cp", mode: str = "ulysses", *,
                    tp_size: int = 1, grad_scale: int = 1, loss_chunk: int | None = None,
                    ulysses: int | None = None, caller: str = "install_context") -> None:
    """Run ``model``'s attention over a sequence split on ``mesh[axis]``; the model then takes ``shard_sequence`` parts.

    Modifies ``model`` in place (a copy of its config, held by every module that
    held the original, whose text config's attention implementation changes;
    its attention modules, two forward hooks) and only after every check
    passed; the config object given to the model is never changed.
    Afterwards ``model(**shard_sequence(batch, mesh, axis))`` gives
    this rank's tokens' logits and, with ``labels``, the whole batch's loss on
    every rank; each parameter's gradient is this rank's part, to be summed
    over the axis.

    Args:
        model: a transformers model as shipped (``eager`` or ``sdpa`` attention).
        mesh: the device mesh; ``axis`` one of its axis names.
        axis: the context-parallel axis.
        mode: ``"ulysses"`` (``all_to_all`` from sequence to heads and back;
            each rank's query heads must divide by the axis size, key/value
            heads fewer than it are repeated), ``"allgather"`` (key and value
            gathered whole; no head condition) or ``"hybrid"`` (Ulysses over
            ``ulysses`` ranks inside, all-gather across).
        tp_size: how many ways tensor parallelism splits each module's heads
            (the Ulysses check divides the model's head count by it).
        grad_scale: the loss's gradient on each rank (its value is unchanged):
            1 when the parameters' gradients are summed over the axis, the
            axis size when they are averaged over it (FSDP2 over a mesh that
            flattens the axis with data parallelism).
        ulysses: the ``"hybrid"`` mode's Ulysses degree ``U``, a divisor of
            the axis size ``n``: the axis is split into ``n/U`` groups of ``U``
            ranks (mesh axes :func:`~tplower.context.exchange.hybrid_axes`),
            Ulysses inside a group, all-gather across them; default: the
            largest that divides the query and key/value heads each rank
            holds (else the query heads).
        caller: the public function whose arguments the refusals name:
            ``"install_context"`` (these names) or ``"parallelize"`` (its
            ``context_mode``, ``context_loss_chunk``, ``context_ulysses``).
        loss_chunk: ``None`` (default): the model computes its logits and
            loss as it does; ``c``: with ``labels``, the output head and the
            model's loss run in chunks of ``c`` positions with recompute
            (:mod:`tplower.context.loss`): no ``[B, s, V]`` logits on any
            rank, and the output holds the loss and no logits.

    Raises:
        TPLowerError: a mesh without ``axis``; a ``mode`` not in
            :data:`~tplower.context.attention.MODES`; Ulysses with a query head
            count per rank the axis size does not divide (naming the counts and
            ``allgather``); an attention implementation other than
            :data:`INNER` (``flex_attention``: no backward on CPU); a model with
            no attention module, or with a token mixer that is not softmax
            attention (naming the layer and its type); a model whose config
            asks for the router's auxiliary loss; an encoder-decoder model or
            a sequence-level head (:func:`~tplower.context.rules.head_kind`);
            a model already installed; ``loss_chunk`` below 1 or on a model
            without an output head; ``ulysses`` that does not divide the axis
            size, or its query heads per rank, or given to another mode.
        TypeError: ``model`` is not an ``nn.Module``, ``axis`` not a string.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"install_context: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(axis, str):
        raise TypeError(f"install_context: axis must be a mesh axis name (str), got {type(axis).__name__}")
    if mode not in MODES:
        raise TPLowerError(f"{_named(caller, 'mode')}={mode!r} is not one of {list(MODES)}"
                           f"{closest(str(mode), MODES)}")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise TPLowerError(f"install_context: tp_size={tp_size!r} must be an int >= 1")
    if not isinstance(grad_scale, int) or grad_scale < 1:
        raise TPLowerError(f"install_context: grad_scale={grad_scale!r} must be an int >= 1")
    n, _ = _axis(mesh, axis, "install_context")
    if installed_context(model) is not None:
        raise TPLowerError("install_context: context parallelism is already installed on this model")
    live: dict[str, Any] = {}
    rules = ModelRules(model, live, axis)  # refuses encoder-decoders and sequence-level heads
    found = attention_modules(model)
    check_mixers(model, found)
    if not found:
        raise TPLowerError(f"context parallelism: {type(model).__name__} has no module that calls transformers' "
                           "attention interface (ALL_ATTENTION_FUNCTIONS); it takes a transformers model whose "
                           "attention goes through that interface")
    config = text_config(model)
    if getattr(config, "output_router_logits", False):
        raise TPLowerError("context parallelism: config.output_router_logits=True asks for the router's auxiliary "
                           "loss, a statistic of the whole batch's tokens that each rank would compute from its own; "
                           "set config.output_router_logits=False")
    if loss_chunk is not None and rules.kind != CAUSAL:
        raise TPLowerError(f"{_named(caller, 'loss_chunk')}= computes a causal LM's next-token loss in chunks; "
                           f"{type(model).__name__}'s head is {rules.kind or 'none'}; drop "
                           f"{_named(caller, 'loss_chunk').partition(': ')[2]}")
    tiled = TiledLoss(model, config, loss_chunk, _named(caller, "loss_chunk")) if loss_chunk is not None else None
    inners = {path: _inner(path, m) for path, m in found}
    if mode == "ulysses":
        for path, m in found:
            _check_ulysses(path, m, n, axis, tp_size)
    sub_mesh = None
    if mode == "hybrid":
        degree = _hybrid_degree(found, n, axis, tp_size, ulysses, caller)
        for path, m in found:
            _check_ulysses(path, m, degree, axis, tp_size, mode)
        sub_mesh = mesh._unflatten(axis, (n // degree, degree), hybrid_axes(axis))  # collective: every rank
    elif ulysses is not None:
        mode_name = _named(caller, "mode").partition(": ")[2]
        raise TPLowerError(f"{_named(caller, 'ulysses')}={ulysses!r} is the hybrid mode's Ulysses degree; "
                           f"{mode_name}={mode!r} takes none (drop it, or use {mode_name}='hybrid')")
    register()
    own_config(model)  # the caller's config object stays as it was
    configs: dict[int, tuple[Any, Any]] = {}  # id(config) -> (config, its copy for the inner implementation)
    attached = []
    for path, m in found:
        own = getattr(m, "config", None) or config
        if id(own) not in configs:
            configs[id(own)] = (own, inner_config(own, inners[path]))
        attached.append((m, ContextAttention(mesh, axis, mode, inners[path], _kernel(path, m, inners[path]),
                                             configs[id(own)][1], _per_head(m), live,
                                             causal=bool(getattr(m, "is_causal", True)), sub_mesh=sub_mesh)))
    for m, ca in attached:
        m.__dict__[ATTR] = ca
    for own, _ in configs.values():
        own._attn_implementation = IMPLEMENTATION
    hooks = _Hooks(mesh, axis, n, _accepts(model, "use_cache"), live, grad_scale, rules, tiled)
    handles = (model.register_forward_pre_hook(hooks.before, with_kwargs=True),
               model.register_forward_hook(hooks.after, with_kwargs=True), *rules.hooks(model),
               *([tiled.attach()] if tiled else []))
    model.__dict__[INSTALL_ATTR] = ContextInstall(mesh, axis, mode, tuple(p for p, _ in found),
                                                  "/".join(sorted(set(inners.values()))), handles)
