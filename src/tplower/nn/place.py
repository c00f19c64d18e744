"""Place: the second stage of :func:`tplower.parallelize`, every planned parameter made a DTensor.

Each parameter a :class:`~tplower.nn.resolve.ModulePlan` lays out becomes an
``nn.Parameter`` holding a DTensor of its placements (``torch.chunk`` pieces
in mesh-axis order, as DTensor; no full copy stays; :mod:`tplower.runtime.params`),
once for a parameter several modules share (tied weights keep one object),
and a packed one is registered for DCP's box-per-part reading. With
``replicate_rest``, every parameter the plan leaves out becomes a
``Replicate`` DTensor as well (:mod:`tplower.runtime.rest_params`), once the
boundaries and the LoRA adapters placed from them are installed
(:func:`place_rest_parameters`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial

from ..context.sequence import SPLIT_KEY
from ..runtime.grad_sums import GradientSums, will_accumulate
from ..runtime.params import ParamLayout, shard_parameter
from ..runtime.rest_params import RestParams, place_rest
from ..state import packed_checkpoint
from .resolve import ModulePlan, ResolvedPlan

__all__ = ["StartSums", "place_module", "place_parameters", "place_rest_parameters", "sum_at_end"]

#: ``id`` of an original parameter -> (its layout, the placed parameter, the original, kept so its id stays taken)
Placed = dict[int, tuple[ParamLayout, nn.Parameter, nn.Parameter]]


def place_module(module: nn.Module, mp: ModulePlan, placed: Placed) -> None:
    """Replace each parameter ``mp`` lays out by its DTensor parameter (a tied one met again: the same object)."""
    for name, layout in mp.layouts:
        p = module._parameters[name]
        assert p is not None
        if id(p) in placed:  # a shared (tied) parameter met again; resolve checked the placements agree
            module._parameters[name] = placed[id(p)][1]
        else:
            new = shard_parameter(p, layout, f"plan[{mp.qual!r}].params[{name!r}]")
            module._parameters[name] = new
            placed[id(p)] = (layout, new, p)
        if layout.packed > 1:  # DCP reads and writes it as one box per part
            packed_checkpoint.register(module, name)


def place_parameters(model: nn.Module, resolved: ResolvedPlan) -> dict[int, ParamLayout]:
    """Place every parameter of ``resolved`` on ``model``.

    Modules outside the plan that hold a placed parameter (a tie) get the placed object too.

    Returns:
        The layout of each placed parameter, by ``id`` of the new (DTensor) parameter.
    """
    modules = dict(model.named_modules())
    placed: Placed = {}
    for mp in resolved:
        place_module(modules[mp.qual], mp, placed)
    for module in modules.values():  # keep ties: modules outside the plan that share a placed parameter
        for name, p in module._parameters.items():
            if p is not None and id(p) in placed:
                module._parameters[name] = placed[id(p)][1]
    return {id(new): layout for layout, new, _ in placed.values()}


def sum_at_end(model: nn.Module, context: str, placed: dict[int, ParamLayout], rest: RestParams | None
               ) -> GradientSums | None:
    """The pass that sums the gradients over ``context`` at the end of backward (:mod:`tplower.runtime.grad_sums`):
    every parameter whose layout sums it there and nothing else, in ``model.parameters()`` order; ``None`` when
    there is none."""
    sums = GradientSums(context)
    for p in model.parameters():
        if id(p) in placed:
            sums_at(sums, p, context, functools.partial(_fixed, placed[id(p)]))
        elif rest is not None and id(p) in rest.layouts:
            sums_at(sums, p, context, functools.partial(rest.layouts.__getitem__, id(p)))
    if not sums.entries:
        return None
    model.register_forward_hook(StartSums(sums), with_kwargs=True)
    return sums


def _fixed(layout: ParamLayout) -> ParamLayout:
    return layout


class _Start(torch.autograd.Function):
    """Identity on the model's outputs; backward: the model's pass runs at this backward's end (its first node)."""

    @staticmethod
    def forward(ctx: Any, sums: GradientSums, empty: bool, *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.sums, ctx.empty = sums, empty
        # a loss is copied (a view could not take ``loss /= n``); logits are not (a copy would double them)
        return tuple(o.clone() if o.numel() <= 1 << 16 else o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        p = ctx.sums.live()
        if p is not None and will_accumulate(p):  # not torch.autograd.grad (it returns what each module sums)
            ctx.sums.start(ctx.empty)
        return (None, None, *grads)


class StartSums:
    """The forward hook on a context-parallel model that passes its outputs through :class:`_Start`.

    So every backward from the model's loss (or, without one, its other outputs) starts the model's gradient
    pass on every rank, even one whose backward reaches none of its parameters (``loss.backward(inputs=...)``
    with parameters only another rank used), and reentrant backwards inside it (reentrant activation
    checkpointing) leave their gradients to it: one pass a backward on every rank. A deep copy of the model
    copies this hook with a pass of its own over the copy's parameters.
    """

    def __init__(self, sums: GradientSums) -> None:
        self.sums = sums

    def __call__(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        if not torch.is_grad_enabled() or torch.compiler.is_compiling() or self.sums.live() is None:
            return None  # (no parameter of the pass trains: frozen, or FSDP2 holds its own since)
        split = kwargs.get(SPLIT_KEY)
        empty = split is not None and not split.layout.local_length(split.rank)  # a placeholder token alone

        def wrap(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out: tuple[torch.Tensor, ...] = _Start.apply(self.sums, empty, *ts)
            return out

        def trains(t: Any) -> bool:
            return isinstance(t, torch.Tensor) and t.requires_grad

        if isinstance(output, torch.Tensor):
            return wrap(output)[0] if trains(output) else None
        if trains(getattr(output, "loss", None)):
            output.loss = wrap(output.loss)[0]  # a ModelOutput's attribute and item are one
            return output
        if isinstance(output, tuple) and not hasattr(output, "keys"):
            at = [i for i, t in enumerate(output) if trains(t)]
            if not at:
                return None
            items = list(output)
            for i, t in zip(at, wrap(*(output[i] for i in at)), strict=True):
                items[i] = t
            return type(output)(items) if type(output) is tuple else tuple(items)
        if hasattr(output, "keys"):  # a ModelOutput without a loss: its tensors (logits, ...)
            names = [k for k in output.keys() if trains(output[k])]
            for k, t in zip(names, wrap(*(output[k] for k in names)) if names else (), strict=True):
                output[k] = t
            return output
        return None


def sums_at(sums: GradientSums, p: nn.Parameter, context: str, layout: Callable[[], ParamLayout]) -> None:
    """Take ``p`` into ``sums`` when its layout's gradient is ``P(sum)`` on ``context`` and only summed."""
    now = layout()
    names = tuple(now.mesh.mesh_dim_names or ())
    if now.sums_only and now.grad is not None and context in names \
            and isinstance(now.grad[names.index(context)], Partial):
        sums.add(p, layout)


def place_rest_parameters(model: nn.Module, resolved: ResolvedPlan, mesh: DeviceMesh) -> RestParams | None:
    """Every parameter still plain (the plan's rest; LoRA adapters were placed from their base before) as a
    ``Replicate`` DTensor on the plan's axis (and the context axis, its gradient summed there); ``None`` when
    the mesh has neither.

    Returns:
        The replicated rest's record (for the coverage probe).
    """
    summed = (resolved.context,) if resolved.context is not None else ()
    if resolved.axis not in resolved.names and not summed:
        return None
    return place_rest(dict(model.named_modules()), mesh, resolved.axis, summed)
