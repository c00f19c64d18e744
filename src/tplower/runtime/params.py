"""Parameters of a parallelized module: DTensors outside, local tensors inside the forward.

Every tool of the training stack finds sharded parameters by their type:
``state_dict`` and DCP read placements and global shapes from them,
``clip_grad_norm_`` reduces a DTensor norm over its mesh, FSDP2's
``fully_shard`` stacks its data-parallel placement on a DTensor parameter,
optimizers step DTensors. So :func:`tplower.parallelize` turns each parameter
a plan places into an ``nn.Parameter`` holding a DTensor with the plan's
placements and the global shape (:func:`shard_parameter`), exactly as
PyTorch's ``parallelize_module`` does.

The forward then takes each parameter's local tensor once, differentiably
(:func:`local_parameter`): ``DTensor.to_local`` (its backward wraps the local
gradient as a DTensor of the parameter's own placements, so ``.grad`` is a
DTensor like the parameter), preceded in backward by the reduction the
parameter's local gradient needs, run as one of tplower's lowered
transitions. A replicated parameter used on sharded activations (a norm under
sequence parallelism, a row-parallel bias added to a sequence shard) gets a
partial local gradient: ``R -> R`` with gradient ``P(sum)``, i.e. an
identity forward and an ``all_reduce`` backward (Megatron's
``copy_to_tp_region``). The reduction belongs to this differentiable step,
never to a hook on the ``Parameter`` object, which FSDP2 and other wrappers
replace. The one exception is the sum over a context-parallel axis, whose
ranks may call different modules: it waits for the end of backward and runs
for the whole model at once (:mod:`tplower.runtime.grad_sums`).

Mesh of a parameter: where the plan places it on the tensor-parallel axis only (every other axis ``Replicate``),
the DTensor lives on ``mesh[axis]``, as with ``parallelize_module(model, mesh["tp"], ...)``, so FSDP2 can add its
own axis; otherwise on the whole mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..core.language.placements import format_placements
from ..core.language.transitions import chunk_size_and_offset
from ..core.lower.program import Program
from ..core.lower.redistribute import mesh_lowerer
from ..core.support.errors import TPLowerError
from ..core.support.fake import used_flags
from .grad_sums import defer_gradients, folded_axis, owners

__all__ = ["ParamLayout", "check_plain_parameter", "local_parameter", "local_parameters", "param_layout",
           "shard_parameter"]

Placements = tuple[Placement, ...]


@dataclass(frozen=True)
class ParamLayout:
    """Where one parameter lives: its mesh, its placements there, the placement of its local gradient.

    Attributes:
        mesh: the DTensor's mesh (``mesh[axis]`` or the whole mesh).
        placements: one placement per axis of ``mesh`` (``Shard`` or ``Replicate``).
        grad: placements of the local gradient the forward makes, when they
            differ from ``placements`` (``P(sum)`` where each rank's gradient
            is partial), else ``None``.
        packed: the parameter packs this many equal parts along its shard
            dim, each sharded on its own (``1``: not packed).
        use: placements at which the forward uses the local value, when
            they differ from ``placements`` (``P(sum)`` where a replicated
            parameter is added into a partial sum: each rank uses its ``1/n``
            share, DTensor's ``R -> P`` partition, and the gradient arrives
            whole), else ``None``.
    """

    mesh: DeviceMesh
    placements: Placements
    grad: Placements | None
    packed: int = 1
    use: Placements | None = None
    #: the gradient's reduction is a sum over some axes and nothing else (``P(sum) -> R`` there, the rest
    #: unchanged): one all_reduce that may run on several parameters' gradients flattened together
    sums_only: bool = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        sums = self.grad is not None and self.use is None and all(
            g == q or (isinstance(g, Partial) and g.reduce_op == "sum" and isinstance(q, Replicate))
            for g, q in zip(self.grad, self.placements, strict=True))
        object.__setattr__(self, "sums_only", sums)

    def dtensor_placements(self) -> Placements:
        """The DTensor's placements: ``Shard(d)`` of a packed parameter is ``_StridedShard(d, split_factor=k)``."""
        if self.packed == 1:
            return self.placements
        return tuple(_StridedShard(q.dim, split_factor=self.packed) if isinstance(q, Shard) else q
                     for q in self.placements)


