"""Gradient sums over the context axis, in one fixed order at the end of backward.

Under context parallelism every rank of the ``cp`` axis holds every
parameter whole (``Replicate``) and computes on its own tokens, so each local
gradient is ``P(sum)`` there and must be summed over the axis. Summing it
where the module's backward runs pairs each rank's reductions with the others'
in the order the ranks happen to call modules; a model whose own code calls a
module for this rank's data alone (a mixture-of-experts loop that skips an
expert no token of this rank reached) makes the ranks' reductions differ, and
the same-sized ones pair up across modules: wrong gradients without an error,
or a wait until the process group's timeout.

So the gradients of the parameters :func:`tplower.parallelize` places with a
context axis are not summed in their module's backward. Each local gradient
waits here (added to what the same parameter got earlier in this backward),
and when the backward ends (an autograd engine callback) every rank sums
*every* such parameter of the model, in the model's own parameter order: a
parameter this rank did not use stands in as zeros, and one flag per parameter
(1 where this rank used it) is summed with the gradients, as DDP's
``find_unused_parameters`` and FSDP2's ``reduce_scatter_unused_params`` do. The
ranks issue identical collectives whatever modules they called. A parameter
some rank used gets the sum; one no rank used gets no gradient (``None``, as in
one process); the result is added to ``.grad`` as autograd accumulates (so
gradient accumulation over several backward calls sums them).

The gradients go in chunks of at most :data:`BUCKET_BYTES` (25 MiB, DDP's
default bucket) of the gradients laid end to end, flags last, one ``all_reduce``
a chunk per group of parameters that sum over the same axes with the same dtype
and device (:func:`sum_chunks`).

Where the gradient is not for ``.grad`` (``torch.autograd.grad``), where the
parameter is not the one :func:`tplower.parallelize` placed (FSDP2's unsharded
parameters, a deep copy of the model) and under ``torch.compile``, the
gradient is summed in its module's backward as before (:mod:`tplower.runtime.params`).
"""

from __future__ import annotations

import copy
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.utils.weak import WeakIdKeyDictionary

from ..core.lower.redistribute import mesh_lowerer
from ..core.support.fake import like_tensors, used_flags

#: a :class:`tplower.runtime.params.ParamLayout` (not imported: that module imports this one)
ParamLayout = Any

__all__ = ["BUCKET_BYTES", "GradientSums", "context_sum", "defer_gradients", "folded_axis", "owners", "sum_chunks",
           "sum_context_in_fsdp", "will_accumulate"]

#: the most bytes one ``all_reduce`` of the pass carries (DDP's default ``bucket_cap_mb=25``)
BUCKET_BYTES = 25 * 2 ** 20

#: each placed parameter -> (the model's :class:`GradientSums`, its index there)
_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()
_numbers = itertools.count()
#: by autograd graph task (ids unique in the process; a CUDA backward runs nodes on the device's own thread): the
#: sums waiting for that backward to end
_TASKS: dict[int, dict[int, GradientSums]] = {}
_LOCK = threading.Lock()


