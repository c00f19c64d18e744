"""Training stacks of Hugging Face: transformers' ``Trainer``, TRL's trainers and ``accelerate`` loops, tplower inside.

* :func:`prepare_trainer`: any ``Trainer`` (``SFTTrainer``, ``DPOTrainer``, a user's own) trains a tplower
  model as one process trains the whole model (:mod:`tplower.hf.trainer`).
* :func:`prepare_accelerator`: a user's own ``accelerate`` loop does the same, ``save_state``/``load_state``
  included (:mod:`tplower.hf.loop`).

The pieces they share: :mod:`~tplower.hf.layout` (which ranks share data), :mod:`~tplower.hf.batches` (batches
cut over ``dp`` and ``cp``, the global token count, predictions made whole), :mod:`~tplower.hf.model`
(parallelize, FSDP2 over ``dp``), :mod:`~tplower.hf.accelerator` (an ``Accelerator`` without DDP),
:mod:`~tplower.hf.saving` (whole weights, DCP optimizer state).

transformers comes with tplower; accelerate (which transformers' ``Trainer`` needs), TRL and datasets are the
optional extra ``tplower[hf]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .loop import prepare_accelerator
    from .trainer import prepare_trainer

_HOMES = {"prepare_accelerator": ".loop", "prepare_trainer": ".trainer"}

__all__ = ["prepare_accelerator", "prepare_trainer"]

__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals(), subpackages=True)
