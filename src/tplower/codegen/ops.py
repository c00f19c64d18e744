"""The runtime a generated forward calls: named bare operators bound to one mesh (see :mod:`tplower.codegen.emit`).

A file from :func:`tplower.codegen.emit` holds, per module, a ``forward``
written out as straight-line code. Everything in it that depends on the rank
or the live process group goes through one :class:`GeneratedOps` object,
``ops``, which :func:`tplower.codegen.install` binds:

* ``ops.all_gather(x, "S(1)", "R", grad="P(sum)", where=...)`` and its
  siblings (``all_reduce``, ``reduce_scatter``, ``all_to_all``, ``chunk``,
  ``identity`` for a transition that moves only in backward, ``transition``
  for one of several collectives) run the transition as the hook installed by
  :func:`tplower.parallelize` runs it: the same cached program of
  :class:`~tplower.MeshLowerer` (so outputs and gradients are bit-identical),
  the debug check under ``TPLOWER_DEBUG=1``, sizes exchanged for an
  ``uneven`` tensor. The name is checked against the transition the first
  time a call site runs, so an edited file cannot call a collective under
  another's name. ``ops.dtensor`` runs a generic boundary on DTensor.
* ``ops.param(self, "weight")`` is a parameter's local tensor
  (:func:`tplower.runtime.params.local_parameter`: a view forward, the gradient's
  reduction and DTensor ``.grad`` in backward).
* ``ops.local_params`` / ``ops.restore_params`` swap a module's parameters
  for their local tensors around a call of the module's own ``forward``.
* an expert-parallel experts module is written out as its steps:
  ``ops.expert_route`` (:func:`tplower.core.ops.dispatch.plan_dispatch` on the
  axis's group), ``ops.dispatch_tokens``, the module's own ``forward`` on the
  rows received, ``ops.combine_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from ..core.language.placements import parse_placements
from ..core.language.transitions import classify_axis
from ..core.lower.redistribute import MeshLowerer, mesh_lowerer
from ..core.ops.dispatch import DispatchPlan, combine_tokens, dispatch_tokens, plan_dispatch
from ..core.support.errors import TPLowerError
from ..core.support.words import count
from ..runtime.boundary import _Boundary, _dtensor, _lowered, _Move, shared_move, tie_outputs
from ..runtime.experts import ExpertDispatch
from ..runtime.params import ParamLayout, local_parameter
from ..runtime.uneven import agreed_global_shape, exchanged_global_shape

__all__ = ["OPERATORS", "GeneratedOps", "operator_name"]

#: the named operators a generated file may call for a transition
OPERATORS: tuple[str, ...] = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "chunk", "identity",
                              "transition")


def operator_name(src: Sequence[Any], dst: Sequence[Any]) -> str:
    """The operator that names ``src -> dst`` (one placement per axis): its one forward collective.

    ``identity`` when nothing moves forward (a transition that moves only its
    gradient, e.g. ``R -> R`` with gradient ``P(sum)``: Megatron's
    ``copy_to_tp_region``), ``transition`` when several axes move; otherwise
    the kind of :func:`tplower.classify_axis` (``all_gather``,
    ``all_reduce``, ``reduce_scatter``, ``all_to_all``, ``chunk``, ...).
    """
    moved = [classify_axis(a, b)[0] for a, b in zip(src, dst, strict=True) if a != b]
    if not moved:
        return "identity"
    return moved[0] if len(moved) == 1 and moved[0] in OPERATORS else "transition"


@dataclass
class _Bound:
    """What one module's generated forward needs from its install: layouts, lookup rows, the hook."""

    layouts: dict[str, ParamLayout]
    boundary: _Boundary


