"""``tplower.verify``: run a user's plan on their own model against one process, boundary by boundary.

Every rank builds the model twice (same seed): a reference that runs the
whole inputs in this process, and a copy :func:`tplower.parallelize` shards.
Hooks on the modules the plan installed a boundary on record, per call:

=============  =====================================  ==========================================
point          tensor                                 read back to a global value by
=============  =====================================  ==========================================
``in``         an input as the module receives it     its ``in_src``; its gradient by ``in_src``
                                                      with ``P`` read as ``R``
``in_local``   a moved input as the compute sees it   ``in_dst``; its gradient by ``in_grad``
``out_local``  a moved output as the compute makes it ``out_src``; its gradient by ``out_src``
                                                      with ``P`` read as ``R``
``out``        an output as the module gives it       ``out_dst``; its gradient by ``out_grad``
=============  =====================================  ==========================================

and the reference's same modules give the one-process values (``in``/``out``;
a move changes the layout, never the value). Each value and each gradient
arriving there is read back (``DTensor.from_local(...).full_tensor()``: an
all_gather for ``S(d)``, a sum over ranks for ``P(sum)``, the rank's own
tensor for ``R``) and compared; then every parameter's gradient
(``full_tensor``) and, with ``steps > 1``, the parameters after SGD steps.

Where a gradient diverges the numbers often name the cause: declared ``R``
but the sum over ranks is right (a partial gradient never reduced: ``R``
where ``P(sum)`` belongs); declared ``P(sum)`` but each rank's own tensor is
right (``P(sum)`` where ``R`` belongs); a whole multiple of the right one; a
replicated parameter whose gradient differs across ranks (a missing
reduction); a forward output off by ``n - 1`` times the bias, or a bias
gradient ``n`` times too large (a bias added on every rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, distribute_tensor

from ..core.language.placements import PlacementsLike, format_placements, parse_placements
from ..core.lower.redistribute import redistribute_local
from ..core.support.argcheck import check_mesh
from ..nn.parallelize import parallelize
from ..plans.entries import PlanValue
from .checks import (
    Placements,
    Ticker,
    _build,
    _call,
    _default_loss,
    _first_tensor,
    input_checks,
    model_check,
    param_checks,
    point_checks,
    train,
    verdicts,
)
from .compare import Comparer
from .context import verify_context
from .raised import raised_check
from .record import Recorder, hook_parallel, hook_reference
from .report import Check, VerifyReport

__all__ = ["DEFAULT_TOLERANCES", "verify"]

#: dtype -> (atol, rtol) used when ``atol``/``rtol`` are not given (the dtype of the model's first floating parameter).
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-7), torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (1e-2, 1.6e-2), torch.float16: (1e-3, 1e-3),
}
def _as_args(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple | list):
        return tuple(example_inputs), {}
    raise TypeError(f"verify: example_inputs must be a tensor, a tuple/list of positional inputs or a mapping of "
                    f"keyword inputs, got {type(example_inputs).__name__}")


def _leaf(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        t = t.detach().clone()
        if t.is_floating_point():
            t.requires_grad_(True)
    return t


def _placed_inputs(args: tuple[Any, ...], kwargs: dict[str, Any], mesh: DeviceMesh,
                   input_placements: Mapping[int | str, PlacementsLike]) -> tuple[dict[int | str, Any],
                                                                                  dict[int | str, Placements]]:
    """This rank's local inputs (leaves) and each input's placements, keyed by position or keyword."""
    named: dict[int | str, Any] = dict(enumerate(args))
    named.update(kwargs)
    if unknown := [k for k in input_placements if k not in named]:
        raise ValueError(f"verify: input_placements names {unknown}, which are not inputs; the inputs are "
                         f"{list(named)}")
    names = mesh.mesh_dim_names
    places: dict[int | str, Placements] = {}
    local: dict[int | str, Any] = {}
    for k, v in named.items():
        spec = input_placements.get(k, ",".join("R" for _ in range(mesh.ndim)))
        ps = parse_placements(spec, names, ndim=mesh.ndim, arg=f"input_placements[{k!r}]",
                              tensor_ndim=v.ndim if isinstance(v, torch.Tensor) else None)
        if any(isinstance(p, Partial) for p in ps):
            raise ValueError(f"verify: input_placements[{k!r}]={spec!r}: an input is R or S(d), not Partial")
        places[k] = ps
        if isinstance(v, torch.Tensor) and not all(isinstance(p, Replicate) for p in ps):
            v = distribute_tensor(v.detach(), mesh, list(ps)).to_local()
        elif not isinstance(v, torch.Tensor) and ps != tuple(Replicate() for _ in ps):
            raise ValueError(f"verify: input_placements[{k!r}]: input {k!r} is not a tensor, it can only be R")
        local[k] = _leaf(v)
    return local, places


def _raised_report(par: nn.Module, par_rec: Recorder, ref_rec: Recorder, ref: nn.Module, cmp: Comparer,
                   failed: Check | None, progress: Callable[[int, int], None] | None) -> VerifyReport:
    """The report when the parallel forward raised on some rank: the boundaries it passed (their forward values
    compared) and the one that raised, as a failed check; nothing after it ran."""
    tick = Ticker(progress, len(par_rec.points))
    checks = [c for c in point_checks(ref_rec, par_rec, ref, par, cmp, tick) if c.phase == "forward"]
    if failed is not None:  # its own inputs' comparisons are in the finding (shapes and placements that met)
        checks = [c for c in checks if c.module != failed.module]
    if failed is None:
        failed = Check("forward", "(model)", "the forward raised on another rank, not on this one", "-", math.inf,
                       False, "ranks computed different shapes", None, par_rec.seq, error="raised on another rank")
    checks.append(failed)
    tick.finish()
    reached = {c.module for c in checks}
    return VerifyReport(tuple(v for v in verdicts(par, par_rec, checks) if v.module in reached), tuple(checks),
                        cmp.atol, cmp.rtol, cmp.mesh.size())


def _check_args(build_model: Any, mesh: Any, loss_fn: Any, steps: Any, atol: Any, rtol: Any) -> None:
    if not callable(build_model):
        raise TypeError(f"verify: build_model must be a callable returning an nn.Module, got "
                        f"{type(build_model).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"verify: loss_fn must be callable or None, got {type(loss_fn).__name__}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"verify: steps={steps!r}; it must be an integer of at least 1")
    for name, v in (("atol", atol), ("rtol", rtol)):
        if v is not None and (not isinstance(v, int | float) or isinstance(v, bool) or not v >= 0):
            raise ValueError(f"verify: {name}={v!r}; it must be a non-negative number or None (the dtype default)")
    check_mesh(mesh, "mesh", "verify")
    if mesh.ndim != 1:
        raise ValueError(f"verify: mesh has {mesh.ndim} axes {mesh.mesh_dim_names}; verify checks a 1-D "
                         "tensor-parallel mesh (pass mesh[axis])")


def _tolerances(model: nn.Module, atol: float | None, rtol: float | None) -> tuple[float, float]:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    a, r = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.float32])
    return (a if atol is None else float(atol)), (r if rtol is None else float(rtol))


def verify(build_model: Callable[[], nn.Module], plan: Mapping[str, PlanValue] | str | Path | None, mesh: DeviceMesh,
           example_inputs: Any, *, loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None, steps: int = 1,
           atol: float | None = None, rtol: float | None = None,
           input_placements: Mapping[int | str, PlacementsLike] | None = None,
           output_placement: PlacementsLike | None = None, axis: str = "tp", seed: int = 0,
           progress: Callable[[int, int], None] | None = None, experts: str = "tp", context: str | None = None,
           context_mode: str = "ulysses", balance: bool = True) -> VerifyReport:
    """Check ``plan`` on ``build_model()`` against one process, boundary by boundary; call it on every rank.

    Args:
        build_model: makes the full model; called twice, each time under
            ``torch.manual_seed(seed)`` (the global generator is restored
            afterwards), so both copies start alike. Under the threaded
            process group the ranks share the global generator: return
            copies of one model built beforehand.
        plan: as :func:`tplower.parallelize` takes it (a mapping, a YAML/JSON
            file, ``"auto"`` or ``"derive"``; ``None`` with ``context``:
            context parallelism alone).
        mesh: the device mesh; every rank of it calls ``verify``.
        example_inputs: the whole inputs, the same on every rank: a tensor,
            a tuple/list of positional inputs or a mapping of keyword inputs.
            Floating inputs get gradients, which are compared too.
        loss_fn: ``loss_fn(output) -> scalar`` on the model's whole output
            tensor (a tensor output, else its ``logits``, else its first
            element); default half the sum of squares.
        steps: forward/backward passes; with more than one, each is followed
            by an SGD step (lr 0.1) on both copies and the parameters are
            compared after the last. Boundaries are compared on the first.
        atol, rtol: a tensor passes when ``|parallel - one process| <=
            atol + rtol * max|one process|`` everywhere (``max`` over that
            tensor: a gradient's small entries carry the rounding of its
            large ones). Defaults by the dtype of the
            model's first floating parameter (:data:`DEFAULT_TOLERANCES`):
            float64 1e-9/1e-7, float32 1e-5/1e-4, float16 1e-3/1e-3,
            bfloat16 1e-2/1.6e-2.
        input_placements: ``{position or keyword: placements}`` of inputs the
            parallel model takes sharded (``{0: "S(1)"}`` for a sequence-
            parallel model; ``torch.chunk`` pieces); others are ``R``.
        output_placement: the placements of the parallel model's output
            tensor (``"S(1)"``, ``"P(sum)"``; default ``R``); it is read back
            to the whole output for the loss.
        axis: the tensor-parallel mesh axis, as :func:`tplower.parallelize`.
        seed: the seed ``build_model`` runs under.
        progress: called as ``progress(done, total)`` while comparing (a progress bar).
        experts: as :func:`tplower.parallelize`: with ``"auto"``, ``"tp"``
            (tensor parallelism inside the experts) or ``"ep"`` (expert
            parallelism; the experts module's boundaries are checked like
            any other: its inputs' pieces, its gathered output, its gradients).
        context, context_mode, balance: with ``context`` (a mesh axis), the
            model is parallelized with context parallelism over it and checked
            by :func:`~tplower.verification.context.verify_context`:
            ``example_inputs`` is then the whole batch (``input_ids`` and
            ``labels``), the mesh may have the context axis beside ``axis``,
            and the rows are the attention modules' exchanges (their outputs
            and the gradients arriving there, gathered over the axis), then the
            loss, the logits and every parameter gradient. ``loss_fn``,
            ``steps``, ``input_placements`` and ``output_placement`` are not
            taken with it (the model's own loss is compared).

    Returns:
        A :class:`~tplower.verification.report.VerifyReport`, the same on every
        rank: ``ok``, ``first_divergence`` (module, tensor, max difference,
        likely cause, suggested plan change), ``table()``, ``to_dict()``. A
        parallel forward that raises inside a boundary (shapes that no longer
        fit) is a finding too: the check of that module carries the exception
        in ``error``, the local shapes and placements that met there, and for a
        linear layer the likely cause and fix; nothing after it runs.

    Raises:
        TypeError: ``build_model`` not callable or not returning an
            ``nn.Module``, ``mesh`` not a ``DeviceMesh``, ``loss_fn`` not
            callable, inputs of another type, an output without a tensor.
        ValueError: a mesh of more than one axis, ``steps`` below 1, a negative tolerance, an
            ``input_placements`` key that is no input, a Partial input, or ``experts`` neither
            ``"tp"`` nor ``"ep"``.
        TPLowerError: the plan does not install (see :func:`tplower.parallelize`).
    """
    if context is not None:
        if loss_fn is not None or steps != 1 or input_placements or output_placement is not None:
            raise ValueError("verify: with context=, the model's own loss is compared on one pass; drop loss_fn, "
                             "steps, input_placements and output_placement")
        ref_tol = DEFAULT_TOLERANCES[torch.float32]
        return verify_context(build_model, plan, mesh, example_inputs, context=context, context_mode=context_mode,
                              balance=balance, axis=axis, experts=experts,
                              atol=ref_tol[0] if atol is None else float(atol),
                              rtol=ref_tol[1] if rtol is None else float(rtol), seed=seed)
    _check_args(build_model, mesh, loss_fn, steps, atol, rtol)
    if experts not in ("tp", "ep"):
        raise ValueError(f"verify: experts={experts!r}; allowed: 'tp' (tensor parallelism inside the experts), "
                         "'ep' (expert parallelism)")
    loss = loss_fn or _default_loss
    args, kwargs = _as_args(example_inputs)
    ref, par = _build(build_model, seed), _build(build_model, seed)
    atol_, rtol_ = _tolerances(ref, atol, rtol)
    cmp = Comparer(mesh, atol_, rtol_)
    parallelize(par, mesh, plan, axis=axis, experts=experts)
    ref_rec, par_rec = Recorder(), Recorder()
    specs = hook_parallel(par, par_rec)
    hook_reference(ref, specs, ref_rec)
    given: dict[int | str, Any] = dict(enumerate(args))
    given.update(kwargs)
    ref_in = {k: _leaf(v) for k, v in given.items()}
    par_in, in_places = _placed_inputs(args, kwargs, mesh, dict(input_placements or {}))
    ref_out = _first_tensor(_call(ref, ref_in))
    loss(ref_out).backward()
    try:
        local_out, failed = _first_tensor(_call(par, par_in)), None
    except Exception as exc:  # a boundary whose shapes no longer fit: a finding, named where it was raised
        if not par_rec.open:
            raise
        failed = raised_check(par, par_rec.open[-1], exc, mesh.size(), par_rec.seq)
    if cmp.allmax(0.0 if failed is None else 1.0) > 0:  # every rank returns the report alike
        return _raised_report(par, par_rec, ref_rec, ref, cmp, failed, progress)
    rep = ",".join("R" for _ in range(mesh.ndim))
    out_place = parse_placements(output_placement or rep, mesh.mesh_dim_names, ndim=mesh.ndim,
                                 arg="output_placement", tensor_ndim=ref_out.ndim)
    whole = redistribute_local(local_out, mesh, out_place, rep, grad=rep, global_shape=tuple(ref_out.shape))
    loss(whole).backward()
    n_params = len(list(ref.parameters())) * (2 if steps > 1 else 1)
    tick = Ticker(progress, len(par_rec.points) + n_params)
    checks = point_checks(ref_rec, par_rec, ref, par, cmp, tick)
    checks.append(model_check("forward", "(model output)", "output", whole.detach(), ref_out.detach(),
                               par_rec.seq, cmp, format_placements(out_place)))
    checks += input_checks(ref_in, par_in, in_places, cmp, par_rec.grad_seq)
    checks += param_checks(ref, par, cmp, "param_grad", tick)
    if steps > 1:
        ref_rec.active = par_rec.active = False
        train(ref, par, ref_in, par_in, loss, steps, mesh, out_place, rep, tuple(ref_out.shape))
        checks += param_checks(ref, par, cmp, "param_after_steps", tick)
    tick.finish()
    return VerifyReport(verdicts(par, par_rec, checks), tuple(checks), atol_, rtol_, mesh.size())