def sum_chunks(elements: int, item: int) -> list[int]:
    """The elements each ``all_reduce`` of the pass carries, for ``elements`` of ``item`` bytes in one group.

    Args:
        elements: the parameter elements of one group plus one flag per parameter tensor.
        item: bytes per element (4 for float32).

    Returns:
        ``ceil(elements * item / BUCKET_BYTES)`` chunk sizes, each ``BUCKET_BYTES // item`` elements but the
        last (the rest); ``[]`` for no elements.
    """
    step = max(1, BUCKET_BYTES // item)
    return [min(step, elements - lo) for lo in range(0, max(elements, 0), step)]


def context_sum(layout: ParamLayout, axis: str) -> tuple[Any, ...]:
    """The placements the pass sums a gradient of ``layout`` from: ``P(sum)`` on ``axis``, ``R`` on every other
    axis of its mesh (a sum over another axis, tensor parallelism's, runs where the module's backward runs)."""
    names = tuple(layout.mesh.mesh_dim_names or ())
    return tuple(Partial() if n == axis else Replicate() for n in names)


class GradientSums:
    """One model's context-parallel gradient sums, deferred to the end of backward (module docstring).

    Made by :func:`tplower.parallelize` with ``context=``; holds the placed
    parameters (weakly) in the model's parameter order, each with a function
    giving its current layout (a replicated parameter's layout can change once
    after the first call, :class:`~tplower.runtime.rest_params.RestParams`).
    A deep copy of the model gets a pass of its own over the copy's parameters.

    Attributes:
        axis: the context axis.
        open: the graph task of the backward that started at the model's output and has not ended (``None``:
            none): a reentrant backward inside it (reentrant activation checkpointing) leaves its gradients to
            it, so every rank runs one pass a backward however many reentrant ones its modules ran.
    """

    def __init__(self, axis: str) -> None:
        self.axis = axis
        self.number = next(_numbers)  # the order in which the sums of several models run, the same on every rank
        self.entries: list[tuple[Callable[[], nn.Parameter | None], Callable[[], ParamLayout]]] = []
        self.pending: dict[int, dict[int, torch.Tensor]] = {}  # by graph task, by entry
        self.open: int | None = None
        self.empty: set[int] = set()  # graph tasks whose forwards all ran this rank on a placeholder token alone
        self.full: set[int] = set()  # graph tasks with a forward that held a token here

    def __deepcopy__(self, memo: dict[int, Any]) -> GradientSums:
        new = GradientSums(self.axis)
        memo[id(self)] = new
        for ref, layout in self.entries:
            p = ref()
            if p is not None:
                new.add(copy.deepcopy(p, memo), layout)  # the copy's own parameter (memo: the model's copy)
        return new

    def add(self, param: nn.Parameter, layout: Callable[[], ParamLayout]) -> None:
        """Take ``param`` (a DTensor whose layout sums its gradient over the context axis) into the pass."""
        if param in _OWNER:
            return
        _OWNER[param] = (self, len(self.entries))
        self.entries.append((weakref.ref(param), layout))

    def live(self) -> Any:
        """A parameter of the pass still alive that trains (``None``: none; frozen ones have no autograd node)."""
        return next((p for ref, _ in self.entries if (p := ref()) is not None and p.requires_grad), None)

    def start(self, empty: bool) -> None:
        """A backward reaches the model's output (the first node of its part of the graph): the pass runs at this
        graph task's end, whatever the rest of the backward reaches; ``empty``: this rank's forward held a
        placeholder token alone, so it used no parameter (its flags are 0, as for a module it did not call).
        Waiting gradients of an earlier backward that raised are dropped."""
        task = int(torch._C._current_graph_task_id())
        for stale in [t for t in self.pending if t != task]:
            del self.pending[stale]
        self.open = task
        (self.empty if empty else self.full).add(task)
        queue(self, task)

    def forget(self) -> None:
        """Drop every waiting gradient (those a backward that raised left behind); no collective."""
        self.pending.clear()
        self.open = None
        self.empty.clear()
        self.full.clear()

    def wait(self, index: int, grad: torch.Tensor | None) -> None:
        """Keep local gradient ``grad`` of entry ``index`` for the pass (added to what it has this backward);
        ``None``: nothing to keep, but the pass runs at the end of this backward all the same."""
        task = int(torch._C._current_graph_task_id())
        if self.open is not None:  # the backward through the model's output, or a reentrant one inside it
            task = self.open
        else:
            queue(self, task)
        if grad is not None:
            mine = self.pending.setdefault(task, {})
            have = mine.get(index)
            mine[index] = grad if have is None else have + grad

    def flush(self, task: int) -> None:
        """Sum every entry's gradient waiting in graph task ``task`` over the context axis, zeros and flags for the
        rest; accumulate into ``.grad``.

        Runs on every rank at the end of a backward that reached the model's output or any of its deferred
        parameters (a reentrant backward inside one that reached the output leaves its gradients to it). The
        gradients of a backward that raised never reach ``.grad``; the next backward through the model's output
        drops them, or :meth:`forget`.
        """
        pending = self.pending.pop(task, {})
        empty = task in self.empty and task not in self.full  # (two forwards' outputs may meet in one backward)
        self.empty.discard(task)
        self.full.discard(task)
        if self.open == task:
            self.open = None
        for stale in [t for t in self.pending if t > task]:
            del self.pending[stale]
        groups: dict[tuple[Any, ...], list[tuple[int, Any, ParamLayout]]] = {}  # (index, DTensor parameter, layout)
        for index, (ref, layout_of) in enumerate(self.entries):
            p: Any = ref()  # a DTensor parameter
            if p is None or not p.requires_grad:
                continue
            layout = layout_of()
            key = (layout.mesh, context_sum(layout, self.axis), p._local_tensor.dtype, p._local_tensor.device)
            groups.setdefault(key, []).append((index, p, layout))
        for (mesh, src, dtype, device), members in groups.items():
            _sum_group(mesh, src, dtype, device, members, pending, empty)


def _sum_group(mesh: Any, src: tuple[Any, ...], dtype: torch.dtype, device: torch.device,
               members: Sequence[tuple[int, Any, ParamLayout]], pending: dict[int, torch.Tensor],
               empty: bool = False) -> None:
    """The pass for one group: the virtual concatenation ``[grad_0, grad_1, ..., flags]`` summed in chunks.

    A waiting gradient is let go once its last chunk is summed, and a sum lands in the parameter's ``.grad`` where
    it has one (added in place) or in a tensor of its own: the pass holds about one chunk beyond the gradients.
    """
    own = [not empty and pending.get(i) is not None for i, _, _ in members]
    flags = torch.tensor([float(u) for u in own], dtype=dtype, device=device)
    pieces: list[torch.Tensor | None] = [None if (g := pending.pop(i, None)) is None else g.reshape(-1)
                                         for i, _, _ in members]
    pieces.append(flags)
    sizes = [p._local_tensor.numel() for _, p, _ in members] + [flags.numel()]
    into: list[torch.Tensor | None] = [_accumulating(p) for _, p, _ in members] + [None]
    out: list[torch.Tensor | None] = [None] * len(sizes)  # the sums of those without a .grad to add to
    rep = tuple(Replicate() for _ in src)
    starts = list(itertools.accumulate([0, *sizes]))
    chunks = sum_chunks(starts[-1], flags.element_size())
    for lo, n in zip(itertools.accumulate([0, *chunks[:-1]]), chunks, strict=True):
        hi = lo + n
        parts, where = [], []
        for j, size in enumerate(sizes):
            a, b = max(lo, starts[j]), min(hi, starts[j] + size)
            if a >= b:
                continue
            piece = pieces[j]
            parts.append(torch.zeros(b - a, dtype=dtype, device=device) if piece is None
                         else piece[a - starts[j]:b - starts[j]])
            where.append((j, a - starts[j], b - starts[j]))
            if b == starts[j] + size:
                pieces[j] = None  # its last chunk: the waiting gradient goes
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        del parts
        flat = mesh_lowerer(mesh).program(src, rep, flat.shape, flat.device.type).run_owned(flat)
        at = 0
        for j, a, b in where:
            target = into[j]
            if target is not None:
                target[a:b].add_(flat[at:at + b - a])
            else:
                if out[j] is None:
                    out[j] = torch.empty(sizes[j], dtype=dtype, device=device)
                out[j][a:b].copy_(flat[at:at + b - a])  # type: ignore[index]
            at += b - a
    assert out[-1] is not None
    used = used_flags(out[-1], own)  # one host sync for the group
    for k, (_, p, _) in enumerate(members):
        g = out[k]
        if g is None or not used[k]:  # added to .grad in place, or no rank used it: no gradient, as one process
            continue
        have = p.grad
        g = g.view(p._local_tensor.shape)
        p.grad = DTensor(g, p._spec, requires_grad=False) if have is None else have + DTensor(g, p._spec,
                                                                                                requires_grad=False)


def _accumulating(p: Any) -> torch.Tensor | None:
    """The flat local tensor of ``p.grad`` where the sum can be added to it in place (a DTensor of ``p``'s local
    shape, contiguous), else ``None``."""
    have = p.grad
    if isinstance(have, DTensor) and have._local_tensor.shape == p._local_tensor.shape \
            and have._local_tensor.is_contiguous():
        return have._local_tensor.view(-1)
    return None


def queue(sums: GradientSums, task: int) -> None:
    """Run ``sums.flush(task)`` when graph task ``task`` ends (each model's once, in creation order)."""
    with _LOCK:
        new = task not in _TASKS
        waiting = _TASKS.setdefault(task, {})
        waiting[sums.number] = sums
    if new:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _flush_all(task))


