"""Hooks that record, per call of each parallelized module, its inputs and outputs and the gradients reaching them.

Used by :func:`tplower.verify` on both copies of the model: the parallel one
(where :func:`tplower.parallelize` installed boundaries; its points carry the
placements to read them back by) and the one-process reference (the same
module names; its values are already global).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Placement, Shard

from ..core.language.placements import format_placements, replicate_partials
from ..core.support.errors import TPLowerError
from ..nn.moves import input_slot
from ..runtime.boundary import _Boundary

__all__ = ["OpenCall", "Point", "Recorder", "Slots", "hook_parallel", "hook_reference"]

Placements = tuple[Placement, ...]
#: per module: where each named input arrives (position, keyword) and the output names
Slots = dict[str, tuple[dict[str, tuple[int, str | None]], tuple[str, ...]]]


@dataclass
class Point:
    """One recorded tensor: this rank's value (parallel: local; reference: global) and the gradient reaching it."""

    module: str
    kind: str
    name: str
    value: torch.Tensor
    vplace: Placements | None  # how to read the value back (None: do not compare it)
    gplace: Placements | None  # how to read the gradient back
    order: int
    grad: torch.Tensor | None = None
    grad_order: int = -1


@dataclass
class OpenCall:
    """A boundary's call that has begun and not yet returned: what it received, and what its compute got.

    Attributes:
        module: the module's qualified name.
        form: its boundary form (``tp_collective``, ...).
        received: ``(input name, local shape, declared placement)`` as the module received each input.
        computed: the same for each input its compute got after the boundary's moves (``None``: the
            compute had not begun, a move failed).
    """

    module: str
    form: str
    received: list[tuple[str, tuple[int, ...], str]]
    computed: list[tuple[str, tuple[int, ...], str]] | None = None


@dataclass
class Recorder:
    """Points keyed by (module, kind, name, call), with forward and backward sequence numbers.

    ``open``: the parallel model's boundary calls under way, outermost first; the last one is where an
    exception in the forward was raised (:mod:`tplower.verification.raised`).
    """

    points: dict[tuple[str, str, str, int], Point] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)
    seq: int = 0
    grad_seq: int = 0
    active: bool = True
    open: list[OpenCall] = field(default_factory=list)

    def add(self, module: str, kind: str, name: str, t: Any, vplace: Placements | None,
            gplace: Placements | None) -> None:
        if not isinstance(t, torch.Tensor) or not self.active:
            return
        p = Point(module, kind, name, t.detach().clone(), vplace, gplace, self.seq)
        self.seq += 1
        self.points[(module, kind, name, self.calls[module])] = p
        if t.requires_grad:
            t.register_hook(lambda g, p=p: self._grad(p, g))

    def _grad(self, p: Point, g: torch.Tensor) -> None:
        p.grad = g.detach().clone() if p.grad is None else p.grad + g.detach()
        p.grad_order = self.grad_seq
        self.grad_seq += 1


def _pick(args: Sequence[Any], kwargs: Mapping[str, Any], slot: int, keyword: str | None) -> Any:
    if keyword is not None and keyword in kwargs:
        return kwargs[keyword]
    return args[slot] if 0 <= slot < len(args) else None


def _alias(args: Any, kwargs: Any, slots: Any) -> tuple[Any, Any]:
    """The inputs at ``slots`` as fresh views, so the gradient recorded there is this module's use alone."""
    args, kwargs = list(args), dict(kwargs)
    for slot, kw in slots:
        if kw is not None and kw in kwargs and isinstance(kwargs[kw], torch.Tensor) and kwargs[kw].requires_grad:
            kwargs[kw] = kwargs[kw].view_as(kwargs[kw])
        elif 0 <= slot < len(args) and isinstance(args[slot], torch.Tensor) and args[slot].requires_grad:
            args[slot] = args[slot].view_as(args[slot])
    return tuple(args), kwargs


def _out_item(out: Any, name: str, moves: Sequence[Any]) -> Any:
    idx = next((mv.slot for mv in moves if mv.name == name), None)
    if idx is None:
        idx = 0 if name == "out" else int(name) if name.isdigit() else None
    if idx is None:
        return None
    if isinstance(out, tuple | list):
        return out[idx] if idx < len(out) else None
    return out if idx == 0 else None


def _slots(module: nn.Module, names: Sequence[str]) -> dict[str, tuple[int, str | None]]:
    """Where each named input arrives in the module's own ``forward`` (names it cannot find are left out)."""
    fwd = type(module).forward.__get__(module)
    out = {}
    for n in names:
        try:
            out[n] = input_slot(n, fwd, "verify")
        except TPLowerError:
            continue
    return out


