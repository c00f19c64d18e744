"""What runs when a parallelized module is called: the boundary :func:`tplower.parallelize` installs as ``forward``.

A :class:`_Boundary` takes the module's parameters as local tensors, moves
the declared inputs (:class:`_Move`: a lowered program, or DTensor for a
generic boundary), runs the module's own compute (or the plan's
``local_compute``), masks a vocabulary-parallel lookup (:class:`_Lookup`),
moves the declared outputs and adds a deferred bias. :func:`installed_boundary`
reads back what was installed (:class:`InstalledBoundary`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import MethodType
from typing import Any

import torch
from torch import nn

from ..core.lower.redistribute import MeshLowerer
from ..core.support.errors import TPLowerError
from ..core.support.words import count
from ..families.conv1d import is_conv1d
from ..plans.entries import BoundaryEntry
from ..plans.forms import BoundaryForm, Placements
from .dropout import DropoutStreams
from .interned import intern, slot_key, traced
from .movers import _dtensor, _lowered, _Move, _Mover
from .overlap import can_overlap, overlapped_call
from .params import ParamLayout, local_parameter, local_parameters
from .tie import tie_outputs
from .uneven import agreed_global_shape, exchanged_global_shape, known_global_shape

__all__ = ["FANOUT", "REPLACED", "InstalledBoundary", "installed_boundary", "shared_move", "tie_outputs"]

#: The attribute a fan-out parent's call puts on its alias of each tensor argument
#: (:func:`tplower.runtime.fanout.open_fanout`): the input moves already made from that
#: tensor in this call, as ``((key, version, moved, moved_version), ...)``.
FANOUT = "_tplower_fanout"


def shared_move(value: Any, mv: _Move, fan: str | None, lowerer: MeshLowerer, run: Callable[[Any], Any]) -> Any:
    """``run(value)``, or the tensor a sibling's same move already made from ``value`` in this call.

    ``fan`` is the sibling group's key (:mod:`tplower.runtime.fanout`); only a
    fan-out parent's alias of its argument carries the record
    (:data:`FANOUT`), so sharing never outlives one call of the parent.
    Sharing is exact: every backward program is linear, so moving the
    summed gradient once equals summing the moved gradients. Eager checks
    that neither tensor changed in place since (by their version counters,
    which autograd's own checks use: a write through ``.data`` is not
    seen). Where there is no version counter (a ``torch.compile`` trace,
    ``torch.inference_mode``) only moves whose forward is the identity are
    shared (the moved tensor is a view of ``value``, so it cannot go
    stale). The debug path (``TPLOWER_DEBUG``) never shares: each boundary
    checks its own move.
    """
    made = getattr(value, FANOUT, None) if fan is not None else None
    if made is None or lowerer.debug:
        return run(value)
    # no version counter to read: a trace, and inference tensors (torch.inference_mode)
    untracked = torch.compiler.is_compiling() or torch.is_inference_mode_enabled() or value.is_inference()
    if untracked and mv.src != mv.dst:
        return run(value)
    key = (fan, torch.is_grad_enabled())
    version = 0 if untracked else value._version
    for k, ver, moved, moved_ver in made:
        if k == key and ver == version and (untracked or moved._version == moved_ver):
            return moved
    moved = run(value)
    setattr(value, FANOUT, (*made, (key, version, moved, 0 if untracked else moved._version)))
    return moved


@dataclass(frozen=True)
class _Lookup:
    """A vocabulary-parallel lookup: the ids input, this rank's first row, its row count, its padding row."""

    slot: int
    keyword: str | None
    offset: int
    rows: int
    padding_idx: int | None


@dataclass(frozen=True)
class InstalledBoundary:
    """What :func:`parallelize` installed on one module.

    Attributes:
        module: the module's qualified name.
        form: the classified boundary.
        mode: how it runs: ``lowered`` (direct collectives) or ``dtensor``.
        reason: why a lowerable boundary runs ``dtensor``, or ``None``.
        deferred_bias: the parameter added after the output transition, or ``None``.
    """

    module: str
    form: BoundaryForm
    mode: str
    reason: str | None
    deferred_bias: str | None


