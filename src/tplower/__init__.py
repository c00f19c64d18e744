"""tplower: placement transitions on a device mesh, lowered to direct differentiable collectives.

The fast path beside DTensor's ``redistribute``: the same answers, forward
and backward, on plain local tensors.

The names below are the public API. Every subpackage is an attribute too,
imported on first use so that ``import tplower`` stays quick:
``tplower.codegen.emit(...)``, ``tplower.verification.derived.verify_derived(...)``.
``tplower.verify`` is the verifier's function; its modules live in the
package ``tplower.verification``.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import TYPE_CHECKING

from ._version import __version__
from .context.sequence import gather_sequence, shard_sequence
from .core.cache import set_cache_size
from .core.dispatch import DispatchPlan, all_to_all_splits, combine_tokens, dispatch_tokens, plan_dispatch
from .core.errors import TPLowerError, TPLowerTypeError
from .core.lowering import (
    TPCollectiveLowerer,
    TPExecutionOp,
    classify_tp_transition,
    create_tp_collective_lowerer,
)
from .core.placements import (
    format_placement,
    format_placements,
    parse_placement,
    parse_placements,
    replicate_partials,
)
from .core.redistribute import MeshLowerer, mesh_lowerer, redistribute_local
from .core.teardown import shutdown
from .core.transitions import Step, TransitionPlan, classify_axis, plan_steps, plan_transition
from .core.vocab_loss import vocab_parallel_cross_entropy
from .nn.parallelize import parallelize
from .plans.entries import BoundaryEntry, load_plan
from .plans.forms import BoundaryForm, classify_boundary_form, explain_plan_lines
from .runtime.operators import TPOperators
from .state.full_state import full_state_dict
from .state.loading import load_safetensors
from .verification.report import VerifyReport
from .verification.verifier import verify

__all__ = [
    "BoundaryEntry",
    "BoundaryForm",
    "DispatchPlan",
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
    "all_to_all_splits",
    "classify_axis",
    "classify_boundary_form",
    "classify_tp_transition",
    "combine_tokens",
    "create_tp_collective_lowerer",
    "dispatch_tokens",
    "explain_plan_lines",
    "format_placement",
    "format_placements",
    "full_state_dict",
    "gather_sequence",
    "load_plan",
    "load_safetensors",
    "mesh_lowerer",
    "parallelize",
    "parse_placement",
    "parse_placements",
    "plan_dispatch",
    "plan_steps",
    "plan_transition",
    "redistribute_local",
    "replicate_partials",
    "set_cache_size",
    "shard_sequence",
    "shutdown",
    "verify",
    "vocab_parallel_cross_entropy",
]


if TYPE_CHECKING:  # type checkers see the named modules; any other attribute stays an error for them
    from . import codegen as codegen  # the attribute, imported on first use at run time
else:

    def __getattr__(name: str) -> ModuleType:
        """A subpackage or module of tplower named as an attribute (``tplower.codegen``), imported on first use.

        Raises:
            AttributeError: ``name`` is neither a public name nor a module of tplower.
        """
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
