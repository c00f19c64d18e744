"""Install: the third stage of :func:`tplower.parallelize`, boundaries and hooks put on the model.

For each :class:`~tplower.nn.resolve.ModulePlan` with a boundary, the
module's ``local_attrs`` take their local values and its instance
``forward`` (never the class or its source) becomes a
:class:`~tplower.runtime.boundary._Boundary` that takes the parameters'
local tensors, moves the declared inputs, runs the local compute (the
module's own, the plan's ``local_compute``, or expert parallelism's dispatch
around it), moves the declared outputs and adds a deferred bias. Then the
model-wide pieces: siblings that read one tensor share its move
(:mod:`tplower.runtime.fanout`), LoRA adapters are placed and watched for
(:mod:`tplower.adapters.lora`), dropout streams, the coverage probe, whole
``load_state_dict`` and ``save_pretrained``, the refusal of DistributedDataParallel
(:mod:`tplower.runtime.ddp_guard`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate

from ..adapters.lora import is_lora_layer, place_lora_layer, watch_registrations
from ..adapters.peft_save import collective_peft_save, is_peft_model
from ..core.lower.redistribute import MeshLowerer, mesh_lowerer
from ..plans.entries import BoundaryEntry
from ..runtime.boundary import _Boundary
from ..runtime.ddp_guard import refuse_ddp
from ..runtime.dropout import install_dropout_streams
from ..runtime.experts import ExpertDispatch
from ..runtime.fanout import link_fanouts
from ..runtime.rest_params import RestParams
from ..state.full_state import patch_save_pretrained, register_full_load
from .calls import install_call_checks
from .coverage import install_coverage
from .moves import known_sizes
from .place import place_module
from .resolve import ModulePlan, ResolvedPlan, bind_compute, resolve_module

__all__ = ["install_boundaries", "install_hooks", "install_module"]


def install_module(module: nn.Module, mp: ModulePlan, lowerer: MeshLowerer, axis: str, overlap: bool = False) -> None:
    """Set ``mp``'s local attributes on ``module`` and, when it has a boundary, install it as the instance forward.

    ``overlap``: where the boundary allows it, run it as one node whose input gradient's all_reduce overlaps the
    weight gradient (:mod:`tplower.runtime.overlap`).
    """
    for attr, value in mp.local_attrs:
        setattr(module, attr, value)
    if mp.info is None:
        return
    compute = bind_compute(module, mp)
    if mp.num_experts is not None:
        compute = ExpertDispatch(compute, mp.num_experts, lowerer, lowerer.names.index(axis), mp.qual)
    outs = known_sizes(module, mp.outs, mp.ins, dict(mp.layouts), mp.num_experts is not None, lowerer, axis)
    boundary = _Boundary(mp.info, module, compute, mp.ins, outs, lowerer, mp.layouts, mp.lookup)
    if mp.tail:
        boundary.tail = mp.tail
        boundary.tail_rep = tuple(Replicate() for _ in lowerer.names)
        boundary.tail_grad = tuple(Partial() if n == axis else Replicate() for n in lowerer.names)
    if mp.share:
        boundary.share, boundary.share_n = mp.share, mp.share_n
    boundary.entry, boundary.axis = mp.entry, axis
    boundary.region = mp.region
    boundary.overlap = overlap
    module.forward = boundary


def _install_adapter(module: nn.Module, qual: str, entry: BoundaryEntry, lowerer: MeshLowerer, axis: str) -> None:
    """Resolve, place and install one LoRA adapter's entry (:mod:`tplower.adapters.lora`), whole parameters in place."""
    mp = resolve_module(module, qual, entry, lowerer, axis)
    place_module(module, mp, {})
    install_module(module, mp, lowerer, axis)
    register_full_load(module)


def install_boundaries(model: nn.Module, resolved: ResolvedPlan, mesh: DeviceMesh, overlap: bool = False) -> None:
    """Install every boundary of ``resolved`` on ``model`` (its parameters placed), shared sibling moves and
    LoRA adapters (placed from their base's entry, now and whenever PEFT adds one); ``overlap`` as
    :func:`install_module`."""
    lowerer, axis = mesh_lowerer(mesh), resolved.axis
    modules = dict(model.named_modules())
    for mp in resolved:
        install_module(modules[mp.qual], mp, lowerer, axis, overlap)
    link_fanouts(modules)  # siblings that read one tensor (q, k, v; gate, up) share its move
    watch_registrations(_install_adapter)
    for qual, module in modules.items():  # adapters added before parallelize: placed from their base's entry
        if is_lora_layer(module):
            place_lora_layer(module, qual)


def install_hooks(model: nn.Module, resolved: ResolvedPlan, mesh: DeviceMesh, rest: RestParams | None,
                  cover: str) -> None:
    """The model-wide hooks: dropout streams, the coverage probe, whole ``load_state_dict`` and ``save_pretrained``,
    the refusal of DistributedDataParallel."""
    lowerer, axis = mesh_lowerer(mesh), resolved.axis
    modules = dict(model.named_modules())
    if axis in lowerer.names:
        boundaries = [b for m in modules.values() if isinstance(b := m.__dict__.get("forward"), _Boundary)]
        install_dropout_streams(model, boundaries, mesh.device_type, lowerer.coord[lowerer.names.index(axis)])
        install_coverage(model, mesh, axis, rest, cover)
    register_full_load(model)  # load_state_dict of whole tensors: each rank takes its boxes
    refuse_ddp(model)  # DistributedDataParallel: one TPLowerError line, not a crash or frozen weights
    if is_peft_model(model):  # PeftModel.save_pretrained writes whole adapters
        collective_peft_save()
    else:
        patch_save_pretrained(model)  # save_pretrained writes whole weights from rank 0
    install_call_checks(model, resolved)  # ahead of every pre-hook: a part without context, labels on sharded logits