@dataclass(frozen=True)
class _Static:
    """What one call of a boundary reads, besides its module and arguments: equal boundaries share one.

    :class:`_Boundary` keeps it up to date (every attribute it is made from
    rebuilds it when set). Interned by value: boundaries of the same layout
    (a model's every ``q_proj``, say) hold one object, so a ``torch.compile``
    trace reads it from one place and guards on its fields once, not once
    per boundary (:mod:`tplower.runtime.interned`); ``key`` is its number.
    """

    lowerer: MeshLowerer
    move: _Mover
    #: the boundary's moves with ``where`` (which names the module) left empty: messages take the boundary's own
    ins: tuple[_Move, ...]
    #: whether any input move is shared with siblings (the keys, which name the parent, stay on the boundary)
    fanned: bool
    outs: tuple[_Move, ...]
    params: tuple[tuple[str, ParamLayout], ...]
    deferred_bias: str | None
    lookup: _Lookup | None
    tail: int
    tail_rep: Placements
    tail_grad: Placements
    share: tuple[int, ...]
    share_n: int
    #: the module's own forward, called with the module first; ``None``: the boundary's ``compute`` as it is
    func: Callable[..., Any] | None
    #: join the moved inputs and local parameters to the outputs in autograd (:func:`tie_outputs`)
    tie: bool
    #: the outputs leave a sharded region open (``True``: sharded along the axis), closed (``False``: replicated
    #: or partial) or as it was (``None``): where dropout switches streams (:mod:`tplower.runtime.dropout`)
    region: bool | None = None
    #: an output move reads an input's size before its move (``like_input``): the call keeps those values
    like: bool = False
    #: run as one node whose input gradient's all_reduce overlaps the weight gradient (:mod:`tplower.runtime.overlap`)
    overlap: bool = False
    key: int = field(default=0, compare=False)
    #: two or more parameters whose gradients sum alike may share one all_reduce (:func:`local_parameters`): decided
    #: at install from the layouts, so a call under plain tensor parallelism takes each view alone
    grouped: bool = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "grouped", sum(layout.sums_only for _, layout in self.params) > 1)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Static:
        return self  # immutable and the same for any model (a deep copy of a model shares it, and its number)


#: the attributes of :class:`_Boundary` a :class:`_Static` is made from
_STATIC_FROM = frozenset({"lowerer", "move", "ins", "fan", "outs", "params", "info", "lookup", "tail", "tail_rep",
                          "tail_grad", "share", "share_n", "compute", "owner", "tie", "region", "overlap"})

#: module types whose output depends on every input and parameter for any data (no tie needed, see :func:`_tie`)
_DIRECT = (nn.Linear, nn.Embedding, nn.LayerNorm)


