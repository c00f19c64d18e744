"""What ``tplower run`` computes with a model: batches, the compared output, the training loss.

Two tasks (:attr:`tplower.run.models.ModelSpec.task`):

* ``embedding`` (all-MiniLM-L6-v2): mean-pooled, L2-normalised embeddings;
  training is an in-batch contrastive loss (InfoNCE) on sentence pairs.
* ``causal_lm`` (llama-tiny): logits; training is next-token cross entropy
  on UTF-8 bytes (a byte is a token).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .models import LLAMA_TINY_CONFIG

__all__ = ["contrastive_loss", "make_batch", "mean_pool", "model_output", "training_loss"]


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``hidden`` ``[B, T, H]`` over the tokens where ``mask`` ``[B, T]`` is 1, L2-normalised: ``[B, H]``."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return F.normalize(pooled, p=2, dim=-1)


def contrastive_loss(a: torch.Tensor, b: torch.Tensor, temperature: float = 0.5) -> torch.Tensor:
    """InfoNCE on pairs: row ``i`` of ``a`` ``[P, H]`` should match row ``i`` of ``b`` and no other; a scalar."""
    logits = a @ b.T / temperature
    return F.cross_entropy(logits, torch.arange(a.shape[0], device=a.device))


def make_batch(name: str, tokenizer: Any, texts: Sequence[str], device: str | torch.device = "cpu",
               max_length: int = 128) -> dict[str, torch.Tensor]:
    """Token ids and attention mask of ``texts``, right-padded to the longest: ``[B, T]`` int64 each.

    all-MiniLM-L6-v2 uses its WordPiece tokenizer (truncating at
    ``max_length`` tokens); llama-tiny reads UTF-8 bytes as token ids.
    """
    if tokenizer is not None:
        enc = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)}
    rows = [list(t.encode("utf-8"))[:max_length] for t in texts]
    width = max(len(r) for r in rows)
    pad = int(LLAMA_TINY_CONFIG["pad_token_id"])
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.int64)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def model_output(task: str, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """What the forward check compares: ``embedding`` embeddings ``[B, H]``, ``causal_lm`` logits ``[B, T, V]``."""
    if task == "embedding":
        hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        return mean_pool(hidden, batch["attention_mask"])
    out: torch.Tensor = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return out


def training_loss(task: str, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The scalar training loss of one batch.

    ``embedding``: the batch holds pairs ``[a0, b0, a1, b1, ...]``;
    :func:`contrastive_loss` of the ``a`` rows against the ``b`` rows.
    ``causal_lm``: next-token cross entropy, padding ignored.
    """
    if task == "embedding":
        emb = model_output(task, model, batch)
        return contrastive_loss(emb[0::2], emb[1::2])
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    loss: torch.Tensor = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               labels=labels).loss
    return loss
