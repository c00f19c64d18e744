"""The checks of :func:`tplower.verification.verifier.verify`: one parallel model against one process, point by point.

Each boundary's inputs and outputs (forward) and gradients (backward), each
parameter gradient and, after training steps, each parameter, become a
:class:`~tplower.verification.report.Check`; :func:`verdicts` folds them into
one verdict per boundary, naming the first divergence and its cause.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..core.language.placements import format_placements, replicate_partials
from ..core.lower.redistribute import redistribute_local
from ..nn.parallelize import installed_boundary
from .compare import Comparer, bias_cause, grad_cause, param_cause
from .record import Recorder
from .report import BoundaryVerdict, Check

__all__ = ["Ticker", "input_checks", "model_check", "param_checks", "point_checks", "train", "verdicts"]


_SGD_LR = 0.1
_KINDS = {"in": "input {!r}", "in_local": "input {!r} (after the move)",
          "out_local": "output {!r} (before the move)", "out": "output {!r}"}

Placements = tuple[Placement, ...]


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    items = out.to_tuple() if hasattr(out, "to_tuple") else out  # transformers' ModelOutput
    if isinstance(items, tuple | list) and items and isinstance(items[0], torch.Tensor):
        return items[0]
    raise TypeError(f"verify: the model's output is a {type(out).__name__}; it needs a tensor, a .logits or a "
                    "tensor first element for the loss")


def _build(build_model: Callable[[], nn.Module], seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model()
    if not isinstance(model, nn.Module):
        raise TypeError(f"verify: build_model() must return an nn.Module, got {type(model).__name__}")
    return model


def _default_loss(out: torch.Tensor) -> torch.Tensor:
    """Half the sum of squares of the output (float32): the loss ``verify`` takes when none is given."""
    return out.float().square().sum() / 2


def _call(model: nn.Module, inputs: Mapping[int | str, Any]) -> Any:
    pos = [inputs[k] for k in sorted(k for k in inputs if isinstance(k, int))]
    return model(*pos, **{k: v for k, v in inputs.items() if isinstance(k, str)})


def model_check(phase: str, module: str, what: str, got: torch.Tensor, want: torch.Tensor, order: int,
                 cmp: Comparer, placement: str = "R") -> Check:
    """The whole tensor ``got`` (read back from the parallel model by ``placement``) against ``want``."""
    d, ok = cmp.diff(got, want)
    return Check(phase, module, what, placement, d, ok, order=order, allowed=cmp.allowed(want))


@dataclass
class Ticker:
    """Counts comparisons for a progress callback."""

    callback: Callable[[int, int], None] | None
    total: int
    done: int = 0

    def __call__(self) -> None:
        self.done += 1
        if self.callback is not None and self.done < self.total:
            self.callback(self.done, self.total)

    def finish(self) -> None:
        if self.callback is not None:
            self.callback(self.total, self.total)


def point_checks(ref_rec: Recorder, par_rec: Recorder, ref: nn.Module, par: nn.Module,
                  cmp: Comparer, tick: Ticker) -> list[Check]:
    """Values (forward) and gradients (backward) of every recorded point, in the parallel run's order."""
    checks: list[Check] = []
    modules = dict(ref.named_modules())
    biases = {q: info.deferred_bias for q, m in par.named_modules() if (info := installed_boundary(m)) is not None}
    for key, p in sorted(par_rec.points.items(), key=lambda kv: kv[1].order):
        qual, kind, name, call = key
        tick()
        r = ref_rec.points.get((qual, "in" if kind.startswith("in") else "out", name, call))
        if r is None:
            continue
        what = _KINDS[kind].format(name) + (f" (call {call})" if call > 1 else "")
        if p.vplace is not None:
            d, ok = cmp.compare(p.value, p.vplace, r.value)
            cause = sugg = None
            if not ok and kind == "out":
                bias = modules[qual]._parameters.get("bias")
                cause, sugg = bias_cause(cmp.read(p.value, p.vplace, r.value), r.value, bias, cmp.mesh.size(),
                                          cmp, qual)
            checks.append(Check("forward", qual, what, format_placements(p.vplace), d, ok, cause, sugg, p.order,
                                allowed=cmp.allowed(r.value)))
        if p.gplace is None or (r.grad is None and cmp.allmax(0.0 if p.grad is None else 1.0) == 0):
            continue
        if r.grad is None:
            checks.append(Check("backward", qual, f"grad of {what}", format_placements(p.gplace), math.inf, False,
                                "the parallel model has a gradient here, one process has none", None, p.grad_order))
            continue
        d, ok = cmp.compare(p.grad, p.gplace, r.grad)
        cause = sugg = None
        if not ok and p.grad is not None:
            field_name = "in_grad" if kind.startswith("in") else "out_grad"
            cause, sugg = grad_cause(p.grad, p.gplace, r.grad, cmp, field_name, qual, name, biases.get(qual))
        checks.append(Check("backward", qual, f"grad of {what}", format_placements(p.gplace), d, ok, cause, sugg,
                            p.grad_order, allowed=cmp.allowed(r.grad)))
    return checks


