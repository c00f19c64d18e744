"""tplower: placement transitions on a device mesh, lowered to direct differentiable collectives.

The fast path beside DTensor's ``redistribute``: the same answers, forward
and backward, on plain local tensors.
"""

from __future__ import annotations

from .boundaries import BoundaryForm, TPOperators, classify_boundary_form, explain_plan_lines
from .cache import set_cache_size
from .errors import TPLowerError, TPLowerTypeError
from .lowering import (
    TPCollectiveLowerer,
    TPExecutionOp,
    classify_tp_transition,
    create_tp_collective_lowerer,
)
from .parallelize import parallelize
from .placements import (
    format_placement,
    format_placements,
    parse_placement,
    parse_placements,
    replicate_partials,
)
from .plans import BoundaryEntry, load_plan
from .redistribute import MeshLowerer, mesh_lowerer, redistribute_local
from .transitions import Step, TransitionPlan, classify_axis, plan_steps, plan_transition
from .verify import verify
from .verify_report import VerifyReport

__version__ = "0.1.0"

__all__ = [
    "BoundaryEntry",
    "BoundaryForm",
    "MeshLowerer",
    "Step",
    "TPCollectiveLowerer",
    "TPExecutionOp",
    "TPLowerError",
    "TPLowerTypeError",
    "TPOperators",
    "TransitionPlan",
    "VerifyReport",
    "__version__",
    "classify_axis",
    "classify_boundary_form",
    "classify_tp_transition",
    "create_tp_collective_lowerer",
    "explain_plan_lines",
    "format_placement",
    "format_placements",
    "load_plan",
    "mesh_lowerer",
    "parallelize",
    "parse_placement",
    "parse_placements",
    "plan_steps",
    "plan_transition",
    "redistribute_local",
    "replicate_partials",
    "set_cache_size",
    "verify",
]
