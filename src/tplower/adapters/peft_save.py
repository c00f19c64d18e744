"""PEFT's ``PeftModel.save_pretrained`` writing whole adapters for a model tplower placed.

:func:`collective_peft_save` makes PEFT's save write what one process writes
(``adapter_model.safetensors`` of whole ``A`` and ``B``) for a ``PeftModel``
that holds parameters tplower placed, however it was built around the
parallelized model (``parallelize(peft_model)``, ``get_peft_model`` on a
parallelized model, or ``parallelize(peft_model.base_model.model)``). A
``PeftModel`` is made before or after ``parallelize`` and holds no link
tplower could follow from the model it wraps, so this is the class's method,
wrapped once per process when tplower first places a LoRA adapter (or
parallelizes a ``PeftModel``); a ``PeftModel`` without tplower's parameters
saves as before.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..core.support.errors import TPLowerError
from ..state.full_state import placed_by_tplower, plain_dtensor

__all__ = ["collective_peft_save", "is_peft_model", "plain_peft_save", "whole_adapter_state"]

#: ``{peft.PeftModel: its own save_pretrained}`` once :func:`collective_peft_save` wrapped it
_PEFT_SAVE: dict[type, Callable[..., Any]] = {}


def _peft_model_class() -> type | None:
    """``peft.PeftModel`` when PEFT is imported (tplower never imports it)."""
    cls = getattr(sys.modules.get("peft"), "PeftModel", None)
    return cls if isinstance(cls, type) else None


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT ``PeftModel`` (PEFT imported; tplower never imports it)."""
    cls = _peft_model_class()
    return cls is not None and isinstance(model, cls)


def whole_adapter_state(model: nn.Module, state_dict: Mapping[str, Any] | None, adapters: list[str],
                        save_embedding_layers: bool | str = "auto") -> dict[str, Any]:
    """``state_dict`` with each DTensor PEFT would save for ``adapters`` gathered whole (a collective).

    PEFT's own selection (``peft.get_peft_model_state_dict``, run on the DTensor values, which moves
    nothing) names the tensors ``PeftModel.save_pretrained`` writes; only those are gathered
    (``full_tensor``, one at a time, in ``state_dict``'s order, on every rank), so a rank holds the whole
    adapters and never the whole base model.

    Args:
        model: a ``PeftModel``.
        state_dict: the state dict to save from (default ``model.state_dict()``: DTensors for placed
            parameters).
        adapters: the adapter names to save (``save_pretrained``'s ``selected_adapters``).
        save_embedding_layers: ``save_pretrained``'s, which decides whether embeddings are saved too.

    Returns:
        ``{key: value}`` with ``state_dict``'s keys and order; the selected DTensors replaced by their whole
        tensors (plain tensors of the global shape), every other value as it was.
    """
    peft = sys.modules["peft"]
    state = dict(model.state_dict() if state_dict is None else state_dict)
    wanted: set[int] = set()
    with warnings.catch_warnings():  # PEFT's notes on embeddings come once, from the save itself
        warnings.simplefilter("ignore")
        for name in adapters:
            picked = peft.get_peft_model_state_dict(model, state_dict=state, adapter_name=name,
                                                    save_embedding_layers=save_embedding_layers)
            wanted.update(id(v) for v in picked.values())
    return {k: plain_dtensor(v).full_tensor().detach() if isinstance(v, DTensor) and id(v) in wanted else v
            for k, v in state.items()}


def _peft_save(own: Callable[..., Any], self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """PEFT's ``save_pretrained`` ``own``, collective for a model tplower placed (see :func:`collective_peft_save`)."""
    if not placed_by_tplower(self):
        return own(self, *args, **kwargs)
    call = inspect.signature(own).bind(self, *args, **kwargs)
    call.apply_defaults()
    arg = call.arguments
    if arg.get("path_initial_model_for_weight_conversion") is not None:
        raise TPLowerError("save_pretrained(path_initial_model_for_weight_conversion=...) of a model tplower "
                           "parallelized: PEFT loads the initial adapter on the writing rank alone, which would "
                           "leave the other ranks' collectives waiting; convert it in one process")
    extra = arg.setdefault("kwargs", {})
    adapters = arg.get("selected_adapters")
    if adapters is None:
        adapters = list(getattr(self, "peft_config", {}))
    extra["state_dict"] = whole_adapter_state(self, extra.get("state_dict"), adapters,
                                              arg.get("save_embedding_layers", "auto"))
    main = not dist.is_initialized() or dist.get_rank() == 0
    arg["is_main_process"] = bool(arg.get("is_main_process", True)) and main
    try:
        return own(*call.args, **call.kwargs)
    finally:  # every rank reaches the barrier, the writer too when its write failed
        if dist.is_initialized():
            dist.barrier()


def plain_peft_save(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """PEFT's own ``save_pretrained`` of ``model`` (a ``PeftModel``), as if :func:`collective_peft_save` had not
    wrapped it: no gather, no barrier. For a caller that gathered the state itself on every rank and writes it
    from one rank (:func:`tplower.hf.saving.writes_whole`).

    Raises:
        TypeError: ``model`` is not a ``PeftModel``.
    """
    cls = _peft_model_class()
    if cls is None or not isinstance(model, cls):
        raise TypeError(f"plain_peft_save: model must be a peft.PeftModel, got {type(model).__name__}")
    own = _PEFT_SAVE.get(cls, cls.__dict__["save_pretrained"])
    return own(model, *args, **kwargs)


def collective_peft_save() -> bool:
    """Make PEFT's ``PeftModel.save_pretrained`` write whole adapters for models tplower placed (once per process).

    Wraps the class's method (every ``PeftModel``, made before or after :func:`tplower.parallelize`). For a
    ``PeftModel`` that holds no parameter tplower placed the wrapper calls PEFT's method unchanged. For one
    that does, every rank: gathers the tensors PEFT saves whole (:func:`whole_adapter_state`: the adapters,
    not the base model), runs PEFT's ``save_pretrained`` on that state dict with ``is_main_process`` true on
    global rank 0 only (so every rank runs the same code on the same values, and only rank 0 writes), and
    waits at a barrier. The folder then holds what one process's ``save_pretrained`` writes for the same
    adapter values (``adapter_model.safetensors`` of whole ``A`` and ``B``), reloadable by
    ``PeftModel.from_pretrained`` in one process or on a parallelized model.

    A collective: call ``save_pretrained`` on every rank (an ``if rank == 0: model.save_pretrained(...)``
    waits forever, as transformers' own tensor-parallel save does).

    Returns:
        ``True`` when PEFT is imported and its ``PeftModel.save_pretrained`` is (now) wrapped.

    Raises:
        TPLowerError: (from the wrapped method) ``path_initial_model_for_weight_conversion`` given for a model
            tplower placed (PEFT loads the initial adapter on the writing rank only).
    """
    cls: Any = _peft_model_class()  # a third-party class: its method is replaced, so Any
    if cls is None:
        return False
    if cls not in _PEFT_SAVE:
        own = _PEFT_SAVE[cls] = cls.__dict__["save_pretrained"]

        @functools.wraps(own)  # PEFT's name, docstring and signature
        def save_pretrained(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return _peft_save(own, self, *args, **kwargs)

        cls.save_pretrained = save_pretrained
    return True
