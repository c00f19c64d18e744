"""The small pre-norm MLP block several test files parallelize, and its plans.

``x + down(gelu(up(norm(x))))`` with hidden size 8 and 16 intermediate
features: a norm (replicated, its gradient partial under sequence
parallelism), a column-parallel and a row-parallel linear with biases. Kept
in one place so every test of the training stack, compile, uneven lengths
and the cache soak runs the same model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

D, H = 8, 16

#: Megatron's plain plan: activations replicated between blocks.
PLAIN: dict[str, Any] = {"up": "colwise", "down": "rowwise"}
#: Sequence parallelism: activations sharded on the sequence dim (1) between blocks.
SP: dict[str, Any] = {"norm": "sequence_parallel", "up": {"style": "colwise", "in_src": {"0": {"tp": "S(1)"}}},
                      "down": {"style": "rowwise", "out_dst": {"out": {"tp": "S(1)"}}}}


class Block(nn.Module):
    """x + down(gelu(up(norm(x)))): a pre-norm MLP block, optionally under activation checkpointing."""

    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, H), nn.Linear(H, D)
        self.ckpt = ckpt

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt:
            return x + checkpoint(self._mlp, x, use_reentrant=False)
        return x + self._mlp(x)
