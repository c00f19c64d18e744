"""Context-parallel cases against one process: tiny transformers models, whole batches, the comparison on one rank.

A :class:`Case` names a model, a mode, an attention implementation, a
length, the balance and the kind of batch. :func:`run_case` runs it on one
rank of a ``cp`` mesh: one process's forward and backward on the whole
batch (the reference, on every rank), then the installed model on
``shard_sequence``'s part, and returns the largest differences of the loss,
the logits (made whole by ``gather_sequence``) and every parameter's
gradient. The model is ``tplower.parallelize(model, mesh, plan, context="cp")``:
every parameter is a DTensor replicated over ``cp`` whose gradient
``parallelize`` sums over it (with ``tp``, sharded by the plan; compared
whole).

The reference runs with ``use_cache=False``, as training does: with a cache
(transformers creates one when ``use_cache`` is on, the config's default)
transformers does not look for packed documents in the position ids, so a
packed batch would attend across its documents. A context-parallel model
has no cache and always gives each packed document its own attention.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tplower.core.lower.traffic import CollectiveTraffic
from tplower.run.hf_configs import tiny_config

#: model kinds: (model_type, config overrides). Sliding windows (8) are shorter than every sequence.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),  # GQA: 4 query heads, 2 key/value heads
    "llama_mqa": ("llama", {"num_key_value_heads": 1}),  # fewer key/value heads than cp: repeated under Ulysses
    "llama_h3": ("llama", {"num_attention_heads": 3, "num_key_value_heads": 1, "hidden_size": 48}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {"sliding_window": 8}),
    # windows that a cp=2 piece of 64 tokens (16 balanced) holds, and that spans pieces
    "mistral_w4": ("mistral", {"sliding_window": 4}),
    "mistral_w24": ("mistral", {"sliding_window": 24}),
    "gemma2": ("gemma2", {"sliding_window": 8}),  # sliding and global layers alternate; softcapping
    "qwen3_moe": ("qwen3_moe", {}),  # experts see this rank's tokens
    "gpt_oss": ("gpt_oss", {"sliding_window": 8}),  # per-head sinks the eager kernel reads from the module
    "nemotron": ("nemotron", {}),  # its decoder layer calls attention without the keyword arguments
}
#: one model built at a time from the seeded global generator (threaded ranks share it)
_SEEDED = threading.Lock()
#: kinds transformers runs only with eager attention
EAGER_ONLY = ("gemma2", "gpt_oss")


@dataclass(frozen=True)
class Case:
    """One comparison: ``batch`` is ``"padded"`` (left padding, ``attention_mask``), ``"ragged"`` (padding on the
    right of one row, the left of the other), ``"packed"`` (position ids restarting per document, no mask:
    transformers finds the documents from the positions) or ``"plain"``."""

    model: str
    mode: str
    impl: str
    seq: int
    balance: bool
    batch: str
    loss_chunk: int | None = None  # the loss in chunks of this many positions (``context_loss_chunk``)
    ulysses: int | None = None  # the hybrid mode's Ulysses degree (``context_ulysses``; default from the heads)

    @property
    def name(self) -> str:
        tiled = f"-tiled{self.loss_chunk}" if self.loss_chunk else ""
        degree = f"-u{self.ulysses}" if self.ulysses else ""
        return f"{self.model}-{self.mode}-{self.impl}-{self.seq}-{'bal' if self.balance else 'even'}-{self.batch}" \
            + tiled + degree


def tiny(kind: str, impl: str, layers: int = 2) -> nn.Module:
    """A tiny float32 causal LM of ``kind`` (:data:`MODELS`) with attention ``impl``, weights from seed 0."""
    with _SEEDED:  # transformers' lazy imports are not safe from several threads at once
        from transformers import AutoModelForCausalLM

    model_type, overrides = MODELS[kind]
    config = tiny_config(model_type)
    for key, value in {**overrides, "num_hidden_layers": layers}.items():
        setattr(config, key, value)
    if hasattr(config, "layer_types") and config.layer_types is not None:
        config.layer_types = [config.layer_types[i % len(config.layer_types)] for i in range(layers)]
    with _SEEDED:  # threaded ranks share torch's generator: one seeded build at a time, the same weights on each
        torch.manual_seed(0)
        model: nn.Module = AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    return model.float()


def batch(kind: str, seq: int, vocab: int = 128) -> dict[str, torch.Tensor]:
    """A whole batch of 2 rows: ``padded`` (row 1 left-padded by 3), ``ragged`` (row 0 right-padded by
    ``seq // 8``, row 1 left-padded by 3), ``leftpad`` (both rows left-padded by 4: the first 4 positions' queries
    see no key in any row), ``packed`` (documents of 3 lengths) or ``plain`` (ids and labels alone)."""
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(seq))
    labels = ids.clone()
    if kind == "plain":
        return {"input_ids": ids, "labels": labels}
    if kind in ("padded", "ragged", "leftpad"):
        mask = torch.ones(2, seq, dtype=torch.long)
        mask[1, :3] = 0
        if kind == "leftpad":
            mask[:, :4] = 0
        if kind == "ragged":
            mask[0, seq - seq // 8:] = 0
        labels[mask == 0] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    cuts = (seq // 3, seq // 3 + seq // 4)
    positions = torch.arange(seq).expand(2, seq).clone()
    for row, shift in ((0, 0), (1, 2)):
        for cut in cuts:
            c = cut + shift
            positions[row, c:] = torch.arange(seq - c)
            labels[row, c] = -100  # a document's first token is predicted by no token of its own document
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def matches(case: Case, got: dict[str, Any], tol: float = 1e-5) -> None:
    """``run_case``'s differences within ``tol`` (gradients relative to the largest one); a tiled loss returns no
    logits, and its output head never took more than a chunk of positions."""
    assert got["loss"] <= tol, got  # the whole loss, on every rank
    if case.loss_chunk:
        assert got["logits"] is None and 1 <= got["head"] <= case.loss_chunk, got
    else:
        assert got["logits"] is not None and got["logits"] <= tol, got
    assert got["grad"] <= tol * max(1.0, got["scale"]), got


def named(fn: Callable[..., Any], case: Case, *args: Any, **kwargs: Any) -> Any:
    """``fn(case, ...)``, an error re-raised with the case's name (one failing case ends the whole spawn)."""
    try:
        return fn(case, *args, **kwargs)
    except Exception as e:
        raise RuntimeError(f"context case {case.name} failed: {type(e).__name__}: {e}") from e