def param_layout(mesh: DeviceMesh, placements: Placements, grad: Placements | None, axis: str,
                 packed: int = 1, use: Placements | None = None, summed: tuple[str, ...] = ()) -> ParamLayout:
    """The :class:`ParamLayout` of a parameter placed by ``placements`` (one per axis of ``mesh``).

    Args:
        mesh: the mesh :func:`tplower.parallelize` was given.
        placements: the parameter's placements on ``mesh`` (``Shard``/``Replicate``).
        grad: its local gradient's placements on ``mesh`` (``None``: as ``placements``).
        axis: the tensor-parallel axis name.
        packed: parts packed along the shard dim (see :class:`ParamLayout`).
        use: the placements the forward uses its local value at (``None``: as ``placements``).
        summed: axes the parameter is replicated over whose ranks see different data (a context-parallel
            axis: each rank's gradient covers its own tokens), so its local gradient is ``P(sum)`` there
            and is all-reduced in backward. Must be ``Replicate`` in ``placements``.

    Returns:
        The layout on the sub-mesh of ``axis`` and ``summed`` (those the mesh has, in mesh order) when the
        parameter is ``Replicate`` on every other axis, gradient and use too (as ``parallelize_module(model,
        mesh["tp"], ...)`` places it, so FSDP2 can add its own axis); else on the whole mesh.
    """
    names = tuple(mesh.mesh_dim_names or ())
    if summed:
        base = tuple(grad) if grad is not None else tuple(placements)
        grad = tuple(Partial() if n in summed else q for n, q in zip(names, base, strict=True))
    grad = None if grad is None or tuple(grad) == tuple(placements) else tuple(grad)
    use = None if use is None or tuple(use) == tuple(placements) else tuple(use)
    keep = [j for j, n in enumerate(names) if n == axis or n in summed]
    if mesh.ndim > 1 and keep:
        others = [j for j in range(mesh.ndim) if j not in keep]
        if all(isinstance(placements[j], Replicate) and all(o is None or isinstance(o[j], Replicate)
                                                            for o in (grad, use)) for j in others):
            sub = mesh[names[keep[0]]] if len(keep) == 1 else mesh[tuple(names[j] for j in keep)]
            return ParamLayout(sub, tuple(placements[j] for j in keep),
                               None if grad is None else tuple(grad[j] for j in keep), packed,
                               None if use is None else tuple(use[j] for j in keep))
    return ParamLayout(mesh, tuple(placements), grad, packed, use)


def check_plain_parameter(p: torch.Tensor, where: str) -> None:
    """Refuse a parameter that is already a DTensor (sharded by ``parallelize_module`` or a first call).

    Raises:
        TPLowerError: naming ``where``, the placements and the mesh it has.
    """
    if isinstance(p, DTensor):
        raise TPLowerError(
            f"{where} is already a DTensor ({format_placements(p.placements)} on mesh {p.device_mesh}); "
            "tplower.parallelize takes a model whose parameters hold their full values as plain tensors "
            "(parallelize a fresh model, not one parallelize_module or tplower already sharded)")


def shard_parameter(p: nn.Parameter, layout: ParamLayout, where: str) -> nn.Parameter:
    """This rank's shard of full parameter ``p`` as an ``nn.Parameter`` holding a DTensor of ``layout``.

    Shards are ``torch.chunk`` pieces in mesh-coordinate order, as
    ``distribute_tensor``; a packed parameter gives each rank its piece of
    every part, concatenated (``_StridedShard`` semantics). No collective
    runs (every rank holds the full value) and no full-size storage is kept
    (the shard is a fresh contiguous copy).

    Args:
        p: the full parameter (global shape ``S``).
        layout: its mesh and placements.
        where: ``plan['module'].params['name']``, for messages.

    Returns:
        A new ``nn.Parameter`` (same ``requires_grad``) whose DTensor has
        global shape ``S`` and this rank's ``torch.chunk`` piece of each
        shard dim (uneven when the dim does not divide, as
        ``distribute_tensor`` makes it; a packed parameter's parts each so).

    Raises:
        TPLowerError: a packed parameter whose parts are not equal.
    """
    coord = layout.mesh.get_coordinate()
    assert coord is not None, "parallelize checks that this rank is in the mesh"
    parts = list(p.detach().chunk(layout.packed, _shard_dim(layout))) if layout.packed > 1 else [p.detach()]
    if len(parts) != layout.packed or len({t.shape for t in parts}) != 1:
        raise TPLowerError(f"{where}: size {p.shape} does not pack {layout.packed} equal parts on dim "
                           f"{_shard_dim(layout)}")
    for i, q in enumerate(layout.placements):
        if isinstance(q, Shard):  # torch.chunk pieces: ceil-sized first, the last ones smaller or empty
            size, n = parts[0].size(q.dim), layout.mesh.size(i)
            piece, offset = chunk_size_and_offset(size, n, coord[i])
            parts = [t.narrow(q.dim, offset, piece) for t in parts]
    local = torch.cat(parts, _shard_dim(layout)) if len(parts) > 1 else parts[0]
    local = local.clone(memory_format=torch.contiguous_format)
    dt = DTensor.from_local(local, layout.mesh, layout.dtensor_placements(), run_check=False, shape=p.shape,
                            stride=torch.empty(p.shape, device="meta").stride())
    return nn.Parameter(dt, requires_grad=p.requires_grad)


