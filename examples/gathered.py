"""A two-module model whose plan is easy to get wrong: the model ``tplower verify`` is shown on.

``gather`` receives an activation sharded on its dim 1 (the sequence) and gathers it (``S(1) -> R``), and ``proj``
is a column-sharded linear layer, so the output stays sharded on its last dim (``S(2)``). The gathered activation
meets a sharded weight, so each rank's gradient at the gather is a partial sum: the gather's entry needs
``in_grad: P(sum)``. ``examples/plans/gathered_wrong.json`` leaves it out (the default, ``R``);
``examples/plans/gathered.json`` declares it. Check either on 2 local processes::

    PYTHONPATH=examples tplower verify --module gathered:Gathered --plan examples/plans/gathered_wrong.json \\
        --input-placement '0=S(1)' --output-placement 'S(2)'
"""

from __future__ import annotations

import torch
from torch import nn

D, H = 8, 16  # model width, the projection's output features (sharded over tp)


class Gathered(nn.Module):
    """``proj(gather(x))``: ``[B, S, D] -> [B, S, H]``; ``gather`` is an identity the plan places a move on."""

    def __init__(self) -> None:
        super().__init__()
        self.gather, self.proj = nn.Identity(), nn.Linear(D, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S, D] -> [B, S, H]``."""
        return self.proj(self.gather(x))


def example_inputs() -> torch.Tensor:
    """The whole input ``[2, 4, D]``, the same on every rank (``tplower verify`` shards it by the input placement)."""
    return torch.randn(2, 4, D, generator=torch.Generator().manual_seed(1))
