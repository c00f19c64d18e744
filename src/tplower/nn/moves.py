"""Where a boundary's declared inputs and outputs arrive and leave, and what each move needs at call time.

Pure reading of a module's ``forward`` signature and a boundary form: the
position or keyword of each declared input, the slot of each declared output,
which mesh axes a move must learn a global size on (:func:`sized_axes`),
which gathered outputs have a global size install knows (:func:`known_sizes`),
whether the outputs open a sharded region for dropout (:func:`opens_region`),
and a vocabulary-parallel lookup's rows (:func:`lookup`). Used by
:mod:`tplower.nn.resolve` (and :func:`known_sizes` by :mod:`tplower.nn.install`,
once the parameters are placed); nothing here changes a module.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from ..core.language.placements import replicate_partials
from ..core.language.transitions import chunk_size_and_offset
from ..core.lower import collectives as C
from ..core.lower.redistribute import MeshLowerer
from ..core.support.errors import TPLowerError
from ..plans.entries import BoundaryEntry
from ..plans.forms import BoundaryForm, BoundaryOp
from ..runtime.boundary import _Lookup
from ..runtime.movers import _Move
from ..runtime.params import ParamLayout

__all__ = ["input_moves", "input_slot", "known_sizes", "live_reason", "lookup", "opens_region", "output_moves",
           "output_slot", "without_absent_inputs"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
               inspect.Parameter.VAR_POSITIONAL)
_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def input_slot(name: str, fwd: Callable[..., Any], where: str) -> tuple[int, str | None]:
    """Where input ``name`` (a ``forward`` parameter name or a position) arrives: (position or -1, keyword).

    Raises:
        TPLowerError: ``fwd`` takes no such input (and no ``**kwargs`` to catch the name).
    """
    sig = list(inspect.signature(fwd).parameters.values())
    named = [p for p in sig if p.kind != p.VAR_KEYWORD]
    if name.isdigit():
        p = named[int(name)] if int(name) < len(named) else None
    else:
        p = next((q for q in named if q.name == name), None)
    if p is None and (name.isdigit() or len(named) == len(sig)):  # no **kwargs to catch the name
        raise TPLowerError(f"{where}: forward has no input {name!r}; it has {[q.name for q in named]} "
                           "(or positions '0', '1', ...)")
    pos = named.index(p) if p is not None and p.kind in _POSITIONAL else -1
    return pos, name if p is None else (p.name if p.kind in _KEYWORD else None)


def without_absent_inputs(entry: BoundaryEntry, fwd: Callable[..., Any], qual: str) -> BoundaryEntry:
    """``entry`` less the ``optional_inputs`` that ``fwd`` does not take."""
    absent = set()
    for name in entry.optional_inputs:
        try:
            input_slot(name, fwd, qual)
        except TPLowerError:
            absent.add(name)
    if not absent:
        return entry

    def keep(m: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in m.items() if k not in absent}

    return dataclasses.replace(entry, in_src=keep(entry.in_src), in_dst=keep(entry.in_dst),
                               in_grad=keep(entry.in_grad))


def opens_region(form: BoundaryForm, lowerer: MeshLowerer, axis: str) -> bool | None:
    """Whether the boundary's outputs stay sharded along ``axis`` (``True``), end whole or partial (``False``), or
    are not declared (``None``): where dropout enters or leaves a sharded region (:mod:`tplower.runtime.dropout`)."""
    if not form.outputs or axis not in lowerer.names:
        return None
    i = lowerer.names.index(axis)
    return any(i < len(op.dst) and isinstance(op.dst[i], Shard) for op in form.outputs)


def _sized_axes(op: BoundaryOp, uneven: tuple[str, ...], known: frozenset[int] = frozenset()) -> tuple[int, ...]:
    """The mesh axes along which ``op``'s source shards a dim it moves, when nothing says that dim's global size.

    Not for a name declared ``uneven`` (exchanged anyway), nor along ``known``
    axes (an output dim a sharded parameter of the module sizes). A sequence
    entering ``S(1) -> R`` is the case: :func:`tplower.runtime.uneven.agreed_global_shape`
    then learns or checks its size each call instead of assuming it divides.
    """
    if op.name in uneven:
        return ()
    return tuple(i for i, p in enumerate(op.src) if isinstance(p, Shard) and p != op.dst[i] and i not in known)


def input_moves(ops: tuple[BoundaryOp, ...], fwd: Callable[..., Any], module: str,
                uneven: tuple[str, ...] = ()) -> tuple[_Move, ...]:
    """The moves of the declared inputs that move (identities left out), each with where it arrives."""
    return tuple(_Move(*input_slot(op.name, fwd, f"plan[{module!r}].in"), op.name, op.src, op.dst, op.grad,
                       f"module {module!r}, input {op.name!r}", op.name in uneven, _sized_axes(op, uneven))
                 for op in ops if not op.identity)


def output_slot(name: str, entry: BoundaryEntry, module: str, field: str) -> int:
    """The position of output ``name`` (``out``, a position, or one of ``out_names``) in what forward returns.

    Raises:
        TPLowerError: a name that is none of those (``field`` names the entry field in the message).
    """
    if name == "out" or name.isdigit():
        return 0 if name == "out" else int(name)
    if entry.out_names is not None and name in entry.out_names:
        return entry.out_names.index(name)
    raise TPLowerError(f"plan[{module!r}].{field}: output {name!r} is not 'out', a position or one of "
                       f"out_names={entry.out_names}")


def output_moves(ops: tuple[BoundaryOp, ...], entry: BoundaryEntry, module: str,
                 layouts: Mapping[str, ParamLayout]) -> tuple[_Move, ...]:
    """The moves of the declared outputs that move, each with its slot in what ``forward`` returns."""
    # an output sharded along an axis that shards a parameter is sized by that parameter (colwise features)
    known = frozenset(j for layout in layouts.values() for j, q in enumerate(layout.placements) if isinstance(q, Shard))
    moves = []
    for op in ops:
        if op.identity:
            continue
        moves.append(_Move(output_slot(op.name, entry, module, "out"), None, op.name, op.src, op.dst, op.grad,
                           f"module {module!r}, output {op.name!r}", op.name in entry.uneven,
                           _sized_axes(op, entry.uneven, known)))
    return tuple(moves)


def _param_sizes(module: nn.Module, layouts: Mapping[str, ParamLayout], axis: str) -> set[tuple[int, int]]:
    """``(global size, packed parts)`` of each dim the module's parameters shard along mesh axis ``axis``."""
    found = set()
    for name, layout in layouts.items():
        names = tuple(layout.mesh.mesh_dim_names or ())
        p = module._parameters.get(name)
        q = layout.placements[names.index(axis)] if axis in names else None
        if isinstance(q, Shard) and p is not None:
            found.add((int(p.shape[q.dim]), layout.packed))
    return found


