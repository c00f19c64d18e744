"""The architecture table's derive column: ``parallelize(model, mesh, "derive")`` on every decoder of the table.

Each architecture's tiny model (:func:`tplower.run.hf_configs.tiny_model`) is parallelized by the plan
:func:`tplower.plans.derive.derive_plan` makes from its module structure at the table's tp, not by the plan
transformers ships, and checked as the shipped plan's column is (:func:`tplower.run.compare.compare_training`:
logits, every gradient, replicated gradients equal across ranks). Both columns count the bytes each rank sends
in the step (:class:`tplower.core.lower.traffic.CollectiveTraffic`), so a row also says how the derived plan's bytes
compare with the shipped plan's (:func:`byte_ratio`; only where both pass).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch

from .compare import Outcome, compare_training
from .hf_configs import Arch, tiny_model

__all__ = ["byte_counts", "byte_ratio", "derive_cell", "derive_side"]


def derive_side(arch: Arch, mesh: Any, ids: torch.Tensor, vocab_size: int | None = None) -> Outcome:
    """``arch``'s tiny model under ``parallelize(..., "derive")`` against one process, bytes counted."""
    from ..nn.parallelize import parallelize

    ref = tiny_model(arch, vocab_size)
    tp = parallelize(copy.deepcopy(ref), mesh, "derive")
    return compare_training(tp, ref, ids, count=True)


def byte_ratio(derived: Outcome, shipped: Outcome) -> float | None:
    """The derived plan's bytes per step over the shipped plan's, where both pass and the shipped plan sends any."""
    if derived.status != "pass" or shipped.status != "pass" or derived.sent is None or not shipped.sent:
        return None
    return derived.sent / shipped.sent


def derive_cell(derived: Outcome, shipped: Outcome) -> str:
    """The derive column's cell: the outcome, then the bytes against the shipped plan's (``0.50x bytes``)."""
    ratio = byte_ratio(derived, shipped)
    return derived.cell() if ratio is None else f"{derived.cell()}; {ratio:.2f}x bytes"


def byte_counts(pairs: Iterable[tuple[Outcome, Outcome]]) -> dict[str, int]:
    """Over ``(derived, shipped)`` pairs where both pass with bytes counted: how many send ``fewer``, the
    ``same`` or ``more`` bytes under the derived plan, and the two plans' ``derived_bytes``/``shipped_bytes``
    summed (per rank, the largest rank's)."""
    out = {"fewer": 0, "same": 0, "more": 0, "derived_bytes": 0, "shipped_bytes": 0}
    for derived, shipped in pairs:
        if derived.status != "pass" or shipped.status != "pass" or derived.sent is None or shipped.sent is None:
            continue
        out["fewer" if derived.sent < shipped.sent else "more" if derived.sent > shipped.sent else "same"] += 1
        out["derived_bytes"] += derived.sent
        out["shipped_bytes"] += shipped.sent
    return out