def _packed(place: Placements) -> bool:
    """A placement beyond ``Shard``/``Replicate``/``Partial`` (a packed parameter's ``_StridedShard``)."""
    return any(not isinstance(p, Shard | Replicate | Partial) for p in place)


def _place_text(place: Placements) -> str:
    """Placements as text; a packed parameter's ``_StridedShard(d, k)`` reads ``S(d) in k parts``."""
    if not _packed(place):
        return format_placements(place)
    return ",".join(f"S({getattr(p, 'dim', '?')}) in {p.split_factor} parts" if hasattr(p, "split_factor")
                    else format_placements([p]) for p in place)


def input_checks(ref_in: Mapping[int | str, Any], par_in: Mapping[int | str, Any],
                  places: Mapping[int | str, Placements], cmp: Comparer, order: int) -> list[Check]:
    checks = []
    for k, r in ref_in.items():
        p = par_in[k]
        if not isinstance(r, torch.Tensor) or r.grad is None or not isinstance(p, torch.Tensor):
            continue
        place = replicate_partials(places[k])
        d, ok = cmp.compare(p.grad, place, r.grad)
        checks.append(Check("backward", "(model input)", f"grad of input {k!r}", format_placements(place), d, ok,
                            order=order, allowed=cmp.allowed(r.grad)))
    return checks


def param_checks(ref: nn.Module, par: nn.Module, cmp: Comparer, phase: str, tick: Ticker) -> list[Check]:
    """Each parameter's gradient (``param_grad``) or value (``param_after_steps``) read back whole."""
    checks = []
    par_params = dict(par.named_parameters())
    floors: dict[str, float] = {}  # per module: its largest gradient, the scale of its gradients' rounding
    for name, r in ref.named_parameters():
        if phase == "param_grad" and r.grad is not None and r.grad.numel():
            qual = name.rpartition(".")[0]
            floors[qual] = max(floors.get(qual, 0.0), float(r.grad.abs().max()))
    for i, (name, r) in enumerate(ref.named_parameters()):
        p = par_params[name]
        tick()
        want = r.grad if phase == "param_grad" else r.detach()
        got = p.grad if phase == "param_grad" else p.detach()
        if want is None and cmp.allmax(0.0 if got is None else 1.0) == 0:
            continue
        place: Placements = tuple(Replicate() for _ in range(cmp.mesh.ndim))
        local = got
        if isinstance(got, DTensor):
            local, place = got.to_local(), tuple(got.placements)
        qual = name.rpartition(".")[0] or "(model)"
        what = f"gradient of parameter {name!r}" if phase == "param_grad" else f"parameter {name!r}"
        if want is None or (isinstance(got, DTensor) and (got.device_mesh.ndim != cmp.mesh.ndim or _packed(place))):
            d, ok = (math.inf, False) if want is None else cmp.diff(got.full_tensor() if isinstance(got, DTensor)
                                                                    else got, want)
            checks.append(Check(phase, qual, what, _place_text(place), d, ok, order=i, allowed=cmp.allowed(want)))
            continue
        d, ok = cmp.compare(local, place, want, floors.get(name.rpartition(".")[0], 0.0))
        cause = sugg = None
        if not ok and phase == "param_grad" and local is not None:
            cause, sugg = param_cause(local, place, want, cmp, qual, name.rpartition(".")[2])
        checks.append(Check(phase, qual, what, format_placements(place), d, ok, cause, sugg, i,
                            allowed=cmp.allowed(want, floors.get(name.rpartition(".")[0], 0.0))))
    return checks



def train(ref: nn.Module, par: nn.Module, ref_in: Mapping[int | str, Any], par_in: Mapping[int | str, Any],
           loss: Callable[[torch.Tensor], torch.Tensor], steps: int, mesh: DeviceMesh, out_place: Placements,
           rep: str, shape: tuple[int, ...]) -> None:
    """SGD steps on both copies: the first on the recorded gradients, then ``steps - 1`` more passes."""
    opts = [torch.optim.SGD(m.parameters(), lr=_SGD_LR) for m in (ref, par)]
    for i in range(steps):
        if i:
            for o in opts:
                o.zero_grad()
            loss(_first_tensor(_call(ref, ref_in))).backward()
            local = _first_tensor(_call(par, par_in))
            loss(redistribute_local(local, mesh, out_place, rep, grad=rep, global_shape=shape)).backward()
        for o in opts:
            o.step()


def verdicts(par: nn.Module, rec: Recorder, checks: Sequence[Check]) -> tuple[BoundaryVerdict, ...]:
    first: dict[str, int] = {}
    for p in sorted(rec.points.values(), key=lambda p: p.order):
        first.setdefault(p.module, p.order)
    infos = {q: info for q, m in par.named_modules() if (info := installed_boundary(m)) is not None}
    order = sorted(infos, key=lambda q: first.get(q, len(first) + list(infos).index(q)))
    out = []
    for q in order:
        own = [c for c in checks if c.module == q]
        fwd = max((c.max_diff for c in own if c.phase == "forward"), default=None)  # None: nothing compared
        bwd = max((c.max_diff for c in own if c.phase != "forward"), default=None)
        out.append(BoundaryVerdict(q, infos[q].form.form, fwd, bwd, all(c.ok for c in own)))
    return tuple(out)
