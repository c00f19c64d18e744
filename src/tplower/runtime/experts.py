"""Expert parallelism inside a module boundary: the experts module's compute between dispatch and combine.

An entry with ``expert_dispatch`` (the style ``ep_dispatch_experts``) takes the
experts module's ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``
as this rank's piece of the tokens (the boundary chunks replicated inputs
``R -> S(0)`` and gathers the output ``S(0) -> R``), and runs
:class:`ExpertDispatch` as its local compute:

1. :func:`tplower.core.ops.dispatch.plan_dispatch` on the axis's process group,
2. :func:`tplower.core.ops.dispatch.dispatch_tokens`: each token's copy per slot goes
   to the rank holding that slot's expert,
3. the module's own ``forward`` on the rows it received, with the local expert
   of each row as its only slot (weight 1) — the module holds ``E/n`` experts
   (``Shard(0)`` on the expert dim, ``num_experts`` divided at install), so
   whatever experts implementation it selects runs unchanged,
4. :func:`tplower.core.ops.dispatch.combine_tokens`: the rows go back and each
   token's slots are summed with the routing weights. It is given the
   dispatched rows too, so the dispatch's backward exchange runs on every
   rank, also where the module's result does not depend on its rows (an
   implementation that skips experts with no row, on a rank that got none).

Each expert's gradient collects every token routed to it, so the expert weights'
gradients are whole on their rank (no reduction); the hidden states' and the
routing weights' gradients come back through the same exchanges.

Under ``torch.compile`` the same steps run as
:func:`tplower.core.ops.dispatch_traced.traced_experts`: the counts stay tensors
and the exchange is one operator whose row count the trace leaves unbacked,
so a train step traces as one graph for every routing (no graph break, no
recompile), with the eager dispatch's rows and bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.lower.redistribute import MeshLowerer
from ..core.ops.dispatch import combine_tokens, dispatch_tokens, plan_dispatch
from ..core.ops.dispatch_traced import traced_experts
from ..core.support.errors import TPLowerError

__all__ = ["ExpertDispatch"]


class ExpertDispatch:
    """The local compute of an expert-parallel experts module (see the module docstring).

    Args:
        forward: the module's own ``forward(hidden_states, top_k_index, top_k_weights)``.
        num_experts: ``E``, the experts over the whole axis.
        lowerer: the mesh's lowerer (its group is looked up per call, so a
            destroyed group is never kept alive here).
        axis: the mesh axis index the experts are sharded over.
        module: the module's name, for messages.

    Raises:
        TPLowerError: (at call) a call without the routing indices and weights.
    """

    def __init__(self, forward: Callable[..., Any], num_experts: int, lowerer: MeshLowerer, axis: int,
                 module: str) -> None:
        self.forward, self.num_experts, self.lowerer, self.axis, self.module = (
            forward, num_experts, lowerer, axis, module)
        order, coord = lowerer.orders[axis], lowerer.coord[axis]
        #: this rank's rank in the axis's process group (the experts it holds: ``rank * E/n ..``)
        self.group_rank = coord if order is None else order[coord]

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                 top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        if top_k_index is None or top_k_weights is None:
            raise TPLowerError(f"module {self.module!r}: expert parallelism needs the routing indices and weights "
                               "as its second and third inputs (forward(hidden_states, top_k_index, "
                               "top_k_weights))")
        if torch.compiler.is_compiling():
            return traced_experts(self.forward, hidden_states, top_k_index, top_k_weights, self.num_experts,
                                  self.lowerer.shape[self.axis], self.group_rank, self.lowerer.groups[self.axis])
        plan = plan_dispatch(top_k_index, self.num_experts, self.lowerer.groups[self.axis])
        rows = dispatch_tokens(hidden_states, plan)
        ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        out = self.forward(rows, plan.local_experts[:, None], ones)
        return combine_tokens(out, plan, top_k_weights, dispatched=rows)
