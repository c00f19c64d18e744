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

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tplower.core.lower.traffic import CollectiveTraffic
from tplower.run.hf_configs import tiny_config

#: model kinds: (model_type, config overrides). Sliding windows (8) are shorter than every sequence.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),  # GQA: 4 query heads, 2 key/value heads
    "llama_mqa": ("llama", {"num_key_value_heads": 1}),  # fewer key/value heads than cp: repeated under Ulysses
    "llama_h3": ("llama", {"num_attention_heads": 3, "num_key_value_heads": 1, "hidden_size": 48}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {"sliding_window": 8}),
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
    """One comparison: ``batch`` is ``"padded"`` (left padding, ``attention_mask``), ``"packed"`` (position ids
    restarting per document, no mask: transformers finds the documents from the positions) or ``"plain"``."""

    model: str
    mode: str
    impl: str
    seq: int
    balance: bool
    batch: str

    @property
    def name(self) -> str:
        return f"{self.model}-{self.mode}-{self.impl}-{self.seq}-{'bal' if self.balance else 'even'}-{self.batch}"


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
    """A whole batch of 2 rows: ``padded`` (row 1 left-padded by 3), ``packed`` (documents of 3 lengths) or
    ``plain`` (ids and labels alone)."""
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(seq))
    labels = ids.clone()
    if kind == "plain":
        return {"input_ids": ids, "labels": labels}
    if kind == "padded":
        mask = torch.ones(2, seq, dtype=torch.long)
        mask[1, :3] = 0
        labels[1, :3] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    cuts = (seq // 3, seq // 3 + seq // 4)
    positions = torch.arange(seq).expand(2, seq).clone()
    for row, shift in ((0, 0), (1, 2)):
        for cut in cuts:
            c = cut + shift
            positions[row, c:] = torch.arange(seq - c)
            labels[row, c] = -100  # a document's first token is predicted by no token of its own document
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def named(fn: Callable[..., Any], case: Case, *args: Any, **kwargs: Any) -> Any:
    """``fn(case, ...)``, an error re-raised with the case's name (one failing case ends the whole spawn)."""
    try:
        return fn(case, *args, **kwargs)
    except Exception as e:
        raise RuntimeError(f"context case {case.name} failed: {type(e).__name__}: {e}") from e


def _grads(model: nn.Module) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    def whole(g: torch.Tensor) -> torch.Tensor:
        return g.full_tensor() if isinstance(g, DTensor) else g

    return torch.cat([(whole(p.grad) if p.grad is not None else torch.zeros(p.shape)).reshape(-1)
                      for p in model.parameters()])


def run_case(case: Case, mesh: Any, layers: int = 2, count: bool = False, plan: Any = None,
             experts: str = "tp") -> dict[str, Any]:
    """Largest differences from one process: ``loss`` (this rank's), ``logits``, ``grad`` (every parameter's).

    With ``count``, also the collectives of the context-parallel forward and backward (``counts``); ``plan``: the
    tensor-parallel plan beside ``context="cp"`` (a mesh with a ``tp`` axis).
    """
    import tplower
    from tplower.context import gather_sequence, shard_sequence

    ref = tiny(case.model, case.impl, layers)
    model = tplower.parallelize(copy.deepcopy(ref), mesh, plan, context="cp", context_mode=case.mode,
                                experts=experts)
    whole = batch(case.batch, case.seq)
    want = ref(**whole, use_cache=False)
    want.loss.backward()
    part = shard_sequence(whole, mesh, "cp", balance=case.balance)
    traffic = CollectiveTraffic()
    if count:
        with traffic:
            out = model(**part)
            out.loss.backward()
    else:
        out = model(**part)
        out.loss.backward()
    logits = gather_sequence(out.logits.detach(), mesh, "cp", balance=case.balance)
    grads = _grads(model)
    return {"loss": float((out.loss.detach() - want.loss.detach()).abs()),
            "logits": float((logits - want.logits.detach()).abs().max()),
            "grad": float((grads - _grads(ref)).abs().max()),
            "scale": float(_grads(ref).abs().max()),
            "counts": dict(traffic.counts), "sent": traffic.sent}
