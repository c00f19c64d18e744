"""A derived plan proves itself: :func:`tplower.verify` on a tiny random input of the model's own kind.

:func:`tplower.plans.derive.derive_plan` matches rules by names and shapes; a
model that looks like a known family but computes differently (a fused
projection packed another way, a tensor built for all heads outside the
attention module) would get a plan that installs and runs but is wrong.
:func:`verify_derived` runs the derived plan against one process on
:func:`tiny_inputs` (ids for a text model, pixels for a vision model, mel
frames for a speech encoder) and refuses it, with the first divergence
(:class:`DerivedPlanRefused`), unless the output, every boundary, every
input and parameter gradient match within :func:`tplower.verify`'s
tolerances. :func:`parallelize_verified` verifies, then installs.
``tplower plan --model NAME --verify`` runs the same on local gloo ranks.

Call them on every rank of the mesh: :func:`tplower.verify` is collective.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..core.support.errors import TPLowerError
from ..nn.parallelize import parallelize
from ..plans.derive import DerivedPlan, derive_plan
from .report import VerifyReport
from .verifier import verify

__all__ = ["DerivedPlanRefused", "parallelize_verified", "tiny_inputs", "verify_derived"]


class DerivedPlanRefused(TPLowerError):
    """A derived plan that does not match one process; ``report`` says where (``None``: it did not run)."""

    def __init__(self, message: str, report: VerifyReport | None, derived: DerivedPlan) -> None:
        super().__init__(message)
        self.report = report
        self.derived = derived


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    return config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config


def _int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
        if isinstance(value, list | tuple) and value and isinstance(value[0], int):
            return int(value[0])
    return None


def tiny_inputs(model: nn.Module, *, batch: int = 2, seq: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny random input of the model's own kind, keyed by its ``forward``'s parameter names.

    ``input_ids`` ``[batch, seq]`` below the config's ``vocab_size`` for a text model; ``pixel_values``
    ``[batch, num_channels, image_size, image_size]`` for a vision model; ``input_features``
    ``[batch, num_mel_bins, 2 * max_source_positions]`` for a speech encoder (Whisper's length). A model
    without a config whose first module is an ``nn.Embedding`` gets ids below its ``num_embeddings``
    (keyword of its ``forward``'s first parameter); one starting with an ``nn.Linear``, floats
    ``[batch, seq, in_features]``. The draws come from a generator seeded by ``seed`` (the global one is
    untouched), so every rank makes the same input.

    Raises:
        TPLowerError: the model's kind cannot be told (no known input name, no config to size it by); pass
            ``example_inputs`` yourself.
    """
    gen = torch.Generator().manual_seed(seed)
    try:
        names = [n for n in inspect.signature(type(model).forward).parameters if n != "self"]
    except (TypeError, ValueError):
        names = []
    config = _text_config(model)
    vocab = _int(config, "vocab_size")
    if "input_ids" in names and vocab is not None:
        return {"input_ids": torch.randint(0, vocab, (batch, seq), generator=gen)}
    vision = getattr(getattr(model, "config", None), "vision_config", None) or getattr(model, "config", None)
    size, channels = _int(vision, "image_size"), _int(vision, "num_channels")
    if "pixel_values" in names and size is not None:
        return {"pixel_values": torch.randn(batch, channels or 3, size, size, generator=gen)}
    mels, frames = _int(config, "num_mel_bins"), _int(config, "max_source_positions")
    if "input_features" in names and mels is not None and frames is not None:
        return {"input_features": torch.randn(batch, mels, 2 * frames, generator=gen)}
    first = next((m for m in model.modules() if isinstance(m, nn.Embedding | nn.Linear)), None)
    if names and isinstance(first, nn.Embedding):
        return {names[0]: torch.randint(0, first.num_embeddings, (batch, seq), generator=gen)}
    if names and isinstance(first, nn.Linear):
        return {names[0]: torch.randn(batch, seq, first.in_features, generator=gen)}
    raise TPLowerError(f"derive: cannot tell which input {type(model).__name__} takes (forward parameters "
                       f"{names}, no input_ids/pixel_values/input_features with a config to size them); pass "
                       "example_inputs")


