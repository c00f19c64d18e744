"""tplower: placement transitions on a device mesh, lowered to direct differentiable collectives.

The fast path beside DTensor's ``redistribute``: the same answers, forward
and backward, on plain local tensors.
"""

from __future__ import annotations

from .errors import TPLowerError
from .lowering import (
    TPCollectiveLowerer,
    TPExecutionOp,
    classify_tp_transition,
    create_tp_collective_lowerer,
)
from .placements import (
    format_placement,
    format_placements,
    parse_placement,
    parse_placements,
    replicate_partials,
)
from .redistribute import MeshLowerer, mesh_lowerer, redistribute_local
from .transitions import Step, TransitionPlan, classify_axis, plan_steps, plan_transition

__version__ = "0.1.0"

__all__ = [
    "MeshLowerer",
    "Step",
    "TPCollectiveLowerer",
    "TPExecutionOp",
    "TPLowerError",
    "TransitionPlan",
    "__version__",
    "classify_axis",
    "classify_tp_transition",
    "create_tp_collective_lowerer",
    "format_placement",
    "format_placements",
    "mesh_lowerer",
    "parse_placement",
    "parse_placements",
    "plan_steps",
    "plan_transition",
    "redistribute_local",
    "replicate_partials",
]
