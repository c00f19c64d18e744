"""Parameters a plan leaves whole become ``Replicate`` DTensors, local views while the model computes.

After :func:`tplower.parallelize` installs a plan, the parameters it did not
place (norms, embeddings and routers the plan does not name, a module's
parameter its entry does not mention) are plain tensors, and every tool that
takes the whole model (``clip_grad_norm_``, ``foreach``/``fused`` optimizers,
DCP) refuses a mix of DTensor and plain tensors. :func:`place_rest` makes each
a ``Replicate`` DTensor on the tp axis (same values, :func:`shard_parameter`)
and swaps it for its local view (:func:`local_parameter`: differentiable into a
DTensor ``.grad``) around every call that may use it: its own module's and its
parent module's (a mixer that reads ``self.conv1d.weight``, a router that reads
``self.classifier.weight``). A swap finds the parameter already local inside
an outer swap and leaves it; each restores what it swapped, on an exception
too. The gradient is taken as whole on each rank (``R``), as it was for the
plain tensor, until :mod:`tplower.nn.coverage` finds the parameter used on an
activation the plan shards: :meth:`RestParams.reduce_grad` then gives it the
``P(sum)`` gradient (an ``all_reduce`` in backward) from that call on, and a
view made while the coverage probe watches (:attr:`RestParams.watch`) learns
the decision before its backward runs (:class:`_Deferred`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from ..core.lower.redistribute import mesh_lowerer
from .interned import intern, register, slot_key, traced
from .params import ParamLayout, local_parameter, local_parameters, param_layout, shard_parameter

__all__ = ["RestParams", "place_rest"]


@dataclass
class _Slot:
    """One parameter of one module that a swap replaces by its local view (``layout`` changes on a decision).

    ``child``: the hooked module's direct child that owns the parameter, or ``None`` for the hooked module
    itself. The owner is looked up by that name from the hook's own ``module`` argument, the path the
    model's code takes, so under ``torch.compile`` no guard has to prove two paths reach one object;
    ``owner`` is used only where the child was replaced since (a wrapper around it).
    """

    child: str | None
    owner: nn.Module
    name: str
    key: int  # id of the DTensor parameter (shared by tied slots)
    layout: ParamLayout


class _Deferred(torch.autograd.Function):
    """Identity forward; backward reduces the local gradient when the decision (made later) says so."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, rest: RestParams, key: int) -> torch.Tensor:  # type: ignore[override]
        ctx.rest, ctx.key = rest, key
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        layout = ctx.rest.layouts.get(ctx.key)
        if layout is not None and layout.grad is not None:
            grad = mesh_lowerer(layout.mesh).program(layout.grad, layout.placements, grad.shape,
                                                     grad.device.type)(grad)
        return grad, None, None


class _Stack:
    """What the swaps of one model's call put aside, innermost last: ``(module, [(owner, name, DTensor), ...])``.

    Hooks find it by its number (``key``); a deep copy of the model gets a stack of its own.
    """

    def __init__(self) -> None:
        self.items: list[tuple[nn.Module, list[tuple[nn.Module, str, Any]]]] = []
        self.key = register(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Stack:
        new = _Stack()
        memo[id(self)] = new
        return new


@dataclass(frozen=True)
class _SwapStatic:
    """What one swap reads per call: its slots as ``(child, name, layout)`` and its model's stack's number.

    Interned (:mod:`tplower.runtime.interned`): the swaps of a model's every
    norm of one shape share one, so a ``torch.compile`` trace guards on it once.
    """

    stack: int
    slots: tuple[tuple[str | None, str, ParamLayout], ...]
    key: int = field(default=0, compare=False)
    #: two or more slots whose gradients sum alike may share one all_reduce (:func:`local_parameters`); decided here,
    #: from the layouts, so a call without any (plain tensor parallelism) takes each view alone
    grouped: bool = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "grouped", sum(layout.sums_only for _, _, layout in self.slots) > 1)


class _Swap:
    """The forward pre-hook of one module: its slots' DTensors out, local views in (:class:`_Restore` puts them back).

    The pre-hook and the forward hook share no object but the model's stack,
    which a trace finds by number: under ``torch.compile`` neither is guarded as
    an alias of the other, and the stack is one list per model (its
    emptying is the one side effect a compiled call replays), not one per module.
    """

    def __init__(self, rest: RestParams) -> None:
        self.rest = rest
        self.slots: list[_Slot] = []
        self.restatic()

    def restatic(self) -> None:
        """Rebuild what a call reads, after a slot was added or its layout changed."""
        self._set(self.rest.stack, tuple((s.child, s.name, s.layout) for s in self.slots))

    def _set(self, stack: _Stack, slots: tuple[tuple[str | None, str, ParamLayout], ...]) -> None:
        self.static = intern(_SwapStatic(stack.key, slots))
        self.static_key = slot_key(self.static.key)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Swap:
        new = _Swap.__new__(_Swap)
        memo[id(self)] = new
        new.rest = copy.deepcopy(self.rest, memo)
        new.slots = copy.deepcopy(self.slots, memo)
        # the copy may be midway (its slots not filled yet): the layouts are this swap's, the stack the copy's own
        new._set(copy.deepcopy(self.rest.stack, memo), self.static.slots)
        return new

    def pre(self, module: nn.Module, args: Any) -> None:
        compiling = torch.compiler.is_compiling()
        st: _SwapStatic = traced(self.static_key) if compiling else self.static
        swapped: list[tuple[nn.Module, str, Any]] = []
        stack: _Stack = traced(st.stack) if compiling else self.rest.stack
        stack.items.append((module, swapped))  # first: the forward hook pops it whatever happens next
        # the coverage probe never runs traced (it starts eagerly only), and reading it there costs guards
        watch = None if compiling else self.rest.watch
        found: list[tuple[int, nn.Module, str, DTensor, ParamLayout]] = []
        for i, (child, name, layout) in enumerate(st.slots):
            owner = module if child is None else module._modules.get(child)
            if owner is None or name not in owner._parameters:  # the child was wrapped since
                owner = self.slots[i].owner
            p = owner._parameters.get(name)
            if isinstance(p, DTensor):  # not already local inside an outer call's swap
                found.append((i, owner, name, p, layout))
        # one all_reduce in backward for the gradients this call's parameters sum alike (context parallelism)
        views = local_parameters([f[3] for f in found], [f[4] for f in found]) if st.grouped and len(found) > 1 \
            else [local_parameter(f[3], f[4]) for f in found]
        for (i, owner, name, param, layout), view in zip(found, views, strict=True):
            if watch is not None:
                key = self.slots[i].key
                if layout.grad is None and torch.is_grad_enabled() and param.requires_grad:
                    view = _Deferred.apply(view, self.rest, key)
                watch(view, key)  # type: ignore[arg-type]
            owner._parameters[name] = view  # type: ignore[assignment]
            swapped.append((owner, name, param))


