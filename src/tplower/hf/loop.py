"""``prepare_accelerator``: a user's own ``accelerate`` loop trains a tplower model as one process's loop would.

The loop stays the user's: ``accelerator.prepare(model, optimizer, data_loader, scheduler)``,
``accelerator.backward(loss)``, ``accelerator.clip_grad_norm_``, ``accelerator.gather_for_metrics``,
``accelerator.save_state`` / ``load_state``. :func:`prepare_accelerator` parallelizes the model first and
replaces, on the accelerator *instance*, what :func:`tplower.hf.accelerator.patch_accelerator` replaces (no DDP,
batches over ``dp``, metrics gathered over ``dp``) and four methods more:

* ``prepare_optimizer``, ``prepare_scheduler``: accelerate's own, the prepared objects remembered for the state;
  a scheduler steps once per ``dp`` rank at each step (accelerate's rule counts every process); an optimizer
  built on the parameters the model had before :func:`prepare_accelerator` replaced them is refused (it would
  never move the model);
* ``save_state``: the model's and optimizers' tensors through DCP (``model_dcp/``: every rank writes its shards;
  accelerate would write rank 0's alone), everything else through accelerate's own
  ``save_accelerator_state`` (schedulers, samplers, every process's RNG, the step);
* ``load_state``: the same read back (a DCP checkpoint reshards: another mesh may read it).

Gradients follow DDP's rule, as the loop expects: each rank's loss is the mean over its own batch, and FSDP2
averages the gradients over ``dp`` (tplower sums them over ``cp`` and ``tp`` where a rank holds a part).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh

from ..core.support.errors import TPLowerError
from ..core.support.words import count
from .accelerator import check_accelerator, patch_accelerator
from .model import ORDER, TrainingModel, parallelize_for_training

__all__ = ["MODEL_FOLDER", "prepare_accelerator"]

#: the DCP folder of the model's and optimizers' tensors inside a ``save_state`` folder
MODEL_FOLDER = "model_dcp"


@dataclass(eq=False)
class _Prepared:
    """What the accelerator prepared since :func:`prepare_accelerator`, in order (its state's parts)."""

    tm: TrainingModel
    optimizers: list[Any] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    loaders: list[Any] = field(default_factory=list)

    def tensors(self) -> dict[str, Any]:
        """The model's state dict and each optimizer's (DTensor shards as they are: DCP's input)."""
        out: dict[str, Any] = {"model": self.tm.model.state_dict()}
        for i, opt in enumerate(self.optimizers):
            out[f"optimizer_{i}"] = get_optimizer_state_dict(self.tm.model, _inner(opt))
        return out


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer holds the torch one
    if not isinstance(inner, torch.optim.Optimizer):
        raise TPLowerError(f"save_state: {type(optimizer).__name__} is not a torch optimizer")
    return inner


def _dp_steps(prepared: Any, dp: int) -> Any:
    """A scheduler accelerate prepared, stepped ``dp`` times per optimizer step, not once per process.

    accelerate (checked on 1.16) steps a prepared scheduler once for every process at each step, since every
    process reads its own batches and the loop runs that many times fewer steps; on a tplower mesh only the ``dp``
    ranks do, so it steps ``dp`` times (``split_batches``, the prepared scheduler's public flag, makes one call one
    step).
    """
    if getattr(prepared, "split_batches", True) or not callable(getattr(prepared, "step", None)):
        return prepared
    prepared.split_batches = True
    if dp > 1:
        step = prepared.step

        def step_dp(*args: Any, **kwargs: Any) -> None:
            for _ in range(dp):
                step(*args, **kwargs)

        prepared.step = step_dp
    return prepared


def _fresh(tm: TrainingModel) -> Any:
    """A check of an optimizer about to be prepared: it must not hold the model's parameters from before
    :func:`prepare_accelerator` (an optimizer built first keeps them, and they never get a gradient again)."""

    def check(optimizer: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        stale = tm.replaced(p for g in getattr(inner, "param_groups", ()) for p in g["params"])
        if stale:
            raise TPLowerError(f"accelerator.prepare: the optimizer holds {count(stale, 'parameter')} of the model "
                               "as it was before prepare_accelerator replaced them (built before the call, it would "
                               f"never move the model); {ORDER['prepare_accelerator']}")

    return check


def _remember(accelerator: Any, name: str, into: list[Any], then: Any = None, check: Any = None) -> None:
    prepare = getattr(accelerator, name)

    def remembered(obj: Any, *args: Any, **kwargs: Any) -> Any:
        if check is not None:
            check(obj)
        prepared = prepare(obj, *args, **kwargs)
        if then is not None and not any(prepared is seen for seen in into):
            prepared = then(prepared)
        if not any(prepared is seen for seen in into):
            into.append(prepared)
        return prepared

    remembered.__doc__ = f"``Accelerator.{name}``; the prepared object is part of ``save_state``."
    setattr(accelerator, name, remembered)


def _state_methods(accelerator: Any, prepared: _Prepared) -> None:
    from accelerate.checkpointing import load_accelerator_state, save_accelerator_state

    def save_state(output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """``Accelerator.save_state``: tensors through DCP, the rest through accelerate (module docstring)."""
        if output_dir is None:
            raise TPLowerError("save_state: pass output_dir (a folder every rank can write to); tplower's state "
                               "has no automatic checkpoint naming")
        accelerator.wait_for_everyone()
        os.makedirs(output_dir, exist_ok=True)
        dcp_save(prepared.tensors(), checkpoint_id=os.path.join(output_dir, MODEL_FOLDER))
        save_accelerator_state(output_dir, [], [], prepared.schedulers, prepared.loaders, accelerator.process_index,
                               accelerator.step, accelerator.scaler, safe_serialization=safe_serialization)
        accelerator.wait_for_everyone()
        return output_dir

    def load_state(input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """``Accelerator.load_state`` of :func:`save_state`'s folder (module docstring)."""
        if input_dir is None or not os.path.isdir(os.path.join(input_dir, MODEL_FOLDER)):
            raise TPLowerError(f"load_state: input_dir={input_dir!r} holds no {MODEL_FOLDER}/ folder; pass a folder "
                               "save_state wrote after prepare_accelerator")
        state = prepared.tensors()
        dcp_load(state, checkpoint_id=os.path.join(input_dir, MODEL_FOLDER))
        prepared.tm.model.load_state_dict(state["model"])
        for i, opt in enumerate(prepared.optimizers):
            set_optimizer_state_dict(prepared.tm.model, _inner(opt), state[f"optimizer_{i}"])
        override = load_accelerator_state(input_dir, [], [], prepared.schedulers, prepared.loaders,
                                          accelerator.process_index, accelerator.scaler, load_kwargs=load_kwargs)
        accelerator.step = override.get("step", accelerator.step)

    accelerator.save_state = save_state
    accelerator.load_state = load_state


def prepare_accelerator(accelerator: Any, model: nn.Module, mesh: DeviceMesh, plan: Any = "auto", *,
                        context: str | None = None, context_mode: str = "ulysses", experts: str | None = None,
                        **options: Any) -> nn.Module:
    """Parallelize ``model`` on ``mesh`` and make ``accelerator`` train it as one process's loop would.

    Call it on every rank, on the model as loaded, then build the optimizer on ``model.parameters()`` (the
    parameters it placed), then ``accelerator.prepare(model, optimizer, data_loader, ...)``. Afterwards a plain
    accelerate loop gives one process's losses, gradient norms and parameters (gradients by DDP's rule: the mean
    of the ``dp`` ranks' mean losses), ``gather_for_metrics`` one process's samples, and ``save_state`` /
    ``load_state`` continue a run exactly (with ``accelerator.skip_first_batches`` for the data already seen, as
    in any accelerate loop).

    Args:
        accelerator: an ``accelerate.Accelerator`` without ``ParallelismConfig``, FSDP or DeepSpeed.
        model: the model as loaded (the same weights on every rank).
        mesh, plan, context, context_mode, experts, options: as :func:`tplower.hf.prepare_trainer`'s; with
            ``context`` the model takes whole batches (cut over ``cp`` at its call) and gives the whole batch's
            loss, and its ``logits`` whole in ``model.eval()``.

    Returns:
        ``model``, parallelized in place.

    Raises:
        TPLowerError: before anything is changed: the accelerator's own parallelism (as
            :func:`~tplower.hf.accelerator.check_accelerator`), the mesh and axes, a model already parallelized
            or already prepared by ``accelerator.prepare`` (call this first), and every refusal of
            :func:`tplower.parallelize`. Later: ``accelerator.prepare`` of an optimizer built before this call
            (on the replaced parameters), ``save_state`` without ``output_dir``, ``load_state`` of a folder
            without ``model_dcp/``.
    """
    check_accelerator(accelerator, "prepare_accelerator")
    taken = getattr(accelerator, "_models", ())  # the models accelerator.prepare took (accelerate 1.16)
    if any(m is model or getattr(m, "module", None) is model for m in taken):
        raise TPLowerError("prepare_accelerator: accelerator.prepare took this model already (its optimizer and "
                           f"wrapper hold the parameters tplower would replace); {ORDER['prepare_accelerator']}")
    tm = parallelize_for_training(model, mesh, plan, context=context, context_mode=context_mode, experts=experts,
                                  sum_gradients=False, where="prepare_accelerator", **options)
    patch_accelerator(accelerator, tm.layout, tm.model)
    prepared = _Prepared(tm)
    _remember(accelerator, "prepare_optimizer", prepared.optimizers, check=_fresh(tm))
    _remember(accelerator, "prepare_scheduler", prepared.schedulers, lambda s: _dp_steps(s, tm.layout.dp_size))
    _remember(accelerator, "prepare_data_loader", prepared.loaders)
    _state_methods(accelerator, prepared)
    return model
