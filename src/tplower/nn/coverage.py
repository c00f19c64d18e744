"""Cover every parameter: find the ones a plan leaves whole but uses on activations the plan shards.

A parameter the plan does not place is replicated: every rank holds it whole
and takes its local gradient as whole. That is right where it meets whole
activations (a norm on the residual stream) and silently wrong where it meets
this rank's piece of a sharded one: Apertus' ``mlp.act_fn.alpha_p`` scales the
activation between the colwise ``up_proj`` and the rowwise ``down_proj``, so
each rank's gradient covers its features only and the true gradient is the
sum over ranks. A per-head ``q_norm`` between a colwise ``q_proj`` and the
attention is the same case.

This module finds such parameters by watching where activations are sharded,
never by names: :func:`install_coverage` arms a probe that runs during the
model's first forward with gradients enabled (eagerly; a forward under
``torch.compile`` or ``no_grad`` leaves it armed for the next). While it runs,
a ``TorchFunctionMode`` follows every tensor op:

* a module's installed boundary tags its outputs by the plan's ``out_dst``:
  ``S(d)`` on the tp axis is a *sharded* activation, ``P`` a *partial* one,
  ``R`` a whole one (a rowwise layer's reduced output);
* an op's output is sharded (partial) when an input is, so the tag follows
  the activation through norms, activations and reshapes until a boundary
  makes it whole again;
* the local view of a parameter the plan left whole (and anything computed
  from parameters alone, as ``softplus(alpha_p)``) is tracked as that
  parameter; an op that takes it together with a sharded activation is a
  *sharded use*, together with a whole activation that needs a gradient a
  *whole use*.

At the end of that forward (before any backward), each trainable parameter
the plan left whole is decided:

===================================  ===========================================================
its uses                             outcome
===================================  ===========================================================
whole only (or none seen)            nothing: its gradient is whole on every rank
sharded only                         ``cover="reduce"`` (default): its local gradient is ``P(sum)``,
                                     all-reduced in backward (the first step's too), and a warning
                                     names it; ``cover="refuse"``: a :class:`~tplower.TPLowerError`
sharded and whole                    refused: no one reduction is right for both
on a partial sum                     refused: the plan adds or scales before the reduction
===================================  ===========================================================

Each refusal names the parameter, its module and the plan entry that fixes
it (``{'layers.*.mlp.act_fn': 'replicated_with_grad_allreduce'}``, which
places it replicated with a ``P(sum)`` gradient). With ``replicate_rest=False``
the parameters stay plain tensors and a sharded use is refused too.

Limits: a parameter first mixed into a whole activation which later meets a
sharded one is not followed (the activation's own gradient would be partial
as well); modules run under ``torch.compile`` before the first eager forward
are not probed; parameters the plan places itself are the plan's to declare.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..core.support.errors import TPLowerError
from ..core.support.fake import host_values
from ..runtime.boundary import REPLACED, _Boundary
from ..runtime.rest_params import RestParams

__all__ = ["COVER_MODES", "Coverage", "install_coverage"]

#: what :func:`install_coverage` does with a parameter used on sharded activations
COVER_MODES = ("reduce", "refuse")

_TAG = "_tplower_placement"  # "S" (sharded), "P" (partial) or None (made whole by a boundary)
_FROM = "_tplower_from_params"  # frozenset of parameter keys a tensor is computed from, parameters alone

SHARDED, PARTIAL, WHOLE = "S", "P", "R"


class _Follow(TorchFunctionMode):
    """Every torch op of the probed forward, passed to the :class:`Coverage` after it runs."""

    def __init__(self, coverage: Coverage) -> None:
        super().__init__()
        self.coverage = coverage

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.coverage.op(args, kwargs or {}, out)
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


class Coverage:
    """The probe :func:`install_coverage` arms on a model, and what it found.

    Attributes:
        names: ``{key: (module name, parameter name)}`` of the parameters it watches.
        uses: ``{key: {"S", "P", "R"}}``: how each watched parameter was used in the probed forward.
        reduced: ``module.parameter`` names given a ``P(sum)`` gradient.
        done: the probe ran (its hooks are removed).
    """

    def __init__(self, model: nn.Module, mesh: DeviceMesh, axis: str, rest: RestParams | None, cover: str) -> None:
        self.model, self.axis, self.rest, self.cover, self.mesh = model, axis, rest, cover, mesh
        self.axis_index = tuple(mesh.mesh_dim_names or ()).index(axis)
        self.names: dict[int, tuple[str, str]] = {}
        self.trainable: set[int] = set()
        self.views: dict[int, int] = {}  # id(local tensor) -> key, while probing
        self.keep: list[torch.Tensor] = []  # the views seen, alive while probing (their ids stay unique)
        self.uses: dict[int, set[str]] = {}
        self.reduced: list[str] = []
        self.done = False
        self.mode: _Follow | None = None
        self.handles: list[Any] = []
        self.taggers: list[Any] = []  # the boundaries' hooks, only while a forward is probed
        if rest is not None:
            self.names = dict(rest.names)
            self.trainable = {k for k, p in rest.params.items() if p.requires_grad}
        else:  # plain parameters: the module reads the Parameter object itself
            for qual, module in model.named_modules():
                for name, p in module._parameters.items():
                    if p is not None and not isinstance(p, DTensor) and id(p) not in self.names:
                        self.names[id(p)] = (qual, name)
                        if p.requires_grad:
                            self.trainable.add(id(p))

    # ---- probe lifetime -------------------------------------------------------------------------------

    def arm(self) -> None:
        """Register the model's hooks (start and decide); each boundary's tagger is added per probed forward.

        Only the two root hooks stay between calls: under ``torch.compile`` (which never probes) a tagger on
        every boundary would be traced into each call, with guards on its closure.
        """
        self.handles.append(self.model.register_forward_pre_hook(self._start, prepend=True))  # before the swaps
        self.handles.append(self.model.register_forward_hook(self._finish, always_call=True))

    def _add_taggers(self) -> None:
        """Hook every boundary (its outputs are activations, not parameters') for the forward about to run.

        Not the model itself: its forward hooks run after :meth:`_finish` has decided, and :meth:`_finish`,
        which removes these hooks, may run while ``nn.Module`` iterates the model's own hooks (the
        ``always_call`` pass after an exception).
        """
        for module in self.model.modules():
            if module is self.model:
                continue
            boundary = module.__dict__.get("forward")
            boundary = boundary if isinstance(boundary, _Boundary) else module.__dict__.get(REPLACED)
            if isinstance(boundary, _Boundary):
                self.taggers.append(module.register_forward_hook(self._tagger(self._boundary_tags(boundary))))

    def _boundary_tags(self, boundary: _Boundary) -> dict[int, str | None]:
        slots = {mv.name: mv.slot for mv in boundary.outs}
        tags: dict[int, str | None] = {}
        for op in boundary.info.form.outputs:
            slot = 0 if op.name == "out" else int(op.name) if op.name.isdigit() else slots.get(op.name)
            if slot is None or self.axis_index >= len(op.dst):
                continue
            q = op.dst[self.axis_index]
            tags[slot] = SHARDED if isinstance(q, Shard) else PARTIAL if isinstance(q, Partial) else None
        return tags

    def _tagger(self, tags: dict[int, str | None]) -> Callable[[nn.Module, Any, Any], None]:
        def tag(module: nn.Module, args: Any, out: Any) -> None:
            if self.mode is None:
                return
            items = list(out) if isinstance(out, tuple | list) else [out]
            for slot, t in enumerate(items):
                if isinstance(t, torch.Tensor):
                    if slot in tags:
                        setattr(t, _TAG, tags[slot])
                    if hasattr(t, _FROM):  # e.g. a partial_tail boundary's output: no output move, still its own
                        delattr(t, _FROM)
        return tag

    def _start(self, model: nn.Module, args: Any) -> None:
        if self.done or self.mode is not None or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        self.uses.clear()
        if self.rest is not None:
            self.rest.watch = self._see
        else:
            for module in model.modules():
                for p in module._parameters.values():
                    if p is not None and id(p) in self.names:
                        self._see(p, id(p))
        self._add_taggers()
        self.mode = _Follow(self)
        self.mode.__enter__()

    def _see(self, view: torch.Tensor, key: int) -> None:
        self.views[id(view)] = key
        self.keep.append(view)

    def _finish(self, model: nn.Module, args: Any, out: Any) -> None:
        if self.mode is None:
            return
        mode, self.mode = self.mode, None
        mode.__exit__(None, None, None)
        for handle in self.taggers:
            handle.remove()
        self.taggers.clear()
        if self.rest is not None:
            self.rest.watch = None
        self.views.clear()
        self.keep.clear()
        if sys.exc_info()[0] is not None:  # the forward raised: probe the next one
            return
        self.done = True
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.decide()

    # ---- following ops ----------------------------------------------------------------------------------

    def op(self, args: Any, kwargs: Mapping[str, Any], out: Any) -> None:
        """Record one op of the probed forward: parameter uses, and the tags of its outputs."""
        ins = _tensors((args, kwargs))
        if not ins:
            return
        kind: str | None = None
        keys: set[int] = set()
        whole = False
        for t in ins:
            key = self.views.get(id(t))
            if key is not None:
                keys.add(key)
                continue
            derived = getattr(t, _FROM, None)
            if derived:
                keys |= derived
                continue
            tag = getattr(t, _TAG, None)
            if tag == PARTIAL or (tag == SHARDED and kind is None):
                kind = tag
            elif tag is None and t.requires_grad:
                whole = True
        for key in keys:
            if kind is not None or whole:
                self.uses.setdefault(key, set()).add(kind or WHOLE)
        outs = [t for t in _tensors(out) if id(t) not in self.views]
        if kind is not None:
            for t in outs:
                setattr(t, _TAG, kind)
        elif keys and not whole:
            for t in outs:
                if getattr(t, _TAG, None) is None:
                    setattr(t, _FROM, frozenset(keys))

    # ---- deciding --------------------------------------------------------------------------------------

    def _agree(self) -> None:
        """Make :attr:`uses` what every rank saw: the union over the mesh's axes other than ``axis``, whose
        ranks see other data (context or data parallelism: a rank whose tokens never reached a module saw no
        use of its parameters), so every rank decides alike. One ``all_reduce`` (max) a such axis, once."""
        others = [d for d in range(self.mesh.ndim) if d != self.axis_index and self.mesh.size(d) > 1]
        if not others:
            return
        import torch.distributed as dist

        keys = sorted(self.names, key=lambda k: self.names[k])
        kinds = (SHARDED, PARTIAL, WHOLE)
        with host_values():  # real flags under a FakeTensorMode too (tplower.planner)
            flags = torch.zeros((len(keys), len(kinds)), device=self.mesh.device_type)
            for i, key in enumerate(keys):
                for j, kind in enumerate(kinds):
                    flags[i, j] = float(kind in self.uses.get(key, ()))
            for d in others:
                dist.all_reduce(flags, dist.ReduceOp.MAX, group=self.mesh.get_group(d))
            seen = flags.cpu().tolist()
        self.uses = {key: {kind for kind, f in zip(kinds, row, strict=True) if f > 0}
                     for key, row in zip(keys, seen, strict=True) if any(row)}

    def decide(self) -> None:
        """Give each parameter used on sharded activations its gradient reduction, or refuse (see the module).

        Raises:
            TPLowerError: a parameter used on a partial sum, on sharded and whole activations alike, or (with
                ``cover="refuse"`` or plain parameters) on sharded ones; the message lists each with the
                plan entry that fixes it.
        """
        self._agree()
        problems: list[str] = []
        for key, kinds in self.uses.items():
            if key not in self.trainable or kinds == {WHOLE}:
                continue
            qual, name = self.names[key]
            where = f"parameter {name!r} of module {qual!r}"
            fix = f"{{{qual!r}: 'replicated_with_grad_allreduce'}}" if qual else \
                f"{{{name!r}: 'replicated_with_grad_allreduce'}}"
            if PARTIAL in kinds:
                problems.append(f"{where} is used on a partial sum (a rowwise output before its reduction): each "
                                "rank would apply it to its share of the sum; reduce the output first (e.g. "
                                "'rowwise' instead of 'local_rowwise') or place the parameter in that entry")
            elif WHOLE in kinds:
                problems.append(f"{where} is used both on activations the plan shards and on whole ones, so its "
                                "gradient is neither whole nor a plain partial sum; keep the activation whole "
                                "where it meets the parameter (e.g. 'colwise_rep' instead of 'colwise') or give "
                                "the two uses their own parameters")
            elif self.rest is None or self.cover == "refuse":
                problems.append(f"{where} is left whole by the plan but used on activations the plan shards, so "
                                "each rank's gradient covers only its piece; add the plan entry " + fix +
                                " (replicated, gradient all-reduced)")
            else:
                self.rest.reduce_grad(key)
                self.reduced.append(f"{qual}.{name}" if qual else name)
        if problems:
            raise TPLowerError("tplower.parallelize: the plan leaves parameters uncovered (found in the first "
                               "forward, before any backward):\n  " + "\n  ".join(problems))
        if self.reduced:
            warnings.warn(f"tplower: parameters the plan leaves whole are used on activations it shards; their "
                          f"gradients are all-reduced over {self.axis!r}: {', '.join(self.reduced)} (name them "
                          "'replicated_with_grad_allreduce' in the plan to say so)", stacklevel=2)


def install_coverage(model: nn.Module, mesh: DeviceMesh, axis: str, rest: RestParams | None,
                     cover: str = "reduce") -> Coverage:
    """Arm the coverage probe on a parallelized ``model`` (see the module docstring).

    Args:
        model: the model :func:`tplower.parallelize` installed a plan on.
        mesh: its mesh; ``axis`` must be one of its axis names.
        axis: the tensor-parallel axis.
        rest: what :func:`tplower.runtime.rest_params.place_rest` made (``None``: the parameters stay plain).
        cover: ``"reduce"`` (a sharded use gets the ``P(sum)`` gradient) or ``"refuse"``.

    Returns:
        The armed :class:`Coverage` (also ``model._tplower_coverage``).

    Raises:
        ValueError: ``cover`` is not one of :data:`COVER_MODES`.
    """
    if cover not in COVER_MODES:
        raise ValueError(f"parallelize: cover={cover!r}; allowed: {', '.join(map(repr, COVER_MODES))}")
    coverage = Coverage(model, mesh, axis, rest, cover)
    coverage.arm()
    model.__dict__["_tplower_coverage"] = coverage
    return coverage
