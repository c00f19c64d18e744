"""How a boundary moves one tensor: :class:`_Move` (what a boundary declared), and the movers that run it.

:func:`_lowered` runs a move through tplower's lowered program (found by the
call's arguments in the lowerer's call cache, :mod:`tplower.core.lower.callcache`,
after the first call); :func:`_dtensor` through DTensor's ``redistribute``
(a generic boundary). :mod:`tplower.runtime.boundary` and the generated
forwards (:mod:`tplower.codegen.ops`) call them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.language.placements import parse_placements
from ..core.language.transitions import global_shape_from_local
from ..core.lower.redistribute import MeshLowerer
from ..plans.forms import Placements

__all__: list[str] = []


@dataclass(frozen=True)
class _Move:
    slot: int  # input: position (-1: keyword only); output: index
    keyword: str | None
    name: str
    src: Placements
    dst: Placements
    grad: Placements
    where: str  # for messages: module 'up', input '0'
    uneven: bool  # named in the entry's ``uneven``: exchange local sizes each call
    #: not declared ``uneven``, mesh axes along which the source shards a dim the move changes and whose global size
    #: install cannot know: sizes exchanged (eager) or checked equal (compiled) each call (:func:`agreed_global_shape`)
    sized: tuple[int, ...] = ()
    #: an output whose global size along the one dim its source shards is known without exchanging sizes
    #: (:func:`known_global_shape`): the index in the boundary's input moves of the input it was cut from (an
    #: expert-parallel block's tokens; ``-1``: none), or the ``(global size, this rank's piece)`` of that dim
    #: that the module's sharded parameters give it (a vocabulary that does not divide: the lm_head's logits)
    like_input: int = -1
    param_size: tuple[int, int] | None = None


_Mover = Callable[..., torch.Tensor]  # (t, lowerer, move, global shape or None, owned=False) -> moved t


def _lowered(t: torch.Tensor, lowerer: MeshLowerer, mv: _Move, gshape: tuple[int, ...] | None,
             owned: bool = False) -> torch.Tensor:
    """``mv`` of ``t`` through its lowered program; ``owned``: ``t`` is the module's own fresh output, which a
    reduction may reuse (:meth:`tplower.core.lower.program.Program.run_owned`)."""
    if lowerer.debug:
        return lowerer.checked(t, mv.src, mv.dst, grad=mv.grad, global_shape=gshape, where=mv.where,
                               hint=f"uneven shards: name {mv.name!r} in the entry's 'uneven' field")
    if torch.compiler.is_compiling():  # the program is read untraced (MeshLowerer.program), never a cache
        return lowerer.program(mv.src, mv.dst, t.shape, t.device.type, grad=mv.grad, global_shape=gshape)(t)
    prog = lowerer.calls.lookup(t, mv.src, mv.dst, mv.grad, gshape)  # a move seen before: no planning key
    if prog is None:
        prog = lowerer.program(mv.src, mv.dst, t.shape, t.device.type, grad=mv.grad, global_shape=gshape)
        lowerer.calls.store(t, mv.src, mv.dst, mv.grad, gshape, prog)
    return prog.run_owned(t) if owned else prog(t)


def _dtensor(t: torch.Tensor, lowerer: MeshLowerer, mv: _Move, gshape: tuple[int, ...] | None,
             owned: bool = False) -> torch.Tensor:
    src, dst, grad = (parse_placements(p, tensor_ndim=t.ndim) for p in (mv.src, mv.dst, mv.grad))
    if gshape is None:
        gshape = global_shape_from_local(t.shape, src, lowerer.shape)
    return lowerer.dtensor_redistribute(t, src=src, dst=dst, grad=grad, gshape=gshape)