class _Boundary:
    """The instance ``forward``: local parameters in, move inputs, run local compute, move outputs, add the bias.

    The module's DTensor parameters are swapped for their local tensors
    (:func:`tplower.runtime.params.local_parameter`) for the duration of the call
    and put back afterwards, so the module's own code computes on local
    tensors and wrappers (FSDP2) that replace the parameter objects between
    calls are followed.

    A call reads its layout from one shared :class:`_Static` (``static``);
    under ``torch.compile`` the trace finds it by number (``static_key``, kept
    as a string: :func:`~tplower.runtime.interned.traced`), so the graph
    guards on one value per boundary and on each distinct layout
    once, as DTensor's hooks guard on their shared closures.
    """

    static: _Static
    static_key: str

    def __init__(self, info: InstalledBoundary, owner: nn.Module, compute: Callable[..., Any],
                 ins: tuple[_Move, ...], outs: tuple[_Move, ...], lowerer: MeshLowerer,
                 params: tuple[tuple[str, ParamLayout], ...] = (), lookup: _Lookup | None = None) -> None:
        self.info, self.owner, self.compute, self.ins, self.outs = info, owner, compute, ins, outs
        self.lowerer, self.params, self.lookup = lowerer, params, lookup
        #: ``partial_tail``: features at the end of the output whose gradient is partial, and the placements
        #: (``R`` on every axis) and gradient placements (``P(sum)`` on the entry's axis) of that transition
        self.tail = 0
        self.tail_rep: Placements = ()
        self.tail_grad: Placements = ()
        #: ``share``: output slots given as this rank's ``1/share_n`` of a sum (forward and backward divide)
        self.share: tuple[int, ...] = ()
        self.share_n = 1
        #: the resolved entry and the axis it was installed for (LoRA adapters take their placements from it)
        self.entry: BoundaryEntry | None = None
        self.axis = ""
        self.move: _Mover = _lowered if info.mode == "lowered" else _dtensor
        #: join moved inputs and local parameters to the outputs (:func:`tie_outputs`): a compute that may leave
        #: some out for data alone (anything but a plain linear layer, lookup or norm)
        self.tie = type(owner) not in _DIRECT and not is_conv1d(owner)
        #: whether the outputs open or close a sharded region (see :class:`_Static`), and the model's dropout
        #: streams (:func:`tplower.runtime.dropout.install_dropout_streams`; ``None``: nothing to switch)
        self.region: bool | None = None
        self.streams: DropoutStreams | None = None
        #: overlap the input gradient's all_reduce with the weight gradient where the boundary allows it
        self.overlap = False
        #: per input move, the key of the sibling group that shares it (:mod:`tplower.runtime.fanout`), or ``None``
        self.fan: tuple[str | None, ...] = (None,) * len(ins)
        self._restatic()

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _STATIC_FROM and "fan" in self.__dict__:  # "fan" is set last in __init__
            self._restatic()

    def _restatic(self) -> None:
        compute = self.compute
        func = compute.__func__ if isinstance(compute, MethodType) and compute.__self__ is self.owner else None
        like = any(mv.like_input >= 0 for mv in self.outs)  # the fused node keeps no input's value before its move
        overlap = self.overlap and not like and can_overlap(
            self.owner, func, self.ins, self.params, self.move is _lowered,
            self.lookup is None and self.info.deferred_bias is None)
        st = intern(_Static(self.lowerer, self.move, tuple(replace(mv, where="") for mv in self.ins),
                             any(f is not None for f in self.fan), tuple(replace(mv, where="") for mv in self.outs),
                             self.params,
                             self.info.deferred_bias, self.lookup, self.tail, self.tail_rep, self.tail_grad,
                             self.share, self.share_n, func, self.tie, self.region,
                             like, overlap))
        object.__setattr__(self, "static", st)
        object.__setattr__(self, "static_key", slot_key(st.key))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        compiling = torch.compiler.is_compiling()
        st: _Static = traced(self.static_key) if compiling else self.static
        if st.overlap and not compiling and \
                (fused := overlapped_call(self.owner, st.lowerer, st.ins[0], st.params, args, kwargs)) is not None:
            return self._finish(st, fused, None)
        owner = self.owner
        args_l = list(args)
        fans = self.fan if st.fanned else (None,) * len(st.ins)
        moved: list[Any] = []
        cut: dict[int, Any] = {}  # by input move, its value before the move (an output sized like it reads it)
        for i, (mv, fan) in enumerate(zip(st.ins, fans, strict=True)):
            if mv.keyword is not None and mv.keyword in kwargs:
                if st.like:
                    cut[i] = kwargs[mv.keyword]
                kwargs[mv.keyword] = _move_in(self, st, kwargs[mv.keyword], i, fan)
                moved.append(kwargs[mv.keyword])
            elif 0 <= mv.slot < len(args_l):
                if st.like:
                    cut[i] = args_l[mv.slot]
                args_l[mv.slot] = _move_in(self, st, args_l[mv.slot], i, fan)
                moved.append(args_l[mv.slot])
        lookup = st.lookup
        mine = _mask_ids(self, lookup, args_l, kwargs) if lookup is not None else None
        params = owner._parameters
        saved = {name: params[name] for name, _ in st.params}
        bias_name = st.deferred_bias
        pad = getattr(owner, "padding_idx", None) if lookup is not None else None
        try:
            if st.grouped:  # the gradients' sums that can run as one all_reduce do
                views = local_parameters([saved[name] for name, _ in st.params], [lay for _, lay in st.params])
                for (name, _), view in zip(st.params, views, strict=True):
                    if view is not None:
                        params[name] = view  # type: ignore[assignment]
            else:
                for name, layout in st.params:
                    p = saved[name]
                    if p is not None:
                        params[name] = local_parameter(p, layout)  # type: ignore[assignment]
            bias = None
            if bias_name is not None:
                bias, params[bias_name] = params[bias_name], None
            if lookup is not None:
                owner.__dict__["padding_idx"] = lookup.padding_idx
            out = st.func(owner, *args_l, **kwargs) if st.func is not None else self.compute(*args_l, **kwargs)
            if st.tie and torch.is_grad_enabled():
                out = tie_outputs(out, moved, [params[name] for name, _ in st.params])
        finally:
            params.update(saved)
            if lookup is not None:
                owner.__dict__["padding_idx"] = pad
        if mine is not None:  # rows of ids another rank holds: zero here, their owner's row after the reduction
            out = out.masked_fill(~mine.unsqueeze(-1), 0)
        # A plain Linear, Embedding or LayerNorm's own forward returns one fresh tensor its backward does not
        # save: its one output move may reduce it in place (no copy); any other compute keeps its output as is.
        return self._finish(st, out, bias, cut, owned=not st.tie and st.func is not None and len(st.outs) == 1)

    def _finish(self, st: _Static, out: Any, bias: torch.Tensor | None, cut: dict[int, Any] | None = None,
                owned: bool = False) -> Any:
        """Move the outputs, add the deferred bias, switch dropout streams where a sharded region opens or closes.

        ``cut``: the inputs' values before their moves, by input move (outputs sized like an input read them).
        ``owned``: ``out`` is the module's own fresh tensor, which the output move may reuse.
        """
        result = _outputs(self, st, out, bias, cut, owned)
        if st.region is not None and not torch.compiler.is_compiling():
            streams = self.streams
            if streams is not None and self.owner.training:
                if st.region:
                    streams.open()
                else:
                    streams.close()
        return result


