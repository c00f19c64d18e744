"""One side of the architecture tables against one process: logits, every gradient, replicas' agreement.

:func:`compare_training` runs one forward and backward of a parallelized model and of its one-process
reference and gives an :class:`Outcome` (``pass`` within :data:`TOL`); :func:`guarded` turns an exception into
``refused`` or ``error``; :func:`merge` makes one outcome of every rank's. Shared by
:mod:`tplower.run.hf_table` and :mod:`tplower.run.derive_table`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ..core.lower.traffic import CollectiveTraffic
from ..core.support.errors import TPLowerError

__all__ = ["TOL", "Outcome", "Status", "compare_logits", "compare_training", "describe", "eval_logits", "guarded",
           "merge"]

#: largest absolute logit difference from the one-process model that counts as equal (float32)
TOL = 1e-5

Status = Literal["pass", "fail", "refused", "error", "n/a"]


@dataclass(frozen=True)
class Outcome:
    """One side's result on one architecture.

    ``pass``/``fail``: logits (and, where checked, every gradient and the cross-rank agreement of the
    replicated ones: ``grad_diff``, the worst parameter in ``detail``) within / beyond :data:`TOL`
    (``max_diff``: the logits');
    ``refused``: a :class:`~tplower.TPLowerError` (``detail`` its message);
    ``error``: any other exception (``detail``: type and first line);
    ``n/a``: not run (``detail`` says why).
    ``sent``: bytes this rank sent in the parallel model's forward and backward, where counted (the
    largest over ranks once merged).
    """

    status: Status
    max_diff: float | None = None
    detail: str = ""
    grad_diff: float | None = None
    sent: int | None = None

    def cell(self) -> str:
        """The table cell: the status, with the max diff for pass/fail (logits, then gradients where checked)."""
        if self.max_diff is None:
            return self.status
        grads = f", grads {self.grad_diff:.1e}" if self.grad_diff is not None else ""
        return f"{self.status} ({self.max_diff:.1e}{grads})"


def eval_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``model``'s logits on ``ids`` without gradients, whole (a DTensor's ``full_tensor``)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    return out.full_tensor() if isinstance(out, DTensor) else out


def compare_logits(got: torch.Tensor, want: torch.Tensor) -> Outcome:
    """``pass`` when ``got`` has ``want``'s shape and is within :data:`TOL` of it, else ``fail``."""
    if got.shape != want.shape:
        return Outcome("fail", detail=f"logits shape {tuple(got.shape)}, one process {tuple(want.shape)}")
    diff = float((got - want).abs().max())
    return Outcome("pass" if diff <= TOL else "fail", diff, "" if diff <= TOL else f"max diff {diff:.1e} > {TOL:.0e}")