def _flush_all(task: int) -> None:
    with _LOCK:
        waiting = _TASKS.pop(task, {})
    for number in sorted(waiting):
        waiting[number].flush(task)


def will_accumulate(param: Any) -> bool:
    """Whether the running backward accumulates into ``.grad`` at all (``False`` under ``torch.autograd.grad``,
    which returns the gradients): read from ``param``'s ``AccumulateGrad`` node."""
    try:
        torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(param).node)
    except RuntimeError:
        return False
    return True


def _for_grad(node: Any) -> bool:
    """Whether autograd will accumulate into ``.grad`` through ``node`` (an ``AccumulateGrad``) in this backward."""
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # torch.autograd.grad(): the gradient is returned, not accumulated
        return False


def owners(params: Sequence[Any]) -> tuple[tuple[GradientSums, int] | None, ...] | None:
    """For each of ``params``, the pass and index that sum its gradient (``None``: summed where it is used);
    ``None`` when no parameter has one (read in forward, kept on the views' autograd context)."""
    found = tuple(_OWNER.get(p) for p in params)
    return found if any(f is not None for f in found) else None


def defer_gradients(ctx: Any, owned: Sequence[tuple[GradientSums, int] | None]) -> list[bool]:
    """Which of a views node's parameters the pass takes, by position (their gradients go to
    :meth:`GradientSums.wait`, ``None`` to autograd).

    Called from the backward of :mod:`tplower.runtime.params`' views, with :func:`owners` of the parameters
    given in forward (``ctx.next_functions`` lines up with them). A parameter is taken when
    :func:`tplower.parallelize` placed it with a context axis and this backward accumulates into its ``.grad``.
    """
    nodes = ctx.next_functions
    return [owner is not None and _for_grad(nodes[k][0]) for k, owner in enumerate(owned)]


