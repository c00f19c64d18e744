"""A context-parallel model checked against one process: the loss, each attention's exchange, every gradient.

:func:`verify_context` is :func:`tplower.verify` for a model parallelized
with ``context=``: the boundaries the tensor-parallel plan installs are
checked by the tensor-parallel verifier; here what context parallelism adds
is checked where it happens. Every rank builds the model twice (same seed),
runs the whole batch in one process and :func:`tplower.shard_sequence`'s
part on the parallel copy, and compares:

* ``forward``: the loss (on every rank, the whole batch's), each attention
  module's output (this rank's tokens, made whole over the context axis by
  :func:`tplower.gather_sequence`: the exchange before the kernel and the one
  after it, the mask rows and positions the kernel saw), the logits;
* ``backward``: the gradient arriving at each attention module's output,
  made whole the same way;
* ``param_grad``: every parameter's gradient, read whole (``full_tensor``).

The first attention whose output diverges is where the exchange or the mask
is wrong; attention outputs that match with parameter gradients that do not
mean the gradient's reduction over the context axis is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..context.install import installed_context
from ..context.sequence import gather_sequence, shard_sequence
from ..core.lower.redistribute import redistribute_local
from ..core.support.argcheck import check_mesh
from ..nn.parallelize import parallelize
from ..plans.entries import PlanValue
from .checks import Ticker, _build, _default_loss, _first_tensor, param_checks
from .compare import Comparer
from .report import BoundaryVerdict, Check, VerifyReport

__all__ = ["verify_context"]


@dataclass(frozen=True)
class _WorldComparer(Comparer):
    """A :class:`Comparer` whose verdicts are reduced over every rank of the mesh (all its axes, ``group``)."""

    group: Any = None

    def allmax(self, x: float) -> float:
        t = torch.tensor([math.inf if math.isnan(x) else x], dtype=torch.float64)
        dist.all_reduce(t, dist.ReduceOp.MAX, group=self.group)
        return float(t[0])


def _hook(model: nn.Module, paths: tuple[str, ...], into: dict[str, dict[str, torch.Tensor]]) -> None:
    """Record each attention module's output tensor (its first element) and the gradient arriving at it."""
    modules = dict(model.named_modules())
    for path in paths:
        def post(m: nn.Module, args: Any, out: Any, path: str = path) -> None:
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor):
                into.setdefault(path, {})["out"] = t.detach()
                if t.requires_grad:
                    t.register_hook(lambda g, path=path: into[path].__setitem__("grad", g.detach()))

        modules[path].register_forward_hook(post)