class _Restore:
    """The forward hook (always called) of a swapped module: put back what its pre-hook swapped.

    It keeps its model's stack; a traced call reads only the stack's number.
    """

    def __init__(self, stack: _Stack) -> None:
        self.stack, self.key = stack, slot_key(stack.key)

    def __call__(self, module: nn.Module, args: Any, out: Any) -> None:
        stack: _Stack = traced(self.key) if torch.compiler.is_compiling() else self.stack
        items = stack.items
        if items and items[-1][0] is module:
            for owner, name, p in items.pop()[1]:
                owner._parameters[name] = p

    def __deepcopy__(self, memo: dict[int, Any]) -> _Restore:
        return _Restore(copy.deepcopy(self.stack, memo))


class RestParams:
    """The parameters :func:`place_rest` made ``Replicate`` DTensors, and the swaps that make them local.

    Attributes:
        names: ``{key: (module name, parameter name)}``, the first place each parameter was found.
        layouts: ``{key: layout}`` of each parameter (``grad`` set once :meth:`reduce_grad` decided so).
        watch: while set, every view a swap makes is passed to it with its key (the coverage probe).
    """

    def __init__(self, mesh: DeviceMesh, axis: str, summed: tuple[str, ...] = ()) -> None:
        self.mesh, self.axis, self.summed = mesh, axis, summed
        self.names: dict[int, tuple[str, str]] = {}
        self.layouts: dict[int, ParamLayout] = {}
        self.slots: list[_Slot] = []
        self.params: dict[int, nn.Parameter] = {}  # keeps each key's object alive (ids stay unique)
        self.watch: Callable[[torch.Tensor, int], None] | None = None
        self.stack = _Stack()
        self.swaps: list[_Swap] = []

    def reduce_grad(self, key: int) -> None:
        """From now on parameter ``key``'s local gradient is ``P(sum)`` on the axis: all-reduced in backward."""
        names = tuple(self.mesh.mesh_dim_names or ())
        rep = tuple(Replicate() for _ in names)
        grad = tuple(Partial() if n == self.axis else Replicate() for n in names)
        layout = param_layout(self.mesh, rep, grad, self.axis, summed=self.summed)
        self.layouts[key] = layout
        for slot in self.slots:
            if slot.key == key:
                slot.layout = layout
        for swap in self.swaps:
            swap.restatic()


def place_rest(modules: dict[str, nn.Module], mesh: DeviceMesh, axis: str, summed: tuple[str, ...] = ()
               ) -> RestParams:
    """Make every plain parameter of ``modules`` a ``Replicate`` DTensor and install the swaps.

    Args:
        modules: ``dict(model.named_modules())`` after the plan is installed.
        mesh: the mesh of :func:`tplower.parallelize`; the DTensors live on ``mesh[axis]`` (with the
            ``summed`` axes: on those and ``axis``).
        axis: the tensor-parallel axis.
        summed: axes whose ranks see different data (context parallelism): the gradient is summed over
            them (:func:`tplower.runtime.params.param_layout`).

    Returns:
        The :class:`RestParams` made (``len(rest.names)`` of them).
    """
    names = tuple(mesh.mesh_dim_names or ())
    layout = param_layout(mesh, tuple(Replicate() for _ in names), None, axis, summed=summed)
    rest = RestParams(mesh, axis, summed)
    made: dict[int, nn.Parameter] = {}
    swaps: dict[int, tuple[nn.Module, _Swap]] = {}

    def swap_of(module: nn.Module) -> _Swap:
        if id(module) not in swaps:
            swaps[id(module)] = (module, _Swap(rest))
        return swaps[id(module)][1]

    for qual, module in modules.items():
        for name, p in list(module._parameters.items()):
            if p is None or isinstance(p, DTensor):
                continue
            if id(p) not in made:
                made[id(p)] = shard_parameter(p, layout, f"module {qual!r}: parameter {name!r}")
            new = made[id(p)]
            module._parameters[name] = new
            rest.names.setdefault(id(new), (qual, name))
            rest.params[id(new)] = new
            rest.layouts.setdefault(id(new), layout)
            parent = modules[qual.rpartition(".")[0]] if qual else module
            for user in dict.fromkeys((module, parent)):
                slot = _Slot(None if user is module else qual.rpartition(".")[2], module, name, id(new), layout)
                swap_of(user).slots.append(slot)
                rest.slots.append(slot)
    for module, swap in swaps.values():
        swap.restatic()
        rest.swaps.append(swap)
        module.register_forward_pre_hook(swap.pre)
        module.register_forward_hook(_Restore(rest.stack), always_call=True)
    return rest
