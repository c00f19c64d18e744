"""A boundary whose forward raised (a plan so wrong that shapes no longer fit) as a finding, not a traceback.

:func:`tplower.verify` records each boundary call that has begun and not
returned (:class:`~tplower.verification.record.OpenCall`); when the parallel
forward raises, the innermost one is where. :func:`raised_check` turns it into
a failed :class:`~tplower.verification.report.Check`: the module, the
exception, the local shapes and declared placements that met there, the
module's parameters, and for a linear layer the likely cause and fix.
"""

from __future__ import annotations

import math

from torch import nn
from torch.distributed.tensor import DTensor

from ..core.language.placements import format_placements
from .record import OpenCall
from .report import Check

__all__ = ["raised_check"]


def _inputs_text(call: OpenCall) -> str:
    seen = call.computed if call.computed else call.received
    where = "its compute got" if call.computed else "it received"
    items = [f"input {name!r} of local shape {tuple(shape)} declared {place}" for name, shape, place in seen]
    return f"{where} " + ("; ".join(items) if items else "no tensor input")


def _params_text(module: nn.Module) -> str:
    items = []
    for name, p in module.named_parameters(recurse=False):
        if isinstance(p, DTensor):
            local, place = tuple(p.to_local().shape), format_placements(p.placements)
            items.append(f"{name} {local} of {tuple(p.shape)} placed {place}")
        else:
            items.append(f"{name} {tuple(p.shape)} whole")
    return "parameters: " + (", ".join(items) if items else "none of its own")


def _linear_cause(module: nn.Module, call: OpenCall, world: int) -> tuple[str | None, str | None]:
    """For a module with a 2-D ``weight`` (``[out, in]``): which side of the input features disagrees, and the fix."""
    weight = module._parameters.get("weight")
    seen = call.computed if call.computed else call.received
    if weight is None or weight.ndim != 2 or not seen:
        return None, None
    local_in = (weight.to_local() if isinstance(weight, DTensor) else weight).shape[1]
    full_in = weight.shape[1]
    got = seen[0][1][-1] if seen[0][1] else None
    if got is None or got == local_in:
        return None, None
    piece = math.ceil(full_in / world)
    q = call.module
    if local_in == full_in and got in (piece, full_in // world):
        return (f"its input arrives sharded on the last dim ({got} of {full_in} features on each rank, what a "
                "colwise module before it leaves), but its entry takes the whole input (its weight holds all "
                f"{full_in} input features)",
                f"plan {q!r} as rowwise (it takes an input sharded on its last dim and sums the partial outputs), or "
                "make the module before it colwise_gather_output")
    if got == full_in and local_in in (piece, full_in // world):
        return (f"its input arrives whole ({full_in} features), but its weight is sharded on the input features "
                f"({local_in} on each rank: rowwise)",
                f"plan the module before {q!r} as colwise (its output then arrives sharded on the last dim), or plan "
                f"{q!r} as colwise")
    return (f"its input has {got} features on each rank, its weight takes {local_in} (of {full_in})",
            "declare the placements the module before it produces as this entry's input placements")


def raised_check(model: nn.Module, call: OpenCall, exc: BaseException, world: int, order: int) -> Check:
    """The failed check of a boundary whose forward raised ``exc``.

    Args:
        model: the parallel model (its module ``call.module`` is read for parameter shapes).
        call: the innermost open boundary call when ``exc`` was raised.
        exc: the exception.
        world: ranks of the mesh axis.
        order: the check's place in forward order.

    Returns:
        A :class:`Check` of phase ``forward``, ``ok=False``, ``max_diff=inf``, whose ``error`` is the exception,
        ``tensor`` the shapes and placements that met and the parameters, and ``cause``/``suggestion`` the
        likely cause and fix where the module is a linear layer.
    """
    module = dict(model.named_modules())[call.module]
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    error = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    cause, suggestion = _linear_cause(module, call, world)
    what = f"forward raised ({call.form}, {type(module).__name__}); {_inputs_text(call)}; {_params_text(module)}"
    places = ",".join(sorted({place for _, _, place in (call.computed or call.received)})) or "-"
    return Check("forward", call.module, what, places, math.inf, False,
                 cause or "the local shapes that met there do not fit each other: the plan's placements disagree "
                          "with what the model computes",
                 suggestion, order, error=error)