def _accepts(model: nn.Module, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def verify_context(build_model: Callable[[], nn.Module], plan: Mapping[str, PlanValue] | str | Path | None,
                   mesh: DeviceMesh, batch: Mapping[str, torch.Tensor], *, context: str = "cp",
                   context_mode: str = "ulysses", context_grads: str = "sum", balance: bool = True,
                   axis: str = "tp", experts: str = "tp", atol: float = 1e-5, rtol: float = 1e-4,
                   seed: int = 0) -> VerifyReport:
    """Check a model parallelized with ``context=`` against one process on the whole batch; call it on every rank.

    Args:
        build_model: makes the full transformers causal LM (``eager`` or
            ``sdpa`` attention); called twice under ``torch.manual_seed(seed)``.
            Under the threaded process group the ranks share the generator:
            return copies of one model built beforehand.
        plan: the tensor-parallel plan beside ``context`` (as
            :func:`tplower.parallelize`; ``None``: context parallelism alone).
        mesh: the device mesh: ``(context,)`` or with ``axis`` too; every rank calls this.
        batch: the whole batch as one process sees it: ``input_ids`` ``[B, S]``
            (``labels``, ``attention_mask``, ``position_ids`` when given), the
            same on every rank. With ``labels`` the model's own loss is
            compared and backpropagated; a model with no loss (an encoder)
            gets half the sum of squares of its first output, gathered.
        context, context_mode, context_grads, axis, experts: as :func:`tplower.parallelize`.
        balance: as :func:`tplower.shard_sequence`.
        atol, rtol: a tensor passes when ``|parallel - one process| <= atol + rtol * max|one process|``.
        seed: the seed ``build_model`` runs under.

    Returns:
        A :class:`~tplower.verification.report.VerifyReport`, the same on every
        rank: one row per attention module (``form`` names the mode), the
        loss, logits and parameter checks.

    Raises:
        TypeError: ``build_model`` not callable or not returning an ``nn.Module``, ``mesh`` not a
            ``DeviceMesh``, ``batch`` not a mapping.
        ValueError: ``batch`` without ``input_ids`` (or ``inputs_embeds``).
        TPLowerError: the model does not parallelize with ``context`` (see :func:`tplower.parallelize`).
    """
    if not callable(build_model):
        raise TypeError(f"verify: build_model must be a callable returning an nn.Module, got "
                        f"{type(build_model).__name__}")
    check_mesh(mesh, "mesh", "verify")
    if not isinstance(batch, Mapping):
        raise TypeError(f"verify: batch must be a mapping (input_ids, labels, ...), got {type(batch).__name__}")
    if not isinstance(batch.get("input_ids", batch.get("inputs_embeds")), torch.Tensor):
        raise ValueError("verify: with context=, the batch needs 'input_ids' [batch, sequence] (or 'inputs_embeds')")
    ref, par = _build(build_model, seed), _build(build_model, seed)
    parallelize(par, mesh, plan, axis=axis, experts=experts, context=context, context_mode=context_mode,
                context_grads=context_grads)
    installed = installed_context(par)
    assert installed is not None
    ref_rec: dict[str, dict[str, torch.Tensor]] = {}
    par_rec: dict[str, dict[str, torch.Tensor]] = {}
    _hook(ref, installed.modules, ref_rec)
    _hook(par, installed.modules, par_rec)
    part = shard_sequence(batch, mesh, context, balance=balance)

    def whole(t: torch.Tensor) -> torch.Tensor:
        return gather_sequence(t, mesh, context, split=part)

    want = ref(**batch, **({"use_cache": False} if _accepts(ref, "use_cache") else {}))
    got = par(**part)
    own_loss = getattr(want, "loss", None) is not None
    if own_loss:
        want_loss, got_loss = want.loss, got.loss
    else:  # no loss of its own (an encoder): half the sum of squares of its first output, made whole over the axis
        want_loss, got_loss = _default_loss(_first_tensor(want)), _default_loss(whole(_first_tensor(got)))
    want_loss.backward()
    got_loss.backward()
    cmp = _WorldComparer(mesh, atol, rtol, mesh._flatten().get_group() if mesh.ndim > 1 else mesh.get_group(0))

    def check(phase: str, module: str, what: str, where: str, got: torch.Tensor | None, want: torch.Tensor | None,
              order: int) -> Check:
        if want is None:  # one process has no such tensor (no gradient arrives there): nothing to compare
            return Check(phase, module, what, where, 0.0, True, order=order, allowed=cmp.allowed(None))
        return Check(phase, module, what, where, *cmp.diff(got, want), order=order, allowed=cmp.allowed(want))

    checks = [check("forward", "", "loss" if own_loss else "loss on the gathered output", "R", got_loss.detach(),
                    want_loss.detach(), 0)]
    rows = []
    where = f"S(1) over {context!r}"
    split = axis if axis is not None and axis in (mesh.mesh_dim_names or ()) else None

    def attention_whole(t: torch.Tensor | None, want: torch.Tensor | None) -> tuple[torch.Tensor | None, str]:
        """Made whole over ``context``, and over ``axis`` where the module's output keeps this rank's heads (an
        attention whose output projection is a module of its own, BERT's ``self``: the last dim split by tp)."""
        if t is None:
            return None, where
        t = whole(t)
        if split is None or want is None or t.shape[-1] == want.shape[-1]:
            return t, where
        whole_shape = (*t.shape[:-1], want.shape[-1])  # torch.chunk's pieces of the one-process width
        return (redistribute_local(t, mesh[split], "S(-1)", "R", global_shape=whole_shape),
                f"{where}, S(-1) over {split!r}")

    for i, path in enumerate(installed.modules, start=1):
        r, p = ref_rec.get(path, {}), par_rec.get(path, {})
        out, out_where = attention_whole(p.get("out"), r.get("out"))
        grad, grad_where = attention_whole(p.get("grad"), r.get("grad"))
        fwd = check("forward", path, "attention output (this rank's tokens, gathered)", out_where, out, r.get("out"),
                    i)
        bwd = check("backward", path, "gradient at the attention output", grad_where, grad, r.get("grad"), i)
        checks += [fwd, bwd]
        rows.append(BoundaryVerdict(path, f"context {context_mode}", fwd.max_diff, bwd.max_diff, fwd.ok and bwd.ok))
    first, first_want = _first_tensor(got).detach(), _first_tensor(want).detach()
    if first.shape[-1] == first_want.shape[-1]:
        name = "logits" if getattr(want, "logits", None) is not None else "output"
        checks.append(check("forward", "", f"{name} (gathered)", where, whole(first), first_want, len(rows) + 1))
    checks += param_checks(ref, par, cmp, "param_grad", Ticker(None, 0))
    return VerifyReport(tuple(rows), tuple(checks), atol, rtol, mesh.size())