def _known(mv: _Move, module: nn.Module, ins: tuple[_Move, ...], layouts: Mapping[str, ParamLayout],
           experts: bool, lowerer: MeshLowerer, axis: str) -> _Move:
    sharded = [i for i, p in enumerate(mv.src) if isinstance(p, Shard)]
    if not mv.uneven or len(sharded) != 1 or lowerer.names[sharded[0]] != axis:
        return mv
    if experts:  # its tokens, cut from its first input (the hidden states, whole on the axis)
        cut = [j for j, m in enumerate(ins) if m.slot == 0 and m.dst == mv.src
               and not any(isinstance(p, Shard) for p in m.src)]
        return dataclasses.replace(mv, like_input=cut[0]) if cut else mv
    sizes = _param_sizes(module, layouts, axis)
    shard = mv.src[sharded[0]]
    if len(sizes) != 1 or not isinstance(shard, Shard) or shard.dim != -1:
        return mv
    (size, packed), = sizes
    n, c = lowerer.shape[sharded[0]], lowerer.coord[sharded[0]]
    return dataclasses.replace(mv, param_size=(size, packed * chunk_size_and_offset(size // packed, n, c)[0]))


def known_sizes(module: nn.Module, outs: tuple[_Move, ...], ins: tuple[_Move, ...],
                layouts: Mapping[str, ParamLayout], experts: bool, lowerer: MeshLowerer, axis: str
                ) -> tuple[_Move, ...]:
    """``outs`` with the global size of each gathered ``uneven`` dim that install knows: no exchange per call.

    An output whose sizes would be exchanged each call (``uneven``: one
    ``all_gather`` of sizes, a graph break under ``torch.compile``) needs no
    exchange when its global size is known here:

    * an expert-parallel block's output (``experts``) is its tokens, cut from
      its first input (whole on the axis): that input's size, read at each
      call (``like_input``);
    * an output the entry's axis shards on its last dim (``S(-1)``: its
      features) of a module whose parameters shard one global size along that
      axis (a colwise ``lm_head`` of a vocabulary that does not divide): that
      size and this rank's ``torch.chunk`` piece of it (``param_size``).

    Other moves are returned as they are. The moves keep ``uneven`` (generated
    code still exchanges sizes). Reads the module's parameters' global shapes.
    """
    return tuple(_known(mv, module, ins, layouts, experts, lowerer, axis) for mv in outs)


def lookup(module: nn.Module, entry: BoundaryEntry, layouts: Mapping[str, ParamLayout], fwd: Callable[..., Any],
           qual: str) -> _Lookup | None:
    """A vocabulary-parallel lookup's ids input, this rank's first row, row count and local padding row.

    Raises:
        TPLowerError: a ``masked_lookup`` entry whose ``weight`` is not sharded ``S(0)`` on one axis.
    """
    if entry.masked_lookup is None:
        return None
    where = f"plan[{qual!r}].masked_lookup"
    layout = layouts.get("weight")
    sharded = [i for i, q in enumerate(layout.placements) if isinstance(q, Shard)] if layout else []
    if layout is None or len(sharded) != 1 or layout.placements[sharded[0]] != Shard(0):
        raise TPLowerError(f"{where}: needs a 'weight' parameter sharded S(0) on one axis (its rows)")
    p = module._parameters["weight"]
    assert p is not None
    n, c = layout.mesh.size(sharded[0]), layout.mesh.get_coordinate()
    assert c is not None
    rows, offset = chunk_size_and_offset(p.shape[0], n, c[sharded[0]])  # torch.chunk rows: uneven when V % n
    pad = getattr(module, "padding_idx", None)
    local_pad = pad - offset if isinstance(pad, int) and 0 <= pad - offset < rows else None
    return _Lookup(*input_slot(entry.masked_lookup, fwd, where), offset, rows, local_pad)


def _axes_moved(op: BoundaryOp) -> list[int]:
    home = replicate_partials(op.src)
    return [i for i in range(len(op.src)) if op.src[i] != op.dst[i] or op.grad[i] != home[i]]


def live_reason(lowerer: MeshLowerer, form: BoundaryForm) -> str | None:
    """Why a lowerable boundary must run on DTensor on the live mesh (a moved axis on an unknown backend), or None.

    Reads each moved axis's backend name (no collective).
    """
    for op in form.inputs + form.outputs:
        for i in sorted(set(_axes_moved(op))):
            backend = C.backend_for_device(str(dist.get_backend(lowerer.groups[i])), lowerer.mesh.device_type)
            if not C.backend_caps(backend).all_to_all:  # the safe minimum: a backend tplower does not know
                return f"axis {lowerer.names[i]!r}: backend {backend!r} is unknown to tplower"
    return None
