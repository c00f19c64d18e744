"""A trainer's callbacks on a tplower model: one clear line where a callback mixes whole tensors into its DTensors.

TRL's ``SyncRefModelCallback``, EMA callbacks and users' own mix a second model's parameters into the trained
model's (or back) parameter by parameter. :func:`tplower.hf.prepare_trainer` places TRL's reference model as the
trained one; a copy it does not know (made before the call, or never placed) holds whole tensors, which DTensor
refuses from deep inside the callback's arithmetic. :func:`guard_callbacks` turns that into one
:class:`~tplower.core.support.errors.TPLowerError` naming the callback and the fix, on every rank alike (each rank
runs the same callbacks on the same parameters).
"""

from __future__ import annotations

from typing import Any

from ..core.support.errors import TPLowerError

__all__ = ["MIXED", "guard_callbacks"]

#: the words of DTensor's error when an operation mixes a whole tensor with a DTensor
MIXED = "got mixed torch.Tensor and DTensor"


def _culprit(error: BaseException) -> str:
    """The callback whose code raised ``error`` (the innermost ``TrainerCallback`` on its traceback), by name."""
    from transformers import TrainerCallback

    found, tb = "a callback", error.__traceback__
    while tb is not None:
        me = tb.tb_frame.f_locals.get("self")
        if isinstance(me, TrainerCallback):
            found = f"the callback {type(me).__name__}"
        tb = tb.tb_next
    return found


def guard_callbacks(trainer: Any) -> None:
    """``callback_handler.call_event``: a callback that mixes a whole tensor with the trained model's DTensor
    parameters (an EMA or reference copy made before the call, or never placed) ends in one
    :class:`~tplower.core.support.errors.TPLowerError` naming it and the fix, on every rank alike, instead of
    DTensor's error from deep inside it."""
    handler = trainer.callback_handler
    call_event = handler.call_event

    def guarded(event: str, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        try:
            return call_event(event, args, state, control, **kwargs)
        except RuntimeError as e:
            if MIXED not in str(e):
                raise
            raise TPLowerError(f"prepare_trainer: {_culprit(e)} mixed a whole tensor with the trained model's "
                               f"DTensor parameters in {event} ({MIXED}); a model kept beside the trained one (an "
                               "EMA copy, a reference model) must be placed like it: make it after prepare_trainer "
                               "({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, or "
                               "copy.deepcopy(trainer.model) on a mesh without 'dp', whose FSDP2 refuses a deep "
                               "copy), or let the trainer hold it as trainer.ref_model, which prepare_trainer "
                               "places") from e

    handler.call_event = guarded
