"""``parallelize``: a plan installed on an ``nn.Module`` in three stages, resolve, place, install.

1. :func:`tplower.nn.resolve.resolve_plan`: the model's modules and the plan
   into one frozen :class:`~tplower.nn.resolve.ModulePlan` per planned module
   (entry, boundary form, parameter layouts, moves, every check and refusal);
   nothing is changed and no collective issued, so a refused plan leaves the
   model as it was.
2. :func:`tplower.nn.place.place_parameters`: every planned parameter becomes
   an ``nn.Parameter`` holding a DTensor of its placements.
3. :func:`tplower.nn.install.install_boundaries`: each planned module's
   ``local_attrs`` and its boundary as the instance ``forward``, shared
   sibling moves, LoRA adapters; then the rest of the parameters replicated
   (:func:`tplower.nn.place.place_rest_parameters`) and the model-wide hooks
   (:func:`tplower.nn.install.install_hooks`).

Attention head counts: with colwise q/k/v each rank holds ``heads / tp``
heads. A module that reshapes by a stored head count needs its entry to
make it local, e.g. ``local_attrs: {num_attention_heads: divide,
all_head_size: divide}`` on ``encoder.layer.*.attention.self`` for BERT of
older transformers releases (its ``transpose_for_scores``); Llama and BERT
of recent releases (checked on 5.24) reshape with ``-1`` heads and need none.

A sharded activation dim is never assumed to divide: an input whose sharded
source dim no parameter sizes has its sizes exchanged (or, compiled,
checked) each call (:mod:`tplower.runtime.uneven`); ``uneven`` names in an
entry exchange them under ``torch.compile`` too. Run modes: a
``tp_collective`` or ``region`` boundary runs the bound programs of
:class:`tplower.MeshLowerer` (direct collectives, no DTensor); a ``generic``
one runs DTensor's ``redistribute``; a lowerable boundary whose moved axis
runs on a backend tplower does not know runs generic, with a warning naming
the module and the reason. An axis whose process group orders its ranks
unlike the mesh is lowered too: the lowerer puts pieces in mesh-coordinate
order (DTensor there is wrong for uneven shards).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from pathlib import Path

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..context.attention import MODES
from ..context.discover import attention_modules
from ..context.install import install_context
from ..core.lower.redistribute import mesh_lowerer
from ..core.support.argcheck import check_mesh
from ..core.support.errors import TPLowerError
from ..core.support.words import closest
from ..plans.entries import PlanValue, plan_name
from ..runtime.boundary import InstalledBoundary, installed_boundary
from .coverage import COVER_MODES
from .install import install_boundaries, install_hooks
from .place import place_parameters, place_rest_parameters, sum_at_end
from .resolve import ResolvedPlan, resolve_plan

__all__ = ["InstalledBoundary", "attention_tp", "installed_boundary", "parallelize"]


def attention_tp(model: nn.Module, resolved: ResolvedPlan) -> int:
    """How many ways the plan splits the attention heads: the tp axis's size where it shards a projection of an
    attention module (the Ulysses head check divides by it), else 1."""
    if resolved.axis not in resolved.names:
        return 1
    paths = [path + "." for path, _ in attention_modules(model)]
    split = any(mp.qual.startswith(tuple(paths)) and any(
        not all(q.is_replicate() for q in lay.placements) for _, lay in mp.layouts) for mp in resolved)
    return resolved.shape[resolved.names.index(resolved.axis)] if split else 1


def _check_something_to_do(plan: object, mesh: DeviceMesh, axis: str, context: str | None) -> None:
    """Refuse a call that would parallelize nothing: no plan and no ``context``, or a plan named by keyword
    (``"auto"``, ``"derive"``: styles that shard on ``axis``) on a mesh without ``axis``."""
    if plan is None and context is None:
        raise TPLowerError("parallelize: plan=None and context=None: nothing to parallelize (the model would run "
                           "as one process on every rank, and a shard_sequence part would give a wrong loss); give "
                           "a plan ('auto', 'derive', a mapping or a file) for tensor parallelism, or context='cp' "
                           "for context parallelism (plan=None: context parallelism alone)")
    names = tuple(mesh.mesh_dim_names or ())
    keyword = plan_name(plan)
    if keyword is None or axis in names:
        return
    if context is not None:
        fix = (f"use plan=None for context parallelism alone, or add a {axis!r} axis to the mesh "
               f"(init_device_mesh(device, (cp, tp), mesh_dim_names=({context!r}, {axis!r})))")
    else:
        fix = f"add a {axis!r} axis to the mesh, or name its tensor-parallel axis with axis="
    raise TPLowerError(f"parallelize: plan={plan!r} shards modules over axis={axis!r}, but the mesh has no {axis!r} "
                       f"axis (its axes: {names}){closest(axis, names)}: {fix}")


def _check_context_words(context_mode: str, context_grads: str) -> None:
    """Refuse a ``context_mode`` or ``context_grads`` that names no choice (with the closest one)."""
    if context_mode not in MODES:
        raise TPLowerError(f"parallelize: context_mode={context_mode!r}{closest(str(context_mode), MODES)}; "
                           "allowed: 'ulysses' (all_to_all of sequence and heads), 'allgather' (keys and values "
                           "gathered) or 'hybrid' (Ulysses inside groups of the axis, all-gather across)")
    if context_grads not in ("sum", "mean"):
        raise TPLowerError(f"parallelize: context_grads={context_grads!r}{closest(str(context_grads), ('sum', 'mean'))}"
                           "; allowed: 'sum' (parallelize sums the gradients over the context axis) or 'mean' (the "
                           "caller averages them over it, e.g. FSDP2 over dp and the context axis flattened)")


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: Mapping[str, PlanValue] | str | Path | None, *,
                axis: str = "tp", experts: str = "tp", context: str | None = None, context_mode: str = "ulysses",
                context_grads: str = "sum", context_loss_chunk: int | None = None,
                context_ulysses: int | None = None, replicate_rest: bool = True, cover: str = "reduce",
                strict: bool = True, overlap: bool = False) -> nn.Module:
    """Shard ``model`` in place by ``plan`` on ``mesh`` and install each module's lowered boundary.

    Args:
        model: the full model (every parameter holds its full value; each
            rank must hold the same values).
        mesh: the device mesh; this rank must be in it.
        plan: ``{module name or glob: HF style or entry}``, a path to a
            YAML/JSON file of the same (see :mod:`tplower.plans.entries`), or
            ``"auto"``: a transformers model's own plan (see
            :mod:`tplower.plans.hf`; a ``config.base_model_tp_plan`` given
            for a model with a ``base_model_prefix`` is put under it), or
            ``"derive"``: a plan derived from the module structure
            (:func:`tplower.plans.derive.derive_plan`); both names in any
            case (``"Auto"``), and a file of either name is not read. A key
            may also name a parameter (``layers.*.self_attn.sinks``): it is
            placed as the style places a parameter. ``None``: no module is
            planned; with ``context``, context parallelism alone (without
            it there is nothing to do: refused).
        axis: the tensor-parallel mesh axis HF styles shard on.
        experts: how ``"auto"`` parallelizes mixture-of-experts blocks:
            ``"tp"`` (default; the model's ``tp_plan``: every rank holds a
            piece of every expert, the block's output is reduced once) or
            ``"ep"`` (its ``ep_plan`` over the ``tp_plan``: the experts are
            sharded by index over ``axis``, each rank takes its piece of the
            tokens and dispatches each to the rank holding its expert;
            :mod:`tplower.runtime.experts`). Ignored for other plans, whose styles
            say it.
        context: a mesh axis to split every activation's sequence over
            (context parallelism, :mod:`tplower.context`): the model then
            takes the batch from :func:`tplower.shard_sequence`, its attention
            runs over the whole sequence through ``context_mode``'s exchange,
            its ``loss`` is the whole batch's on every rank, and every
            parameter (replicated over the axis) gets its gradient summed
            over it, the way the ``axis`` reductions are. ``None``: none.
        context_mode: ``"ulysses"`` (default: an ``all_to_all`` from sequence
            to heads before the model's own attention and back after it;
            measured 0.95x one process's train step time (two processes
            share the 2 cores measured on) and 0.53x its peak memory at 8192
            tokens, cp=2, where ``"allgather"`` took 0.91x and 0.55x: ``tplower
            bench --phases context``, docs/context.md; padded and packed
            batches alike),
            ``"allgather"`` (keys and values gathered whole,
            the local queries attend to them; no condition on head counts) or
            ``"hybrid"`` (Ulysses inside groups of ``context_ulysses`` ranks,
            all-gather across the groups: for a cp size beyond the heads a
            rank holds, or grouped key/value heads fewer than it).
        context_grads: who reduces the parameters' gradients over
            ``context``: ``"sum"`` (default: ``parallelize``, once at the end
            of backward, in the model's parameter order, zeros and a flag for
            a parameter a rank did not use, so ranks that call different
            modules get one process's gradients,
            :mod:`tplower.runtime.grad_sums`; parameters are
            DTensors replicated over it, FSDP2 may shard them over another
            axis such as ``dp``: then :func:`tplower.sum_context_in_fsdp`) or ``"mean"`` (the caller averages them over
            it, as FSDP2 does over a mesh that flattens ``dp`` and
            ``context``, torchtitan's layout: parameters are placed as
            without ``context`` and the loss's gradient is the axis size, so
            that average is one process's gradient; reduce them yourself
            otherwise, or they are this rank's tokens' part).
        context_ulysses: ``"hybrid"``'s Ulysses degree (a divisor of the
            ``context`` axis size; default: the largest that divides the
            query and key/value heads a rank holds).
        context_loss_chunk: with ``context``, ``None`` (default: the model
            computes its logits and loss whole) or the positions per chunk in
            which the output head and the loss run, with recompute, when the
            model is called with ``labels`` (:mod:`tplower.context.loss`: no
            rank holds ``[B, s, V]`` logits; the output holds the loss and no
            logits).
        overlap: ``True``: a column-parallel ``nn.Linear`` whose input moves
            ``R -> R`` with a ``P(sum)`` gradient runs as one autograd node
            that starts the input gradient's ``all_reduce`` before it
            computes the weight and bias gradients, and waits for it last
            (Megatron's asynchronous input-gradient all-reduce;
            :mod:`tplower.runtime.overlap`); the same gradients bit for bit.
            Eager only (a compiled graph is the compiler's to schedule), not
            under autocast. Siblings that read one tensor (q, k, v) then
            all-reduce their input gradients each, overlapped, instead of
            their sum once (equal up to the order of a floating-point sum):
            more bytes. For a backend whose collectives run beside compute
            (NCCL's own stream, spare CPU cores). ``False`` (default; on 2
            CPU cores with 2 gloo ranks the communication has no idle core
            to run on: MiniLM's train step took 1.03-1.07x as long with
            ``True``, 60-80 paired rounds): the transition and the linear
            are two nodes, the all_reduce after both products.
        replicate_rest: every parameter the plan does not place becomes a
            ``Replicate`` DTensor on ``mesh[axis]`` too, a local view while
            its module or that module's parent runs
            (:mod:`tplower.runtime.rest_params`), so every parameter is a DTensor and ``clip_grad_norm_``,
            ``foreach``/``fused`` optimizers and DCP take the whole model as
            they take ``parallelize_module``'s fully placed one. ``False``
            leaves those parameters plain tensors. Each rank's gradient of
            such a parameter is taken as whole, as before: a parameter used
            on a sharded activation needs a plan entry (``P(sum)`` gradient).
        strict: a plan key that names no module or parameter of the model
            is an error (default), which names the closest names the model
            has; ``False``: such keys are left out with a warning. Keys the
            model's own transformers plan ships for layers its config lacks
            (a dense ``mlp.gate_proj`` key of a model whose layers are all
            experts) name nothing silently either way.

    Returns:
        ``model`` itself. Every parameter the plan places is an
        ``nn.Parameter`` holding a DTensor with the plan's placements and
        the global shape (on ``mesh[axis]`` when it is placed on ``axis``
        alone, as ``parallelize_module(model, mesh[axis], ...)`` makes it;
        see :mod:`tplower.runtime.params`), so ``state_dict``, DCP,
        ``clip_grad_norm_``, optimizers and FSDP2 treat it as they treat
        ``parallelize_module``'s; its ``.grad`` is a DTensor of the same
        placements, reduced over the axis where the local gradient is
        partial. Matched modules run their boundaries on local tensors:
        inputs the plan declares take local tensors (``None`` passes
        through), outputs are local tensors, and activations move only
        through tplower's collectives.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``mesh`` not a
            ``DeviceMesh``, ``axis`` not a string or ``overlap`` not a bool
            (before any collective).
        TPLowerError: ``experts`` neither ``"tp"`` nor ``"ep"``, or ``cover``
            neither ``"reduce"`` nor ``"refuse"`` (naming the closest; a
            ``TPLowerError`` is a ``ValueError``); ``plan=None`` without
            ``context`` (nothing to do);
            ``"auto"``/``"derive"`` on a mesh without ``axis`` (naming
            ``plan=None`` for context parallelism alone); ``context_mode``
            not one of ``"ulysses"``, ``"allgather"``, ``"hybrid"``, or ``context_grads``
            neither ``"sum"`` nor ``"mean"`` (naming the closest); a plan
            error (naming the module, field and value), a
            plan key that names nothing (with ``strict``), an attention's
            query/key/value projections (or an MLP's up and gate) split in
            part, a colwise projection whose split output reaches a consumer
            that takes whole features (its rowwise partner missing), or a
            rowwise one whose producers are not split
            (:func:`tplower.nn.partners.check_partners`), a
            module already parallelized, a parameter that is already a
            DTensor (e.g. from ``parallelize_module``), attention split over
            a tp that does not divide the config's head counts (a parameter
            dim that does not divide is sharded unevenly, ``torch.chunk``
            pieces), a bias that a partial output
            would add per rank, an ``uneven`` name that is no declared
            input or output, a parameter-key shard that would leave a silent
            partial sum (expert weights split with no ``moe_tp_experts``, a
            reduced module with undeclared inputs), an expert weight whose
            intermediate dim neither its module's layout nor its shapes tell
            (:mod:`tplower.plans.expert_layout`), or, with ``experts="ep"``,
            a model without an ``ep_plan`` or an expert count that does not
            divide over ``axis``. At call time (raised by the model's forward):
            under the debug check, on every rank alike when the ranks'
            boundary moves disagree (undeclared uneven local sizes: the
            message names the module, the input or output and the dim);
            for an ``uneven`` tensor, local sizes that are not
            ``torch.chunk`` pieces; before any collective
            (:mod:`tplower.nn.calls`), a :func:`tplower.shard_sequence` part
            given to a model parallelized without ``context`` (naming
            ``context=``), and ``labels`` given to a model whose plan leaves
            the logits sharded (naming
            :func:`tplower.vocab_parallel_cross_entropy`).

    Warns:
        UserWarning: per module whose boundary runs on DTensor because the
            live mesh runs a moved axis on a backend tplower does not know; at
            call time, without ``context``, packed documents (position ids
            that restart) run with a KV cache, which lets them attend across
            each other (:mod:`tplower.nn.calls`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize: model must be a torch.nn.Module, got {type(model).__name__}")
    check_mesh(mesh, "mesh", "parallelize")
    if not isinstance(axis, str):
        raise TypeError(f"parallelize: axis must be a mesh axis name (str), got {type(axis).__name__}")
    if experts not in ("tp", "ep"):
        raise TPLowerError(f"parallelize: experts={experts!r}{closest(str(experts), ('tp', 'ep'))}; allowed: 'tp' "
                           "(tensor parallelism inside the experts) or 'ep' (expert parallelism)")
    if not isinstance(overlap, bool):
        raise TypeError(f"parallelize: overlap must be True or False, got {overlap!r}")
    if cover not in COVER_MODES:
        raise TPLowerError(f"parallelize: cover={cover!r}{closest(str(cover), COVER_MODES)}; allowed: "
                           f"{', '.join(map(repr, COVER_MODES))}")
    _check_something_to_do(plan, mesh, axis, context)
    if plan is not None and axis not in mesh_lowerer(mesh).names:
        warnings.warn(f"tplower: mesh axes {mesh_lowerer(mesh).names} have no {axis!r}; HF styles shard nothing",
                      stacklevel=2)
    if context is not None:
        _check_context_words(context_mode, context_grads)
        if not replicate_rest and context_grads == "sum":
            raise TPLowerError("parallelize: context= sums every parameter's gradient over the context axis, which "
                               "replicate_rest=False would leave plain (and unsummed) for the parameters the plan "
                               "does not place; drop replicate_rest=False")
    resolved = resolve_plan(model, mesh, plan, axis=axis, experts=experts, context=context, strict=strict)
    if context is not None:  # checks first, then the config and the attention modules: before anything is placed
        scale = 1 if context_grads == "sum" else resolved.shape[resolved.names.index(context)]
        install_context(model, mesh, context, context_mode, tp_size=attention_tp(model, resolved), grad_scale=scale,
                        loss_chunk=context_loss_chunk, ulysses=context_ulysses, caller="parallelize")
        if context_grads == "mean":
            resolved = dataclasses.replace(resolved, context=None)
    for mp in resolved:
        if mp.info is not None and mp.info.reason is not None:
            warnings.warn(f"tplower: module {mp.qual!r} runs its boundary on DTensor: {mp.info.reason}", stacklevel=2)
    placed = place_parameters(model, resolved)
    install_boundaries(model, resolved, mesh, overlap)
    rest = place_rest_parameters(model, resolved, mesh) if replicate_rest else None
    install_hooks(model, resolved, mesh, rest, cover)
    if resolved.context is not None:  # gradients summed over cp once, in one order, at the end of backward
        sum_at_end(model, resolved.context, placed, rest)
    return model