def hook_reference(model: nn.Module, specs: Mapping[str, tuple[dict[str, tuple[int, str | None]], tuple[str, ...]]],
                    rec: Recorder) -> None:
    modules = dict(model.named_modules())
    for qual, (slots, outs) in specs.items():
        def pre(m: nn.Module, args: Any, kwargs: Any, qual: str = qual,
                slots: dict[str, tuple[int, str | None]] = slots) -> tuple[Any, Any]:
            rec.calls[qual] += 1
            args, kwargs = _alias(args, kwargs, slots.values())
            for name, (slot, kw) in slots.items():
                rec.add(qual, "in", name, _pick(args, kwargs, slot, kw), None, None)
            return args, kwargs

        def post(m: nn.Module, args: Any, kwargs: Any, out: Any, qual: str = qual,
                 outs: tuple[str, ...] = outs) -> None:
            for name in outs:
                rec.add(qual, "out", name, _out_item(out, name, ()), None, None)

        modules[qual].register_forward_pre_hook(pre, with_kwargs=True)
        modules[qual].register_forward_hook(post, with_kwargs=True)


def hook_parallel(model: nn.Module, rec: Recorder) -> dict[str, tuple[dict[str, tuple[int, str | None]],
                                                                         tuple[str, ...]]]:
    """Hook every installed boundary of ``model``; returns each one's input slots and output names.

    An input or output that passes unchanged has its gradient checked too (its declared gradient is
    a claim), except inside a region: a module below a boundary that moves an input (``attn`` of
    ``attn.*: local_colwise``), whose local gradients are partial by design and reduced by the region.
    """
    boundaries = {q: m.__dict__["forward"] for q, m in model.named_modules()
                  if isinstance(m.__dict__.get("forward"), _Boundary)}
    regions = [q for q, b in boundaries.items() if b.ins]
    modules = dict(model.named_modules())
    specs = {}
    for qual, boundary in boundaries.items():
        module = modules[qual]
        form = boundary.info.form
        slots = _slots(module, [op.name for op in form.inputs])
        outs = tuple(op.name for op in form.outputs)
        specs[qual] = (slots, outs)
        in_region = any(qual.startswith(r + ".") or (r == "" and qual) for r in regions)
        _hook_boundary(module, qual, boundary, slots, rec, in_region)
    return specs


def _hook_boundary(module: nn.Module, qual: str, boundary: _Boundary,
                   slots: dict[str, tuple[int, str | None]], rec: Recorder, in_region: bool) -> None:
    form = boundary.info.form
    biased = boundary.info.deferred_bias is not None
    # a packed projection (fused gate/up, GPT-2's q/k/v) gives each rank its piece of every part, concatenated:
    # its sharded output is no S(d) piece, so it is not read back; its consumers' inputs are compared instead
    packed = any(layout.packed > 1 for _, layout in boundary.params)

    def readable(place: Placements | None) -> Placements | None:
        return None if packed and place is not None and any(isinstance(q, Shard) for q in place) else place

    def pre(m: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        rec.calls[qual] += 1
        args, kwargs = _alias(args, kwargs, slots.values())
        received = []
        for op in form.inputs:
            if op.name in slots:
                t = _pick(args, kwargs, *slots[op.name])
                rec.add(qual, "in", op.name, t, op.src,
                        None if op.identity and in_region else replicate_partials(op.src))
                if isinstance(t, torch.Tensor):
                    received.append((op.name, tuple(t.shape), format_placements(op.src)))
        rec.open.append(OpenCall(qual, form.form, received))
        return args, kwargs

    def post(m: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        if rec.open and rec.open[-1].module == qual:
            rec.open.pop()
        for op in form.outputs:
            rec.add(qual, "out", op.name, _out_item(out, op.name, boundary.outs), readable(op.dst),
                    None if op.identity and in_region else readable(op.grad))

    inner = boundary.compute

    def compute(*args: Any, **kwargs: Any) -> Any:
        computed = []
        for mv in boundary.ins:
            t = _pick(args, kwargs, mv.slot, mv.keyword)
            rec.add(qual, "in_local", mv.name, t, mv.dst, mv.grad)
            if isinstance(t, torch.Tensor):
                computed.append((mv.name, tuple(t.shape), format_placements(mv.dst)))
        if rec.open and rec.open[-1].module == qual:
            rec.open[-1].computed = computed
        out = inner(*args, **kwargs)
        for mv in boundary.outs if boundary.lookup is None else ():  # a lookup's rows are masked after compute
            rec.add(qual, "out_local", mv.name, _out_item(out, mv.name, boundary.outs),
                    None if biased else readable(mv.src), readable(replicate_partials(mv.src)))
        return out

    boundary.compute = compute
    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post, with_kwargs=True)

