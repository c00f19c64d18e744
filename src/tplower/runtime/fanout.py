"""One move for sibling modules that read the same tensor: ``q``, ``k``, ``v`` of one attention, ``gate``/``up``.

Column-parallel siblings each declare the same input transition, e.g.
``R -> R`` with a ``P(sum)`` gradient: forward is the identity and backward
all-reduces the input's gradient. Run once per sibling, the three
projections of an attention all-reduce three gradients of one tensor; run
once for all of them, autograd first sums the three gradients locally and one
all_reduce moves the sum. Every backward program is linear, so the two are
equal (up to the order of a floating-point sum). With sequence parallelism
(``S(1) -> R``, gradient reduce_scatter) the forward all_gather is shared
too.

:func:`link_fanouts` finds, after :func:`tplower.parallelize` installed its
boundaries, every parent module with two or more direct children whose
lowered boundaries move an input with the same placements (source,
destination, gradient), tags those moves with one group key and registers
:func:`open_fanout` as the parent's forward pre-hook. That hook gives each
call its own alias of every tensor argument, carrying an empty record
(:data:`tplower.runtime.boundary.FANOUT`); a sibling that finds the
record takes a move already made from that same tensor in this call
(``boundary_runtime._move_in``). A tensor without the record (a child called on
its own, a tensor made inside the parent) moves as before, so the sharing
never reaches past one call of the parent, and a tensor the user holds
never carries it.

Column-parallel linear siblings that :mod:`tplower.runtime.overlap` runs as
fused nodes (``parallelize(..., overlap=True)``, eager with grad) do not
take the shared move: each all-reduces its own input gradient while its
weight gradient is computed. Calls that take the unfused path (no grad, a
``torch.compile`` trace) share as before.

Left unshared: boundaries on DTensor (``mode="dtensor"``), inputs named
``uneven`` (their sizes are exchanged per call), the debug path
(``TPLOWER_DEBUG``: each boundary checks its own move), and, inside a
``torch.compile`` trace or under ``torch.inference_mode`` (no version
counters), moves whose forward is not the identity.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from ..core.language.placements import format_placements
from ..plans.forms import Placements
from .boundary import FANOUT, _Boundary

__all__ = ["close_fanout", "link_fanouts", "open_fanout"]


def _alias(value: Any) -> Any:
    if type(value) is not torch.Tensor and type(value) is not FakeTensor:  # fake: tplower.planner's trace
        return value
    alias = value.view_as(value)
    setattr(alias, FANOUT, ())
    return alias


def open_fanout(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook (``with_kwargs=True``) of a fan-out parent: each plain tensor argument becomes a fresh alias.

    The alias (``view_as``: same storage, same values, its gradient flows
    to the argument) carries an empty record of moves made from it in this
    call. Arguments that are not plain ``torch.Tensor`` (DTensors, tuples,
    ``None``) pass unchanged.
    """
    return tuple(_alias(a) for a in args), {k: _alias(v) for k, v in kwargs.items()}


def close_fanout(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
    """Forward hook (``with_kwargs=True``) of a fan-out parent: the aliases :func:`open_fanout` made drop their
    records, so the moves they hold live no longer than autograd keeps them (a record outliving the call would
    keep each moved tensor as long as anything keeps the alias; a compiled graph keeps none)."""
    if torch.compiler.is_compiling():
        return
    for value in (*args, *kwargs.values()):
        if FANOUT in getattr(value, "__dict__", ()):
            delattr(value, FANOUT)


def _key(parent: str, src: Placements, dst: Placements, grad: Placements) -> str:
    return f"{parent or '<root>'}: {format_placements(src)} -> {format_placements(dst)} grad {format_placements(grad)}"


def link_fanouts(modules: Mapping[str, nn.Module]) -> dict[str, list[str]]:
    """Tag sibling boundaries that move an input the same way and hook their parents (:func:`open_fanout`).

    Args:
        modules: ``dict(model.named_modules())`` of a model :func:`tplower.parallelize` just installed.

    Returns:
        For each group key (parent, placements), the children sharing that move, in module order. Empty when
        no parent has two such children.
    """
    groups: dict[str, dict[str, list[tuple[_Boundary, int, str]]]] = defaultdict(lambda: defaultdict(list))
    for qual, module in modules.items():
        boundary = module.__dict__.get("forward")
        if not isinstance(boundary, _Boundary) or boundary.info.mode != "lowered" or boundary.lookup is not None:
            continue
        parent = qual.rpartition(".")[0]
        for i, mv in enumerate(boundary.ins):
            if not mv.uneven:
                groups[parent][_key(parent, mv.src, mv.dst, mv.grad)].append((boundary, i, qual))
    linked: dict[str, list[str]] = {}
    for parent, by_key in groups.items():
        shared = {key: members for key, members in by_key.items() if len({id(b) for b, _, _ in members}) > 1}
        for key, members in shared.items():
            for boundary, i, _ in members:
                fan = list(boundary.fan)
                fan[i] = key
                boundary.fan = tuple(fan)
            linked[key] = [qual for _, _, qual in members]
        if shared:
            modules[parent].register_forward_pre_hook(open_fanout, with_kwargs=True)
            modules[parent].register_forward_hook(close_fanout, with_kwargs=True, always_call=True)
    return linked