class _LocalView(torch.autograd.Function):
    """DTensor parameter -> a view of its local tensor; backward: reduce the local gradient, wrap it as a DTensor.

    ``DTensor.to_local`` does the same with ``DTensor.from_local`` in its
    backward, which costs about 120 µs per parameter on CPU (a new spec,
    checks); the gradient here has exactly the parameter's local shape and
    placements, so it is wrapped with the parameter's own spec (a few µs).
    """

    @staticmethod
    def forward(ctx: Any, param: DTensor, layout: ParamLayout) -> torch.Tensor:  # type: ignore[override]
        ctx.spec, ctx.layout = param._spec, layout  # only a summed gradient is the pass's: plain tp skips the lookup
        ctx.owned = owners((param,)) if layout.grad is not None else None
        local = param._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DTensor | None, None]:  # type: ignore[override]
        if ctx.owned is not None and _defer(ctx, ctx.layout, (grad,), (grad.shape,), (ctx.spec,), grad.dtype,
                                            grad.device)[0]:
            return None, None  # summed with the model's others at the end of backward (grad_sums)
        layout: ParamLayout = ctx.layout
        if layout.grad is not None:  # e.g. P(sum) -> R: all_reduce (no autograd here: grad mode is off)
            grad = mesh_lowerer(layout.mesh).program(layout.grad, layout.placements, grad.shape,
                                                     grad.device.type)(grad)
        grad = grad.contiguous()
        if grad.storage_offset() or grad.untyped_storage().nbytes() != grad.numel() * grad.element_size():
            grad = grad.clone()  # a slice of a larger gradient: storage of its own (torch.save, deepcopy take it)
        return DTensor(grad, ctx.spec, requires_grad=False), None