def _mask_ids(b: _Boundary, lk: _Lookup, args: list[Any], kwargs: dict[str, Any]) -> torch.Tensor:
    """Shift the ids input to this rank's rows; ids outside them look up row 0. Returns where ids are local."""
    key = lk.keyword if lk.keyword is not None and lk.keyword in kwargs else None
    ids = kwargs[key] if key is not None else args[lk.slot]
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"module {b.info.module!r}: the ids input is a {type(ids).__name__}, not a tensor")
    local = ids - lk.offset
    mine = (local >= 0) & (local < lk.rows)
    local = local.masked_fill(~mine, 0)
    if key is not None:
        kwargs[key] = local
    else:
        args[lk.slot] = local
    return mine


def _apply(b: _Boundary, st: _Static, value: Any, i: int, out: bool, cut: dict[int, Any] | None = None,
           owned: bool = False) -> Any:
    """Move ``value`` by input (``out`` false) or output move ``i``; ``None`` passes through.

    ``cut``: the inputs' values before their moves, by input move (outputs sized by an input read them).
    ``owned``: ``value`` is the module's own fresh output, which the move may reuse.
    """
    mv = st.outs[i] if out else st.ins[i]
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"module {b.info.module!r}: {mv.name!r} is a {type(value).__name__}, not a tensor")
    if mv.uneven or mv.sized or st.lowerer.debug:  # these name the module in messages: the boundary's own move does
        mv = b.outs[i] if out else b.ins[i]
    gshape: tuple[int, ...] | None = None
    if mv.like_input >= 0 or mv.param_size is not None:  # known at install: no exchange (no graph break)
        gshape = known_global_shape(value, mv.src, st.lowerer, mv.where, params=mv.param_size,
                                    cut_from=(cut or {}).get(mv.like_input))
    elif mv.uneven:
        gshape = exchanged_global_shape(value, mv.src, st.lowerer, mv.where)
    elif mv.sized:
        gshape = agreed_global_shape(value, mv.src, mv.sized, st.lowerer, mv.where)
    return st.move(value, st.lowerer, mv, gshape, owned)


def _move_in(b: _Boundary, st: _Static, value: Any, i: int, fan: str | None) -> Any:
    return shared_move(value, st.ins[i], fan, st.lowerer, lambda v: _apply(b, st, v, i, False))


def _reduce_tail_grad(st: _Static, out: torch.Tensor) -> torch.Tensor:
    """The last ``tail`` features pass forward unchanged; their gradient is all-reduced in backward."""
    head, tail = out.split([out.shape[-1] - st.tail, st.tail], dim=-1)
    tail = st.lowerer.program(st.tail_rep, st.tail_rep, tail.shape, tail.device.type, grad=st.tail_grad)(tail)
    return torch.cat([head, tail], dim=-1)


def _outputs(b: _Boundary, st: _Static, out: Any, bias: torch.Tensor | None = None,
             cut: dict[int, Any] | None = None, owned: bool = False) -> Any:
    is_seq = isinstance(out, tuple | list)
    items = list(out) if is_seq else [out]
    for i, mv in enumerate(st.outs):
        if mv.slot >= len(items):
            raise TPLowerError(f"module {b.info.module!r}: output {mv.name!r} is index {mv.slot} but forward "
                               f"returned {count(len(items), 'value')}")
        items[mv.slot] = _apply(b, st, items[mv.slot], i, True, cut, owned and not is_seq)
    if bias is not None:  # in the output's dtype, as F.linear adds it (bf16 under autocast)
        items[0] = items[0] + bias.to(items[0].dtype)
    if st.tail:
        items[0] = _reduce_tail_grad(st, items[0])
    for slot in st.share:  # the division's own gradient is this rank's share: no collective either way
        if slot >= len(items):
            raise TPLowerError(f"module {b.info.module!r}: share names output index {slot} but forward "
                               f"returned {count(len(items), 'value')}")
        items[slot] = items[slot] / st.share_n
    if not is_seq:
        return items[0]
    return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)


def installed_boundary(module: nn.Module) -> InstalledBoundary | None:
    """What :func:`parallelize` installed on ``module`` (``None`` when its boundary is a plain identity).

    A module running a generated forward (:func:`tplower.codegen.install`) reports the boundary it replaced.
    """
    fwd = module.__dict__.get("forward")
    if not isinstance(fwd, _Boundary):
        fwd = module.__dict__.get(REPLACED)
    return fwd.info if isinstance(fwd, _Boundary) else None


#: the attribute where :func:`tplower.codegen.install` keeps the boundary a generated forward replaced
REPLACED = "_tplower_boundary"
