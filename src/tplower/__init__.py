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
(:mod:`tplower.core.teardown`), so a script that forgets
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
    from .core.cache import set_cache_size
    from .core.dispatch import DispatchPlan, all_to_all_splits, combine_tokens, dispatch_tokens, plan_dispatch
    from .core.errors import TPLowerError, TPLowerTypeError
    from .core.lowering import TPCollectiveLowerer, TPExecutionOp, classify_tp_transition, create_tp_collective_lowerer
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

#: public name -> the module that defines it
_HOMES: dict[str, str] = {
    "gather_sequence": ".context.sequence",
    "shard_sequence": ".context.sequence",
    "set_cache_size": ".core.cache",
    "DispatchPlan": ".core.dispatch",
    "all_to_all_splits": ".core.dispatch",
    "combine_tokens": ".core.dispatch",
    "dispatch_tokens": ".core.dispatch",
    "plan_dispatch": ".core.dispatch",
    "TPLowerError": ".core.errors",
    "TPLowerTypeError": ".core.errors",
    "TPCollectiveLowerer": ".core.lowering",
    "TPExecutionOp": ".core.lowering",
    "classify_tp_transition": ".core.lowering",
    "create_tp_collective_lowerer": ".core.lowering",
    "format_placement": ".core.placements",
    "format_placements": ".core.placements",
    "parse_placement": ".core.placements",
    "parse_placements": ".core.placements",
    "replicate_partials": ".core.placements",
    "MeshLowerer": ".core.redistribute",
    "mesh_lowerer": ".core.redistribute",
    "redistribute_local": ".core.redistribute",
    "shutdown": ".core.teardown",
    "Step": ".core.transitions",
    "TransitionPlan": ".core.transitions",
    "classify_axis": ".core.transitions",
    "plan_steps": ".core.transitions",
    "plan_transition": ".core.transitions",
    "vocab_parallel_cross_entropy": ".core.vocab_loss",
    "parallelize": ".nn.parallelize",
    "BoundaryEntry": ".plans.entries",
    "load_plan": ".plans.entries",
    "BoundaryForm": ".plans.forms",
    "classify_boundary_form": ".plans.forms",
    "explain_plan_lines": ".plans.forms",
    "TPOperators": ".runtime.operators",
    "full_state_dict": ".state.full_state",
    "load_safetensors": ".state.loading",
    "VerifyReport": ".verification.report",
    "verify": ".verification.verifier",
}

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


__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals(), subpackages=True)


def _exit_hook() -> None:
    """tplower's teardown at interpreter exit, when torch.distributed was loaded at all (registered at ``import
    tplower``, so it runs before the exit handlers of what was imported earlier)."""
    if "torch.distributed" in sys.modules:
        from .core import teardown

        teardown._at_exit()


atexit.register(_exit_hook)
