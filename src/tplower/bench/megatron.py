"""Hand-written Megatron-style autograd Functions, one per benchmarked transition (``mappings.py`` style).

Each wraps the raw collective with its gradient convention fixed by hand, as
tensor-parallel codebases write them; :mod:`tplower.bench.cases` times them
beside tplower (``megatron`` in ``--impls``). :data:`MEGATRON` maps
``(src, dst)`` to the Function. :func:`megatronize` shards a model's linear
layers by hand with two more of them: the model phase's hand-written copy
(:mod:`tplower.bench.model`).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

__all__ = ["MEGATRON", "ReduceFromTP", "all_gather_into", "megatronize", "reduce_scatter_into"]

#: the tensor forms of all_gather and reduce_scatter (torch 2.13 names them ``*_single`` and warns on the old names)
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _alloc_gather(x: torch.Tensor, group: ProcessGroup, n: int) -> torch.Tensor:
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    all_gather_into(out, x.contiguous(), group=group)
    return out


def _alloc_scatter(x: torch.Tensor, group: ProcessGroup, n: int) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    reduce_scatter_into(out, x.contiguous(), group=group)
    return out


def _local_chunk(x: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    return x.chunk(n, 0)[rank].contiguous()


class _GatherFromTP(torch.autograd.Function):
    """``S(0) -> R``, grad ``R``: all_gather forward, local chunk backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, n: int, rank: int,  # type: ignore[override]
                shape: tuple[int, ...]) -> torch.Tensor:
        ctx.n, ctx.rank = n, rank
        return _alloc_gather(x, group, n)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return _local_chunk(g, ctx.n, ctx.rank), None, None, None, None


class ReduceFromTP(torch.autograd.Function):
    """``P -> R``, grad ``R``: all_reduce in place forward (as Megatron), identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, n: int, rank: int,  # type: ignore[override]
                shape: tuple[int, ...]) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return g, None, None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """``P -> S(0)``: reduce_scatter forward, all_gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, n: int, rank: int,  # type: ignore[override]
                shape: tuple[int, ...]) -> torch.Tensor:
        ctx.group, ctx.n = group, n
        return _alloc_scatter(x, group, n)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return _alloc_gather(g, ctx.group, ctx.n), None, None, None, None


class _AllToAll(torch.autograd.Function):
    """``S(i) -> S(j)``: one all_to_all_single each way (Megatron's flat exchange, no layout work)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, n: int, rank: int,  # type: ignore[override]
                shape: tuple[int, ...]) -> torch.Tensor:
        ctx.group, ctx.shape = group, x.shape
        out = x.new_empty(shape)
        dist.all_to_all_single(out.view(-1), x.contiguous().view(-1), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        out = g.new_empty(ctx.shape)
        dist.all_to_all_single(out.view(-1), g.contiguous().view(-1), group=ctx.group)
        return out, None, None, None, None


class _ScatterToTP(torch.autograd.Function):
    """``R -> S(0)``: local chunk forward, all_gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, n: int, rank: int,  # type: ignore[override]
                shape: tuple[int, ...]) -> torch.Tensor:
        ctx.group, ctx.n = group, n
        return _local_chunk(x, n, rank)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return _alloc_gather(g, ctx.group, ctx.n), None, None, None, None


MEGATRON: dict[tuple[str, str], type[torch.autograd.Function]] = {
    ("S(0)", "R"): _GatherFromTP, ("P(sum)", "R"): ReduceFromTP, ("P(sum)", "S(0)"): _ReduceScatterToSP,
    ("S(0)", "S(1)"): _AllToAll, ("R", "S(0)"): _ScatterToTP,
}


class _CopyToTP(torch.autograd.Function):
    """``R -> R``, grad ``P``: identity forward, all_reduce backward (Megatron's ``copy_to_tp_region``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceLinearOutput(torch.autograd.Function):
    """``P -> R``, grad ``R``: all_reduce forward, identity backward (Megatron's ``reduce_from_tp_region``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return g, None


def _colwise_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(_CopyToTP.apply(x, self._tp_group), self.weight, self.bias)


def _rowwise_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _ReduceLinearOutput.apply(F.linear(x, self.weight), self._tp_group)
    return out if self.bias is None else out + self.bias


def megatronize(model: nn.Module, plan: dict[str, Any], group: ProcessGroup) -> nn.Module:
    """Shard ``model``'s ``nn.Linear`` modules by ``plan`` (``colwise``/``rowwise``) by hand, in place.

    Column-parallel: rows of the weight and bias, input through ``_CopyToTP``.
    Row-parallel: columns of the weight, output through ``_ReduceLinearOutput``,
    bias added once after the reduction. Head counts are made local.

    Raises:
        ValueError: a plan value other than ``colwise``, ``rowwise`` or a
            ``local_attrs`` entry, or a module that is not ``nn.Linear``.
    """
    from ..run.models import check_plan_modules, localize_heads

    n, rank = dist.get_world_size(group), dist.get_rank(group)
    for key, names in check_plan_modules(model, plan).items():
        style = plan[key]
        if isinstance(style, dict) and set(style) == {"local_attrs"}:
            continue
        if style not in ("colwise", "rowwise"):
            raise ValueError(f"plan[{key!r}]={style!r}: the hand-written version knows colwise and rowwise")
        for name in names:
            mod = model.get_submodule(name)
            if not isinstance(mod, nn.Linear):
                raise ValueError(f"plan[{key!r}] matches {name} ({type(mod).__name__}), not an nn.Linear")
            dim = 0 if style == "colwise" else 1
            with torch.no_grad():
                mod.weight = nn.Parameter(mod.weight.chunk(n, dim)[rank].contiguous())
                if style == "colwise" and mod.bias is not None:
                    mod.bias = nn.Parameter(mod.bias.chunk(n, 0)[rank].contiguous())
            mod._tp_group = group  # type: ignore[assignment]
            fwd = _colwise_forward if style == "colwise" else _rowwise_forward
            mod.forward = types.MethodType(fwd, mod)  # type: ignore[method-assign]
    localize_heads(model, n)
    return model