class GeneratedOps:
    """The bare operators of generated forwards, bound to ``mesh`` by :func:`tplower.codegen.install`.

    Args:
        mesh: the live device mesh the model was parallelized on.

    A generated file creates ``ops = tplower.codegen.GeneratedOps.unbound()``;
    calling an operator before :func:`~tplower.codegen.install` binds it raises
    :class:`~tplower.TPLowerError`.
    """

    def __init__(self, mesh: DeviceMesh | None) -> None:
        self._lowerer: MeshLowerer | None = None if mesh is None else mesh_lowerer(mesh)
        self._moves: dict[tuple[Any, ...], tuple[_Move, Callable[..., torch.Tensor]]] = {}
        self._bound: dict[int, _Bound] = {}

    @classmethod
    def unbound(cls) -> GeneratedOps:
        """A placeholder whose operators raise until :func:`tplower.codegen.install` binds a mesh."""
        return cls(None)

    @property
    def lowerer(self) -> MeshLowerer:
        """The bound mesh's lowerer.

        Raises:
            TPLowerError: not bound (the file was imported, not installed).
        """
        if self._lowerer is None:
            raise TPLowerError("a generated forward ran before tplower.codegen.install(model, mesh, file) bound "
                               "its operators to a mesh")
        return self._lowerer

    def bind(self, module: nn.Module, boundary: _Boundary) -> None:
        """Record what ``module``'s generated forward needs from the boundary :func:`tplower.parallelize` made."""
        self._bound[id(module)] = _Bound(dict(boundary.params), boundary)

    def _entry(self, module: nn.Module) -> _Bound:
        bound = self._bound.get(id(module))
        if bound is None:
            raise TPLowerError(f"{type(module).__name__}: its generated forward was not bound by "
                               "tplower.codegen.install")
        return bound

    # ---- transitions ---------------------------------------------------------------------------

    def _move(self, name: str, t: Any, src: str, dst: str, grad: str, where: str, uneven: bool,
              dtensor: bool, fan: str | None = None, sized: bool = False) -> Any:
        if t is None:
            return None
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where} is a {type(t).__name__}, not a tensor")
        key = (name, src, dst, grad, where, uneven, sized, t.ndim)
        found = self._moves.get(key)
        if found is None:
            low = self.lowerer
            ps = tuple(parse_placements(p, low.names, arg=f"{where}: {arg}", tensor_ndim=t.ndim)
                       for p, arg in ((src, "src"), (dst, "dst"), (grad, "grad")))
            if not dtensor and operator_name(ps[0], ps[1]) != name:
                raise TPLowerError(f"{where}: {src} -> {dst} is {operator_name(ps[0], ps[1])}, not ops.{name}; "
                                   "the generated file was edited or is for another plan: emit it again")
            axes = tuple(i for i, p in enumerate(ps[0]) if isinstance(p, Shard) and p != ps[1][i]) if sized else ()
            mover = _dtensor if dtensor else _lowered
            found = (_Move(-1, None, where, ps[0], ps[1], ps[2], where, uneven, axes), mover)
            self._moves[key] = found
        mv, run = found

        def go(v: torch.Tensor) -> torch.Tensor:
            gshape: tuple[int, ...] | None
            if mv.uneven:
                gshape = exchanged_global_shape(v, mv.src, self.lowerer, mv.where)
            else:
                gshape = agreed_global_shape(v, mv.src, mv.sized, self.lowerer, mv.where) if mv.sized else None
            return run(v, self.lowerer, mv, gshape)

        return shared_move(t, mv, fan, self.lowerer, go)

    def all_gather(self, t: Any, src: str, dst: str, *, grad: str, where: str, uneven: bool = False,
                   fan: str | None = None, sized: bool = False) -> Any:
        """``S(d) -> R`` on one axis: ``all_gather``; ``None`` passes through. Shapes: ``[.., s, ..] -> [.., n*s, ..]``.

        ``fan`` (every operator takes it): the key of a group of sibling modules that move one tensor the same
        way (:mod:`tplower.runtime.fanout`); within one call of their parent the move is made once and shared.
        ``uneven``: the ranks exchange the sharded dims' sizes each call (a declared ``uneven`` name);
        ``sized``: a sharded source dim no parameter sizes, exchanged eagerly and checked equal under
        ``torch.compile`` (:func:`tplower.runtime.uneven.agreed_global_shape`).

        Raises:
            TypeError: ``t`` is neither a tensor nor ``None``.
            TPLowerError: ``src -> dst`` is not an ``all_gather``, or as :func:`tplower.redistribute_local`.
        """
        return self._move("all_gather", t, src, dst, grad, where, uneven, False, fan, sized)

    def all_reduce(self, t: Any, src: str, dst: str, *, grad: str, where: str, uneven: bool = False,
                   fan: str | None = None, sized: bool = False) -> Any:
        """``P(op) -> R`` on one axis: ``all_reduce``, shape unchanged (raises as :meth:`all_gather`)."""
        return self._move("all_reduce", t, src, dst, grad, where, uneven, False, fan, sized)

    def reduce_scatter(self, t: Any, src: str, dst: str, *, grad: str, where: str, uneven: bool = False,
                       fan: str | None = None, sized: bool = False) -> Any:
        """``P(op) -> S(d)`` on one axis: ``reduce_scatter``, ``[.., L, ..] -> [.., L/n, ..]`` (raises as above)."""
        return self._move("reduce_scatter", t, src, dst, grad, where, uneven, False, fan, sized)

    def all_to_all(self, t: Any, src: str, dst: str, *, grad: str, where: str, uneven: bool = False,
                   fan: str | None = None, sized: bool = False) -> Any:
        """``S(i) -> S(j)`` on one axis: ``all_to_all`` (raises as :meth:`all_gather`)."""
        return self._move("all_to_all", t, src, dst, grad, where, uneven, False, fan, sized)

    def chunk(self, t: Any, src: str, dst: str, *, grad: str, where: str, uneven: bool = False,
              fan: str | None = None, sized: bool = False) -> Any:
        """``R -> S(d)`` on one axis: this rank's ``torch.chunk`` piece, no communication forward."""
        return self._move("chunk", t, src, dst, grad, where, uneven, False, fan, sized)

    def identity(self, t: Any, src: str, dst: str, *, grad: str, where: str, uneven: bool = False,
                 fan: str | None = None, sized: bool = False) -> Any:
        """Nothing moves forward; backward moves the gradient ``grad -> src`` (e.g. ``all_reduce``)."""
        return self._move("identity", t, src, dst, grad, where, uneven, False, fan, sized)

    def transition(self, t: Any, src: str, dst: str, *, grad: str, where: str, uneven: bool = False,
                   fan: str | None = None, sized: bool = False) -> Any:
        """Several collectives (several axes move): the program :mod:`tplower.core.language.transitions` plans."""
        return self._move("transition", t, src, dst, grad, where, uneven, False, fan, sized)

    def dtensor(self, t: Any, src: str, dst: str, *, grad: str, where: str, uneven: bool = False,
                fan: str | None = None, sized: bool = False) -> Any:
        """A generic boundary: DTensor's ``redistribute`` runs it, forward and backward."""
        return self._move("dtensor", t, src, dst, grad, where, uneven, True, fan, sized)

    # ---- parameters and module calls ------------------------------------------------------------

    def param(self, module: nn.Module, name: str) -> Any:
        """``module``'s parameter ``name`` as its local tensor (``None`` stays ``None``), differentiable."""
        p = module._parameters[name]
        if p is None:
            return None
        layout = self._entry(module).layouts.get(name)
        return p if layout is None else local_parameter(p, layout)

    def local_params(self, module: nn.Module, names: Sequence[str], drop: Sequence[str] = ()) -> dict[str, Any]:
        """Swap ``names`` for their local tensors and set ``drop`` to ``None``; returns what to restore."""
        params = module._parameters
        saved = {n: params[n] for n in (*names, *drop)}
        for n in names:
            params[n] = self.param(module, n)
        for n in drop:
            params[n] = None
        return saved

    def tie(self, module: nn.Module, out: Any, moved: Sequence[Any]) -> Any:
        """``out`` joined in autograd to ``moved`` and the module's local parameters, as the installed boundary does.

        Every backward collective a forward issued then runs on every rank, even
        where the module's own compute leaves an input or a parameter out of
        ``out`` for data alone (:func:`tplower.runtime.boundary.tie_outputs`).
        Call it while the local parameters are swapped in (:meth:`local_params`).
        """
        b = self._entry(module).boundary
        return tie_outputs(out, list(moved), [module._parameters[n] for n, _ in b.params])

    def dropout_region(self, module: nn.Module) -> None:
        """Switch the model's dropout streams as the installed boundary does after its outputs (eager, training).

        Its outputs open a sharded region (this rank's own stream) or close one
        (the common stream); :mod:`tplower.runtime.dropout`.
        """
        b = self._entry(module).boundary
        if b.region is None or b.streams is None or torch.compiler.is_compiling() or not module.training:
            return
        if b.region:
            b.streams.open()
        else:
            b.streams.close()

    @staticmethod
    def restore_params(module: nn.Module, saved: dict[str, Any]) -> None:
        """Put back what :meth:`local_params` swapped."""
        module._parameters.update(saved)

    def lookup_rows(self, module: nn.Module) -> tuple[int, int, int | None]:
        """A vocabulary-parallel lookup's ``(first row, rows, local padding_idx)`` on this rank."""
        lk = self._entry(module).boundary.lookup
        if lk is None:
            raise TPLowerError(f"{type(module).__name__}: no masked_lookup was installed")
        return lk.offset, lk.rows, lk.padding_idx

    def compute(self, module: nn.Module) -> Callable[..., Any]:
        """The module's plan-injected ``local_compute`` function, bound to the module."""
        return self._entry(module).boundary.compute

    def expert_route(self, module: nn.Module, top_k_index: torch.Tensor) -> DispatchPlan:
        """Plan this step's token exchange of an expert-parallel experts module (one ``all_gather`` of counts).

        Args:
            top_k_index: ``[T, k]`` int64, this rank's tokens' experts (global indices).

        Raises:
            TPLowerError: the module is not expert-parallel, or bad indices (as ``plan_dispatch``).
        """
        compute = self._entry(module).boundary.compute
        if not isinstance(compute, ExpertDispatch):
            raise TPLowerError(f"{type(module).__name__}: not an expert-parallel experts module")
        return plan_dispatch(top_k_index, compute.num_experts, compute.lowerer.groups[compute.axis])

    #: :func:`tplower.core.ops.dispatch.dispatch_tokens`: ``[T, H]`` -> the ``[R, H]`` rows this rank's experts take
    dispatch_tokens = staticmethod(dispatch_tokens)
    #: :func:`tplower.core.ops.dispatch.combine_tokens`: the experts' ``[R, H]`` rows -> ``[T, H]``, weighted by slot
    combine_tokens = staticmethod(combine_tokens)

    def hooked(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """Run ``module``'s boundary as :func:`tplower.parallelize` installed it (for what is not written out)."""
        return self._entry(module).boundary(*args, **kwargs)

    @staticmethod
    def outputs(out: Any, need: int, where: str) -> list[Any]:
        """The values ``forward`` returned, as a list (one tensor: ``[out]``).

        Raises:
            TPLowerError: fewer than ``need`` values.
        """
        items = list(out) if isinstance(out, tuple | list) else [out]
        if len(items) < need:
            raise TPLowerError(f"{where}: output index {need - 1} is declared but forward returned "
                               f"{count(len(items), 'value')}")
        return items

    @staticmethod
    def pack(out: Any, items: list[Any]) -> Any:
        """``items`` in the container ``out`` came in (a tensor, tuple, list or named tuple)."""
        if not isinstance(out, tuple | list):
            return items[0]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