def _differ(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest ``|got - want|``, a NaN where one process has one counting as equal (a causal LM's loss over a
    sequence of one token has no label: one process divides 0 by 0)."""
    both = torch.isnan(got) & torch.isnan(want)
    return float(torch.where(both, torch.zeros_like(got), (got - want).abs()).max())


def _grads(model: nn.Module) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    def whole(g: torch.Tensor) -> torch.Tensor:
        return g.full_tensor() if isinstance(g, DTensor) else g

    return torch.cat([(whole(p.grad) if p.grad is not None else torch.zeros(p.shape)).reshape(-1)
                      for p in model.parameters()])


class _Squares(TorchDispatchMode):
    """The largest ``min(shape[-2], shape[-1])`` of any tensor an op returns while active: a ``[.., q, k]`` mask
    or score table of ``q`` queries and ``k`` keys reads ``min(q, k)``; activations ``[.., tokens, features]``
    read their feature size."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                self.largest = max(self.largest, min(int(t.shape[-2]), int(t.shape[-1])))
        return out


def run_case(case: Case, mesh: Any, layers: int = 2, count: bool = False, plan: Any = None,
             experts: str = "tp", squares: bool = False) -> dict[str, Any]:
    """Largest differences from one process: ``loss`` (this rank's), ``logits``, ``grad`` (every parameter's).

    With ``count``, also the collectives of the context-parallel forward and backward (``counts``); ``plan``: the
    tensor-parallel plan beside ``context="cp"`` (a mesh with a ``tp`` axis); with ``squares``, the largest
    ``[.., q, k]`` extent any tensor of the context-parallel step has (:class:`_Squares`, ``square``). With the
    case's ``loss_chunk``, ``logits`` is ``None`` when the model returned none, and ``head`` the most positions
    its output head took in one call.
    """
    import tplower
    from tplower.context import gather_sequence, shard_sequence

    ref = tiny(case.model, case.impl, layers)
    model = tplower.parallelize(copy.deepcopy(ref), mesh, plan, context="cp", context_mode=case.mode,
                                experts=experts, context_loss_chunk=case.loss_chunk, context_ulysses=case.ulysses)
    widths = [0]
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: widths.append(int(out.shape[1])))
    whole = batch(case.batch, case.seq)
    want = ref(**whole, use_cache=False)
    want.loss.backward()
    part = shard_sequence(whole, mesh, "cp", balance=case.balance)
    traffic, tables = CollectiveTraffic(), _Squares()
    with traffic if count else contextlib.nullcontext(), tables if squares else contextlib.nullcontext():
        out = model(**part)
        out.loss.backward()
    logits = None if out.logits is None else float(
        (gather_sequence(out.logits.detach(), mesh, "cp", split=part) - want.logits.detach()).abs().max())
    grads = _grads(model)
    # a gradient where one process has none (or none where it has one) is wrong whatever its values: optimizers
    # decay and move a parameter with a zero gradient, and leave one without a gradient alone
    kinds_differ = any((p.grad is None) != (q.grad is None)
                       for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    return {"loss": _differ(out.loss.detach(), want.loss.detach()), "logits": logits, "head": max(widths),
            "grad": math.inf if kinds_differ else float((grads - _grads(ref)).abs().max()),
            "scale": float(_grads(ref).abs().max()),
            "counts": dict(traffic.counts), "sent": traffic.sent, "square": tables.largest,
            "sent_by_kind": {kind: sum(b for (_, k), (_, b) in traffic.by_group.items() if k == kind)
                             for kind in traffic.counts}}