def _first_float(model: nn.Module) -> torch.Tensor | None:
    return next((p for p in model.parameters() if p.is_floating_point()), None)


def verify_derived(model: nn.Module, mesh: DeviceMesh, example_inputs: Any = None, *,
                   derived: DerivedPlan | None = None, embeddings: bool = False, axis: str = "tp", steps: int = 1,
                   atol: float | None = None, rtol: float | None = None) -> tuple[DerivedPlan, VerifyReport]:
    """Derive ``model``'s plan and check it against one process; refuse it unless everything matches.

    ``model`` is not changed: :func:`tplower.verify` runs on two copies of it (``eval()``, so dropout
    draws nothing). Collective: every rank of ``mesh`` calls it with the same model and inputs.

    Args:
        model: the full model (real values, not on the meta device).
        mesh: the device mesh (one axis, as :func:`tplower.verify` takes).
        example_inputs: as :func:`tplower.verify` takes them; default :func:`tiny_inputs`.
        derived: a plan already derived (default: ``derive_plan(model, embeddings=..., axis=...)``).
        embeddings, axis: as :func:`tplower.plans.derive.derive_plan`.
        steps, atol, rtol: as :func:`tplower.verify` (defaults by dtype: float32 1e-5 / 1e-4).

    Returns:
        ``(derived plan, report)`` with ``report.ok`` true.

    Raises:
        DerivedPlanRefused: the derived plan does not install or run on the model (the error it raised is the
            cause), or a tensor diverges from one process (the message names the first module, tensor and the
            likely fix; ``.report`` holds every check).
        TPLowerError: no rule matched, the model is on the meta device, or its input kind cannot be told.
    """
    weight = _first_float(model)
    if weight is not None and weight.device.type == "meta":
        raise TPLowerError(f"derive: {type(model).__name__} is on the meta device; verifying its derived plan runs "
                           "it, so fill its values first (or verify a tiny random model of the same config)")
    derived = derived if derived is not None else derive_plan(model, embeddings=embeddings, axis=axis)
    inputs = tiny_inputs(model) if example_inputs is None else example_inputs
    name = type(model).__name__

    def build() -> nn.Module:
        return copy.deepcopy(model).eval()

    try:
        report = verify(build, dict(derived.plan), mesh, inputs, steps=steps, atol=atol, rtol=rtol, axis=axis)
    except (TPLowerError, RuntimeError, ValueError, TypeError) as exc:
        raise DerivedPlanRefused(f"derive: the plan derived for {name} does not run on it: "
                                 f"{type(exc).__name__}: {exc}; write the plan by hand (tplower plan -o plan.yaml "
                                 "is a starting point)", None, derived) from exc
    if not report.ok:
        raise DerivedPlanRefused(f"derive: the plan derived for {name} does not match one process at "
                                 f"{report.world} ranks:\n{report.summary()}\nwrite the plan by hand (tplower plan "
                                 "-o plan.yaml is a starting point) and fix that entry", report, derived)
    return derived, report


def parallelize_verified(model: nn.Module, mesh: DeviceMesh, example_inputs: Any = None, *,
                         embeddings: bool = False, axis: str = "tp",
                         **parallelize_kwargs: Any) -> nn.Module:
    """``parallelize(model, mesh, "derive")`` after :func:`verify_derived` accepted the derived plan.

    Collective, like :func:`verify_derived`; ``parallelize_kwargs`` go to :func:`tplower.parallelize`.

    Returns:
        ``model``, parallelized in place by the verified plan.

    Raises:
        DerivedPlanRefused: the derived plan does not verify; ``model`` is left as it was.
        TPLowerError: as :func:`verify_derived`, or the install (see :func:`tplower.parallelize`).
    """
    derived, _ = verify_derived(model, mesh, example_inputs, embeddings=embeddings, axis=axis)
    plan: Mapping[str, Any] = dict(derived.plan)
    return parallelize(model, mesh, plan, axis=axis, **parallelize_kwargs)