class _LocalViews(torch.autograd.Function):
    """Several DTensor parameters -> views of their local tensors; backward: their gradients summed in one all_reduce.

    For parameters whose layouts all have :attr:`ParamLayout.sums_only` on
    the same mesh, placements and gradient placements, and one dtype and
    device: the local gradients are flattened into one buffer, reduced by one
    collective (the ``P(sum) -> R`` a single parameter's :class:`_LocalView`
    runs, on the buffer, in place) and handed back as views of it, each
    wrapped with its parameter's own spec. A sum is elementwise, so each
    gradient is the one :class:`_LocalView` gives (the same additions; the
    order of a reduction over more than two ranks may differ by rounding).
    The buffer ends with one flag a parameter (1 where this rank's forward
    used it), summed with the gradients: a parameter no rank used gets no
    gradient (``None``, as in one process, so weight decay and momentum leave
    it alone), one that some rank used gets the sum, zeros standing in for the
    ranks that did not; every rank issues the same collective. The flags are
    read only on a rank that lacks a gradient (on a GPU, the one host sync);
    a rank whose views got no gradient at all still takes part, with zeros.
    Each gradient handed back has storage of its own (a copy of its slice of
    the buffer): ``torch.save``, pickling and ``copy.deepcopy`` take it, which
    they refuse for a DTensor over a view at an offset into a shared buffer.

    Over a context axis, the sum waits for the model's end-of-backward pass
    (:mod:`tplower.runtime.grad_sums`: one order on every rank, whichever
    modules a rank called) when the backward accumulates into ``.grad``.
    """

    @staticmethod
    def forward(ctx: Any, layout: ParamLayout, *params: DTensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.specs, ctx.layout, ctx.owned = tuple(p._spec for p in params), layout, owners(params)
        ctx.shapes = tuple(p._local_tensor.shape for p in params)
        ctx.dtype, ctx.device = params[0]._local_tensor.dtype, params[0]._local_tensor.device
        ctx.set_materialize_grads(False)
        return tuple(p._local_tensor.view_as(p._local_tensor) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[DTensor | None, ...]:  # type: ignore[override]
        layout: ParamLayout = ctx.layout
        assert layout.grad is not None
        taken = _defer(ctx, layout, grads, ctx.shapes, ctx.specs, ctx.dtype, ctx.device) \
            if ctx.owned is not None else None
        if taken is not None and all(taken):
            return (None,) * (len(grads) + 1)  # summed with the model's others at the end of backward (grad_sums)
        if taken is not None and any(taken):  # some views' gradients are not for .grad here: not deferred
            rest = [k for k, t in enumerate(taken) if not t]
            sub = _sum_views(layout, [grads[k] for k in rest], [ctx.shapes[k] for k in rest],
                             [ctx.specs[k] for k in rest], ctx.dtype, ctx.device)
            out: list[DTensor | None] = [None] * (len(grads) + 1)
            for k, g in zip(rest, sub, strict=True):
                out[k + 1] = g
            return tuple(out)
        return (None, *_sum_views(layout, grads, ctx.shapes, ctx.specs, ctx.dtype, ctx.device))


def _defer(ctx: Any, layout: ParamLayout, grads: Sequence[torch.Tensor | None], shapes: Sequence[torch.Size],
           specs: Sequence[Any], dtype: torch.dtype, device: torch.device) -> list[bool]:
    """Hand the gradients the end-of-backward pass takes to it (:func:`~tplower.runtime.grad_sums.defer_gradients`),
    summed first over their current layout's other axes (tensor parallelism's, whose ranks call the same modules;
    a replicated parameter's layout may have changed since this forward), here; which ones were taken."""
    taken = defer_gradients(ctx, ctx.owned)
    by: dict[ParamLayout, list[int]] = {}
    for k, t in enumerate(taken):
        if t:
            sums, index = ctx.owned[k]
            by.setdefault(_without_sum(sums.entries[index][1](), sums.axis), []).append(k)
    for other, keep in by.items():
        mine: list[torch.Tensor | None] = [grads[k] for k in keep]
        if other.grad is not None:
            summed = _sum_views(other, mine, [shapes[k] for k in keep], [specs[k] for k in keep], dtype, device)
            mine = [None if d is None else d._local_tensor for d in summed]
        for k, g in zip(keep, mine, strict=True):
            ctx.owned[k][0].wait(ctx.owned[k][1], g)
    return taken


def _sum_views(layout: ParamLayout, grads: Sequence[torch.Tensor | None], shapes: Sequence[torch.Size],
               specs: Sequence[Any], dtype: torch.dtype, device: torch.device) -> list[DTensor | None]:
    """The gradients summed from ``layout.grad`` to its placements, in one all_reduce with the flags
    (:class:`_LocalViews`' docstring)."""
    assert layout.grad is not None
    own = [g is not None for g in grads]
    flags = torch.tensor([float(u) for u in own], dtype=dtype, device=device)
    flat = torch.cat([*(torch.zeros(shape, dtype=dtype, device=device).reshape(-1) if g is None
                        else g.reshape(-1) for g, shape in zip(grads, shapes, strict=True)), flags])
    flat = mesh_lowerer(layout.mesh).program(layout.grad, layout.placements, flat.shape,
                                             flat.device.type).run_owned(flat)
    used = used_flags(flat[-len(grads):], own) if not all(own) else own
    out: list[DTensor | None] = []
    start = 0
    for shape, spec, any_rank in zip(shapes, specs, used, strict=True):
        n = shape.numel()
        if any_rank:
            out.append(DTensor(flat[start:start + n].view(shape).clone(), spec, requires_grad=False))
        else:
            out.append(None)
        start += n
    return out


def local_parameters(params: Sequence[torch.Tensor | None], layouts: Sequence[ParamLayout]
                     ) -> list[torch.Tensor | None]:
    """:func:`local_parameter` of each of ``params`` (``None`` stays ``None``), the gradients' sums grouped.

    Parameters whose gradients are summed over the same axes (:attr:`ParamLayout.sums_only`: a replicated
    parameter on sharded activations, every parameter under context parallelism) of one mesh, placements,
    dtype and device share one ``all_reduce`` in backward (:class:`_LocalViews`) instead of one each; the
    gradients are those :func:`local_parameter` gives. Under ``torch.compile``, without grad mode, and for
    every other parameter, each is :func:`local_parameter`'s. A parameter whose sum over a context axis FSDP2
    runs (:func:`tplower.sum_context_in_fsdp`) is summed here over its other axes only.

    Args:
        params: one module's parameters (DTensors, or what a wrapper put there).
        layouts: their layouts, one per parameter.

    Returns:
        The local tensors, in the order of ``params``.
    """
    out: list[torch.Tensor | None] = [None] * len(params)
    groups: dict[tuple[Any, ...], list[int]] = {}
    eager = torch.is_grad_enabled() and not torch.compiler.is_compiling()
    layouts = list(layouts)
    for i, (p, layout) in enumerate(zip(params, layouts, strict=True)):
        if p is None:
            continue
        if layout.grad is not None and (axis := folded_axis(p)) is not None:  # FSDP2 sums over the axis
            layouts[i] = layout = _without_sum(layout, axis)
        if eager and layout.sums_only and isinstance(p, DTensor) and p.requires_grad:
            groups.setdefault((layout.mesh, layout.placements, layout.grad, p.dtype, p.device), []).append(i)
        else:
            out[i] = local_parameter(p, layout)
    for members in groups.values():
        if len(members) == 1:
            out[members[0]] = local_parameter(params[members[0]], layouts[members[0]])  # type: ignore[arg-type]
            continue
        views = _LocalViews.apply(layouts[members[0]], *(params[i] for i in members))
        for i, view in zip(members, views, strict=True):
            out[i] = view
    return out


def _without_sum(layout: ParamLayout, axis: str) -> ParamLayout:
    """``layout`` with its gradient no longer summed over ``axis`` (``P(sum)`` there read as the placement); not
    cached: a mesh equal to another by its ranks and names may hold other process groups."""
    names = tuple(layout.mesh.mesh_dim_names or ())
    if layout.grad is None or axis not in names:
        return layout
    j = names.index(axis)
    grad = tuple(layout.placements[j] if k == j else g for k, g in enumerate(layout.grad))
    return ParamLayout(layout.mesh, layout.placements, None if grad == tuple(layout.placements) else grad,
                       layout.packed, layout.use)


def _reduce_program(layout: ParamLayout, local: torch.Tensor) -> Program:
    """Identity forward, the gradient's reduction in backward (``R -> R`` with gradient ``layout.grad``)."""
    assert layout.grad is not None
    return mesh_lowerer(layout.mesh).program(layout.placements, layout.placements, local.shape, local.device.type,
                                             grad=layout.grad)


def _shard_dim(layout: ParamLayout) -> int:
    dims = {q.dim for q in layout.placements if isinstance(q, Shard)}
    if layout.packed > 1 and len(dims) != 1:
        raise TPLowerError(f"a packed parameter is sharded on exactly one dim, not {sorted(dims)}")
    return dims.pop() if dims else 0


def local_parameter(p: torch.Tensor, layout: ParamLayout) -> torch.Tensor:
    """The local tensor of parameter ``p`` for one forward, differentiable into a DTensor ``.grad``.

    Forward: a view of ``p``'s local tensor (no copy), or, with
    ``layout.use``, its transition there (``R -> P(sum)``: divided by the
    axis size, an identity backward). Backward: the local
    gradient moves from ``layout.grad`` to ``layout.placements`` through
    tplower's lowered collectives (``R -> R`` with gradient ``P(sum)``: an
    ``all_reduce``), then becomes a DTensor of ``p``'s own spec, as
    ``DTensor.to_local``'s backward makes it. Under ``torch.compile`` the
    same is built from ``to_local`` and :func:`tplower.redistribute_local`,
    which trace. A ``p`` that is not a DTensor (a wrapper put a plain tensor
    there) is returned as it is.
    """
    if not isinstance(p, DTensor):
        return p
    if layout.grad is not None and (axis := folded_axis(p)) is not None:  # FSDP2 sums over the axis (grad_sums)
        layout = _without_sum(layout, axis)
    local: torch.Tensor
    if torch.compiler.is_compiling():
        local = p.to_local()
        local = local if layout.grad is None else _reduce_program(layout, local)(local)
    elif p.requires_grad and torch.is_grad_enabled():
        local = _LocalView.apply(p, layout)
    else:
        local = p._local_tensor
    if layout.use is None:
        return local
    # R -> P(sum): this rank's 1/n share; its backward is the gradient's own transition (R -> R, identity)
    share = mesh_lowerer(layout.mesh).program(layout.placements, layout.use, local.shape, local.device.type)
    out: torch.Tensor = share(local)
    return out