#: the attribute an FSDP2 unsharded parameter carries: the context axis whose gradient sum FSDP2's all-reduce hook
#: runs (an attribute, not a table: a ``torch.compile`` trace reads it as it reads the parameter)
_FOLDED = "_tplower_summed_by_fsdp"


def folded_axis(param: Any) -> str | None:
    """The context axis whose sum FSDP2 runs for ``param`` (:func:`sum_context_in_fsdp`), else ``None``."""
    return getattr(param, _FOLDED, None)


def sum_context_in_fsdp(model: nn.Module, mesh: Any, axis: str = "cp") -> int:
    """Let FSDP2 sum the gradients over the context axis too, in its own fixed order, with zeros for unused ones.

    For a model :func:`tplower.parallelize`\\ d with ``context=axis`` and then sharded with ``fully_shard`` over a
    data-parallel axis beside ``axis``: FSDP2 reduce-scatters each of its groups' gradients once, in its own order,
    at the group's end of backward, so this folds the sum over ``axis`` into it (FSDP2's ``set_all_reduce_hook``:
    an ``all_reduce`` over ``axis`` of the reduce-scatter's output) and has FSDP2 include an unused parameter as
    zeros (``set_reduce_scatter_unused_params``); tplower then leaves the sum over ``axis`` out of each module's
    backward. Ranks that call different modules inside an FSDP2 group (a mixture-of-experts loop that skips an
    expert) still issue the same collectives, and get one process's gradients; a parameter no rank used gets
    zeros (FSDP2's rule with unused parameters), not ``None``. One ``all_gather`` per group runs here, once (each
    group is gathered and sharded again, to find the parameter objects FSDP2 hands the forward).

    Args:
        model: the model, after ``fully_shard`` of its groups and itself.
        mesh: the mesh ``parallelize`` was given (with ``axis``).
        axis: the context-parallel axis.

    Returns:
        The number of FSDP2 groups changed.

    Raises:
        TPLowerError: ``axis`` not on ``mesh``, or no module of ``model`` is sharded by FSDP2.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from ..core.support.errors import TPLowerError

    names = tuple(mesh.mesh_dim_names or ())
    if axis not in names:
        raise TPLowerError(f"sum_context_in_fsdp: axis={axis!r} is not an axis of the mesh; it has {names}")
    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not groups:
        raise TPLowerError("sum_context_in_fsdp: no module of the model is sharded by FSDP2; call it after "
                           "fully_shard(layer) for each layer and fully_shard(model)")
    group = mesh[axis].get_group()

    def over_axis(reduced: torch.Tensor) -> None:
        dist.all_reduce(reduced, group=group)

    for m in groups:
        m.set_reduce_scatter_unused_params(True, recurse=False)
        m.set_all_reduce_hook(over_axis)
        with like_tensors(list(m.parameters())):  # FSDP2's gather buffers, fake where the parameters are
            m.unshard()  # its parameters, as the forward gets them: FSDP2 keeps these objects from step to step
            for p in m.parameters():
                if isinstance(p, DTensor):
                    setattr(p, _FOLDED, axis)
            m.reshard()
    # the end-of-backward pass no longer takes the parameters FSDP2 replaced (it sums their gradients now): left in,
    # the pass summed zeros for each of them, whole, every step (a buffer of the whole model's unsharded gradients
    # and an all_reduce of it over the axis); entries keep their places (owners index them)
    current = {id(p) for p in model.parameters()}
    for hook in list(model._forward_hooks.values()):
        sums = getattr(hook, "sums", None)
        if isinstance(sums, GradientSums):
            sums.entries = [(ref, lay) if id(ref()) in current else (_gone, lay) for ref, lay in sums.entries]
    return len(groups)


def _gone() -> None:
    """A dropped entry's reference: no parameter."""
    return None
