"""tplower: placement transitions on a device mesh, lowered to direct differentiable collectives.

The fast path beside DTensor's ``redistribute``: the same answers, forward
and backward, on plain local tensors.

The names below are imported on first use (PEP 562), so that ``import
tplower`` and the ``tplower`` command's ``--help`` do not load torch; ``from
tplower import parallelize`` and ``tplower.parallelize`` work as before.
Every subpackage is an attribute too, imported on first use:
``tplower.codegen.emit(...)``, ``tplower.verification.derived.verify_derived(...)``.
``tplower.verify`` is the verifier's function; its modules live in the
package ``tplower.verification``.

At interpreter exit, a default process group the script left initialized is
destroyed (a local call, no collective) and what tplower holds is released
(:mod:`tplower.core.support.teardown`), so a script that forgets
``destroy_process_group()`` still exits cleanly.
"""

from __future__ import annotations

import atexit
import sys
from typing import TYPE_CHECKING

from ._lazy import lazy_exports
from ._version import __version__

if TYPE_CHECKING:
    from .context.sequence import gather_sequence, shard_sequence
    from .core.language.placements import (
        format_placement,
        format_placements,
        parse_placement,
        parse_placements,
        replicate_partials,
    )
    from .core.language.transitions import Step, TransitionPlan, classify_axis, plan_steps, plan_transition
    from .core.lower.cache import set_cache_size
    from .core.lower.lowering import (
        TPCollectiveLowerer,
        TPExecutionOp,
        classify_tp_transition,
        create_tp_collective_lowerer,
    )
    from .core.lower.redistribute import MeshLowerer, mesh_lowerer, redistribute_local
    from .core.ops.dispatch import DispatchPlan, all_to_all_splits, combine_tokens, dispatch_tokens, plan_dispatch
    from .core.ops.vocab_loss import vocab_parallel_cross_entropy
    from .core.support.errors import TPLowerError, TPLowerTypeError
    from .core.support.teardown import shutdown
    from .nn.parallelize import parallelize
    from .planner.search import LayoutCandidate, plan_layout
    from .plans.entries import BoundaryEntry, load_plan
    from .plans.forms import BoundaryForm, classify_boundary_form, explain_plan_lines
    from .plans.hf import plan_for
    from .runtime.grad_sums import sum_context_in_fsdp
    from .runtime.operators import TPOperators
    from .state.full_state import full_state_dict
    from .state.loading import load_safetensors
    from .verification.report import VerifyReport
    from .verification.verifier import verify

#: public name -> the module that defines it
_HOMES: dict[str, str] = {
    "gather_sequence": ".context.sequence",
    "shard_sequence": ".context.sequence",
    "set_cache_size": ".core.lower.cache",
    "DispatchPlan": ".core.ops.dispatch",
    "all_to_all_splits": ".core.ops.dispatch",
    "combine_tokens": ".core.ops.dispatch",
    "dispatch_tokens": ".core.ops.dispatch",
    "plan_dispatch": ".core.ops.dispatch",
    "TPLowerError": ".core.support.errors",
    "TPLowerTypeError": ".core.support.errors",
    "TPCollectiveLowerer": ".core.lower.lowering",
    "TPExecutionOp": ".core.lower.lowering",
    "classify_tp_transition": ".core.lower.lowering",
    "create_tp_collective_lowerer": ".core.lower.lowering",
    "format_placement": ".core.language.placements",
    "format_placements": ".core.language.placements",
    "parse_placement": ".core.language.placements",
    "parse_placements": ".core.language.placements",
    "replicate_partials": ".core.language.placements",
    "MeshLowerer": ".core.lower.redistribute",
    "mesh_lowerer": ".core.lower.redistribute",
    "redistribute_local": ".core.lower.redistribute",
    "shutdown": ".core.support.teardown",
    "Step": ".core.language.transitions",
    "TransitionPlan": ".core.language.transitions",
    "classify_axis": ".core.language.transitions",
    "plan_steps": ".core.language.transitions",
    "plan_transition": ".core.language.transitions",
    "vocab_parallel_cross_entropy": ".core.ops.vocab_loss",
    "parallelize": ".nn.parallelize",
    "LayoutCandidate": ".planner.search",
    "plan_layout": ".planner.search",
    "BoundaryEntry": ".plans.entries",
    "load_plan": ".plans.entries",
    "BoundaryForm": ".plans.forms",
    "classify_boundary_form": ".plans.forms",
    "explain_plan_lines": ".plans.forms",
    "plan_for": ".plans.hf",
    "TPOperators": ".runtime.operators",
    "sum_context_in_fsdp": ".runtime.grad_sums",
    "full_state_dict": ".state.full_state",
    "load_safetensors": ".state.loading",
    "VerifyReport": ".verification.report",
    "verify": ".verification.verifier",
}

__all__ = [
    "BoundaryEntry",
    "BoundaryForm",
    "DispatchPlan",
    "LayoutCandidate",
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
    "plan_for",
    "plan_layout",
    "plan_steps",
    "plan_transition",
    "redistribute_local",
    "replicate_partials",
    "set_cache_size",
    "shard_sequence",
    "shutdown",
    "sum_context_in_fsdp",
    "verify",
    "vocab_parallel_cross_entropy",
]


__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals(), subpackages=True)


def _exit_hook() -> None:
    """tplower's teardown at interpreter exit, when torch.distributed was loaded at all (registered at ``import
    tplower``, so it runs before the exit handlers of what was imported earlier)."""
    if "torch.distributed" in sys.modules:
        from .core.support import teardown

        teardown._at_exit()


atexit.register(_exit_hook)