def _train_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The logits (whole), after one backward of the next-token cross-entropy on ``ids``."""
    from torch.distributed.tensor import DTensor

    out = model(input_ids=ids, use_cache=False).logits
    full = out.full_tensor() if isinstance(out, DTensor) else out
    logits = full[:, :-1].float()
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    return full.detach()


def _replica_spread(grad: torch.Tensor) -> float:
    """How far a replicated DTensor gradient's local values differ across its mesh's ranks (max - min)."""
    import torch.distributed as dist

    local = grad.to_local().detach().float()  # type: ignore[attr-defined]
    hi, lo = local.clone(), local.clone()
    group = grad.device_mesh.get_group()  # type: ignore[attr-defined]
    dist.all_reduce(hi, dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, dist.ReduceOp.MIN, group=group)
    return float((hi - lo).abs().max()) if local.numel() else 0.0


def compare_training(tp: nn.Module, ref: nn.Module, ids: torch.Tensor | None,
                     step: Callable[[nn.Module], torch.Tensor] | None = None, *, count: bool = False) -> Outcome:
    """Logits, every parameter gradient and the replicated gradients' cross-rank agreement of ``tp`` vs ``ref``.

    Runs one forward and backward of each (next-token cross-entropy on ``ids``, or ``step(model)``, which
    runs a forward and a backward and returns the whole output, detached); call on every rank alike (the
    agreement check is a collective per replicated DTensor gradient). ``grad_diff`` is the largest of the
    gradient differences and spreads; ``detail`` names the worst parameter when it is beyond :data:`TOL`.
    With ``count``, ``sent`` is the bytes this rank sent in ``tp``'s forward and backward
    (:class:`~tplower.core.lower.traffic.CollectiveTraffic`, every collective whoever issues it; the output's
    gathering for the comparison included, as a training step's loss needs it).
    """
    if step is None:
        assert ids is not None, "compare_training: ids or step"
        step = functools.partial(_train_logits, ids=ids)
    want = step(ref)
    traffic = CollectiveTraffic() if count else None
    if traffic is None:
        got = step(tp)
    else:
        with traffic:
            got = step(tp)
    outcome = _check(tp, ref, got, want)
    return outcome if traffic is None else dataclasses.replace(outcome, sent=traffic.sent)


def _check(tp: nn.Module, ref: nn.Module, got: torch.Tensor, want: torch.Tensor) -> Outcome:
    from torch.distributed.tensor import DTensor, Replicate

    logits = compare_logits(got, want)
    if logits.max_diff is None:
        return logits
    mine = dict(tp.named_parameters())
    worst, what = 0.0, ""
    for name, p in ref.named_parameters():
        q = mine.get(name)
        g = None if q is None else q.grad
        if (p.grad is None) != (g is None):
            return Outcome("fail", logits.max_diff, f"gradient of {name}: one process "
                           f"{'none' if p.grad is None else 'set'}, parallel {'none' if g is None else 'set'}", 0.0)
        if p.grad is None or g is None:
            continue
        if isinstance(g, DTensor) and all(isinstance(x, Replicate) for x in g.placements):
            spread = _replica_spread(g)
            if spread > worst:
                worst, what = spread, f"replicated gradient of {name} differs across ranks by {spread:.1e}"
        full = g.full_tensor() if isinstance(g, DTensor) else g
        if full.shape != p.grad.shape:
            return Outcome("fail", logits.max_diff, f"gradient of {name}: shape {tuple(full.shape)}, one process "
                           f"{tuple(p.grad.shape)}", 0.0)
        diff = float((full - p.grad).abs().max()) if full.numel() else 0.0
        if diff > worst:
            worst, what = diff, f"gradient of {name} off by {diff:.1e}"
    ok = logits.status == "pass" and worst <= TOL
    detail = logits.detail or (what if worst > TOL else "")
    return Outcome("pass" if ok else "fail", logits.max_diff, detail, worst)


def describe(exc: BaseException) -> str:
    """An exception as ``Type: first line`` (at most 200 characters of it)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")


def guarded(run: Callable[[], Outcome]) -> Outcome:
    """``run()``, with a :class:`TPLowerError` as ``refused`` and any other exception as ``error``."""
    try:
        return run()
    except TPLowerError as exc:
        return Outcome("refused", detail=str(exc).strip().splitlines()[0])
    except Exception as exc:  # one architecture's failure is that architecture's row, never the run's end
        return Outcome("error", detail=describe(exc))


def merge(per_rank: Sequence[Outcome]) -> Outcome:
    """One outcome from every rank's: the first that did not pass, else rank 0's with the largest diff."""
    for outcome in per_rank:
        if outcome.status != "pass":
            return outcome
    grads = [o.grad_diff for o in per_rank if o.grad_diff is not None]
    sent = [o.sent for o in per_rank if o.sent is not None]
    return dataclasses.replace(per_rank[0], max_diff=max(o.max_diff or 0.0 for o in per_rank),
                               grad_diff=max(grads) if grads else None, sent=max(sent) if sent else None)
