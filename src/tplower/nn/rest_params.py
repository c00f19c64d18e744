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
plain tensor.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from .params import ParamLayout, local_parameter, param_layout, shard_parameter

__all__ = ["place_rest"]

Slot = tuple[nn.Module, str, ParamLayout]


class _Swap:
    """Forward pre/post hooks of one module: its slots' DTensors out, local views in, and back."""

    def __init__(self) -> None:
        self.slots: list[Slot] = []
        self.stack: list[list[tuple[nn.Module, str, Any]]] = []

    def pre(self, module: nn.Module, args: Any) -> None:
        swapped: list[tuple[nn.Module, str, Any]] = []
        for owner, name, layout in self.slots:
            p = owner._parameters.get(name)
            if isinstance(p, DTensor):  # not already local inside an outer call's swap
                owner._parameters[name] = local_parameter(p, layout)  # type: ignore[assignment]
                swapped.append((owner, name, p))
        self.stack.append(swapped)

    def post(self, module: nn.Module, args: Any, out: Any) -> None:
        if self.stack:
            for owner, name, p in self.stack.pop():
                owner._parameters[name] = p


def place_rest(modules: dict[str, nn.Module], mesh: DeviceMesh, axis: str) -> int:
    """Make every plain parameter of ``modules`` a ``Replicate`` DTensor and install the swaps; the count made.

    Args:
        modules: ``dict(model.named_modules())`` after the plan is installed.
        mesh: the mesh of :func:`tplower.parallelize`; the DTensors live on ``mesh[axis]``.
        axis: the tensor-parallel axis.
    """
    names = tuple(mesh.mesh_dim_names or ())
    layout = param_layout(mesh, tuple(Replicate() for _ in names), None, axis)
    made: dict[int, nn.Parameter] = {}
    swaps: dict[int, tuple[nn.Module, _Swap]] = {}

    def swap_of(module: nn.Module) -> _Swap:
        if id(module) not in swaps:
            swaps[id(module)] = (module, _Swap())
        return swaps[id(module)][1]

    for qual, module in modules.items():
        for name, p in list(module._parameters.items()):
            if p is None or isinstance(p, DTensor):
                continue
            if id(p) not in made:
                made[id(p)] = shard_parameter(p, layout, f"module {qual!r}: parameter {name!r}")
            module._parameters[name] = made[id(p)]
            parent = modules[qual.rpartition(".")[0]] if qual else module
            for user in dict.fromkeys((module, parent)):
                swap_of(user).slots.append((module, name, layout))
    for module, swap in swaps.values():
        module.register_forward_pre_hook(swap.pre)
        module.register_forward_hook(swap.post, always_call=True)
    return len(made)
