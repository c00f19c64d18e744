"""The exchanges of each context-parallel mode around the model's kernel: Ulysses, all-gather and their hybrid.

Each function takes one attention call of this rank's tokens (``q``
``[B, H, s, D]``, ``k``/``v`` ``[B, H_kv, s, D]``) and returns its output
``[B, s, H, D]``; ``mask`` is either the layer's dense mask
(:func:`~tplower.context.attention._mask`) or the batch's runs
(:mod:`tplower.context.runs`, a tuple), with which the kernel runs once per
run with no mask (:func:`~tplower.context.kernels.attend_runs`).

* :func:`ulysses`: ``S(seq) -> S(heads)`` over the axis (an ``all_to_all``),
  the kernel on ``H/n`` heads of the whole sequence, the output back;
* :func:`allgather`: keys and values ``S(seq) -> R`` (an ``all_gather``, a
  ``reduce_scatter`` in backward), the local queries attend to them; a layer
  with a sliding window on the batch's runs receives only the keys its
  queries' windows reach instead (one ``all_to_all`` of keys and values, the
  same in backward: :mod:`tplower.context.window`);
* :func:`hybrid`: over two axes that split the cp axis (``G x U``: rank
  ``g * U + u``), Ulysses inside a group of ``U`` ranks (each holds ``H/U``
  heads of the group's tokens), then the keys and values gathered across the
  ``G`` groups (under a sliding window, those the group's windows reach): the
  group's queries attend to the whole sequence with ``H/U`` heads. It splits
  the heads only ``U`` ways, so it runs where the heads do not divide over the
  whole axis, and with grouped key/value heads it repeats them for ``U`` ranks
  rather than ``n``.

Pieces of uneven length are padded to the longest before an exchange and the
padding dropped after it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..core.lower.redistribute import redistribute_local
from ..core.support.errors import TPLowerError
from .kernels import Kernel, attend_runs
from .runs import clip
from .sequence import ContextSplit
from .window import WindowKeys, axis_group_ranks, exchange_window_keys, holder_keys, plan_window_keys

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class ContextAttention(Protocol):
    """What an exchange reads of a module's :class:`tplower.context.attention.ContextAttention`."""

    @property
    def mesh(self) -> DeviceMesh: ...
    @property
    def axis(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def kernel(self) -> Callable[..., Any]: ...
    @property
    def per_head(self) -> tuple[str, ...]: ...
    @property
    def sub_mesh(self) -> DeviceMesh | None: ...

__all__ = ["allgather", "hybrid", "hybrid_axes", "hybrid_degree", "ulysses"]


def hybrid_axes(axis: str) -> tuple[str, str]:
    """The names of the two axes the hybrid mode splits ``axis`` into: across the groups, inside a group."""
    return f"{axis}_allgather", f"{axis}_ulysses"


def hybrid_degree(n: int, heads: list[tuple[int, int]]) -> int:
    """The hybrid mode's default Ulysses degree over ``n`` ranks: the largest divisor of ``n`` that divides every
    layer's ``(query, key/value)`` heads per rank in ``heads`` (no key/value head repeated), else the largest that
    divides the query heads (1 at worst: the all-gather mode's exchanges)."""
    fits = [d for d in range(n, 0, -1) if n % d == 0 and all(h % d == 0 for h, _ in heads)]
    return next((d for d in fits if all(kv % d == 0 for _, kv in heads)), fits[0])


def _pad_seq(t: torch.Tensor, dim: int, width: int) -> torch.Tensor:
    """``t`` with zeros after its last entry of ``dim`` up to ``width`` entries (``t`` itself when it has them).

    Under ``torch.compile`` it always pads (by nothing for even pieces): a branch on whether the pieces are even,
    or a zeros tensor of the padding's size, would guard on the length (a second graph for uneven pieces, a third
    where the padding is one entry, which the trace specializes).
    """
    extra = width - t.shape[dim]
    if not torch.compiler.is_compiling() and not extra:
        return t
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - dim - 1) + (0, extra))


def _first(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """The first ``n`` entries of ``dim`` of ``t``: a view; under ``torch.compile`` an ``index_select`` (a view's
    size would guard on whether ``n`` is all of ``dim``: a second graph once the pieces are uneven)."""
    if not torch.compiler.is_compiling():
        return t.narrow(dim, 0, n)
    return t.index_select(dim, torch.arange(n, device=t.device))


class _KernelView:
    """The attention module as the kernel reads it after a heads exchange: the module itself, but for ``overrides``.

    The kernel reads a few attributes of the module (``num_key_value_groups``,
    ``training``, ``is_causal``, per-head parameters such as ``sinks``); after
    the exchange it holds ``1/n`` of the heads, so the per-head ones must be
    this rank's slice and the group size that of the heads it holds.
    """

    def __init__(self, module: Any, overrides: dict[str, Any]) -> None:
        self._module = module
        self._overrides = overrides

    def __getattr__(self, name: str) -> Any:
        if name in self._overrides:
            return self._overrides[name]
        return getattr(self._module, name)


def _heads(ca: ContextAttention, module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, n: int,
           axis: str, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any], torch.Tensor, torch.Tensor]:
    """Before a heads exchange over ``n`` ranks: the module and keywords the kernel gets for this rank's heads
    ``[rank*H/n, (rank+1)*H/n)``, and ``k``/``v`` with each key/value head repeated ``n/gcd(H_kv, n)`` times
    where ``H_kv`` does not divide over ``n`` (every rank then gets whole groups)."""
    h_q, h_kv = q.shape[1], k.shape[1]
    if h_q % n or h_q % h_kv:
        raise TPLowerError(f"{type(module).__name__}: context_mode={ca.mode!r} splits the heads over the {n} ranks "
                           f"of axis {axis!r}, but this rank holds {h_q} query heads and {h_kv} key/value heads "
                           f"({h_q} does not divide by {n}); use context_mode='allgather' (it splits no heads)")
    rep = 1 if h_kv % n == 0 else n // math.gcd(h_kv, n)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    overrides: dict[str, Any] = {}
    if rep > 1 and hasattr(module, "num_key_value_groups"):
        overrides["num_key_value_groups"] = h_q // (h_kv * rep)
    per = h_q // n
    swap: dict[int, torch.Tensor] = {}
    for name in ca.per_head:
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == h_q:
            overrides[name] = swap[id(t)] = t.narrow(0, rank * per, per)
    if not overrides:
        return module, kwargs, k, v
    kw = {key: swap.get(id(val), val) if isinstance(val, torch.Tensor) else val for key, val in kwargs.items()}
    return _KernelView(module, overrides), kw, k, v


def kernel_call(ca: ContextAttention, module: Any, kwargs: dict[str, Any]) -> Kernel:
    """The model's kernel with no mask: ``is_causal`` as the module has it, or ``False`` for a full run; or with an
    additive ``mask`` (a sliding window's band, :func:`~tplower.context.kernels.attend_runs`), ``is_causal`` false."""

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        kw = kwargs if causal and mask is None else {**kwargs, "is_causal": False}
        out: torch.Tensor = ca.kernel(module, q, k, v, mask, **kw)[0]
        return out
    return call


def _to_heads(t: torch.Tensor, mesh: DeviceMesh, axis: str, n: int, width: int) -> torch.Tensor:
    """``[B, h, s, D]`` ``S(2) -> S(1)`` over ``axis``: ``[B, h/n, n * width, D]``, the ranks' padded pieces in rank
    order.

    The exchange runs on ``[B, h, 1, width, D]`` (``S(2) -> S(1)``, ``[B, h/n, n, width, D]`` after it), so the
    dims it shards (the heads, the ranks) have sizes fixed by the model and the mesh: under ``torch.compile`` the
    sequence length (``width``) is an unsharded dim the program is not keyed on and stays dynamic
    (:mod:`tplower.core.lower.redistribute`).
    """
    padded = _pad_seq(t, 2, width).unsqueeze(2)
    return redistribute_local(padded, mesh, {axis: "S(2)"}, {axis: "S(1)"}).flatten(2, 3)


def _to_seq(out: torch.Tensor, mesh: DeviceMesh, axis: str, n: int, width: int) -> torch.Tensor:
    """The inverse: ``[B, n * width, h/n, D]`` ``S(3) -> S(1)`` over ``axis`` on ``[B, n, width, h/n, D]`` (the
    ranks' pieces a dim of their own, as :func:`_to_heads`): ``[B, width, h, D]``."""
    pieces = out.unflatten(1, (n, width))
    return redistribute_local(pieces, mesh, {axis: "S(3)"}, {axis: "S(1)"}).squeeze(1)


def _gather(t: torch.Tensor, mesh: DeviceMesh, axis: str, n: int, order: torch.Tensor) -> torch.Tensor:
    """``[B, h, m, D]`` ``S(2) -> R`` over ``axis`` (gradient reduce-scattered back) on ``[B, h, 1, m, D]`` (the
    ranks a dim of their own, as :func:`_to_heads`), then ``index_select(2, order)``: every token in its own
    order."""
    whole = redistribute_local(t.unsqueeze(2), mesh, {axis: "S(2)"}, {axis: "R"}, grad={axis: "P(sum)"})
    return whole.flatten(2, 3).index_select(2, order.to(t.device))


def _windowed(split: ContextSplit, runs: Any, mode: str, holders: int, me: int,
              group_ranks: Callable[[], tuple[int, ...]]) -> WindowKeys | None:
    """The exchange of the keys that the windows of holder ``me`` of ``holders`` reach (:mod:`tplower.context.window`;
    holder ``h``: ranks ``h * u .. h * u + u - 1`` of ``u = n / holders``, the hybrid mode's holders their pieces
    padded to the longest), made once a batch; ``None`` for runs with no window, under ``torch.compile``, or where
    :func:`~tplower.context.window.plan_window_keys` finds the windows reach every key."""
    window = runs[0].window if isinstance(runs, tuple) and runs else None
    if window is None or torch.compiler.is_compiling():
        return None
    key = ("window_keys", mode, window, holders)
    if key not in split.cache:
        slots, needs = holder_keys(split.layout, window, holders, padded=mode == "hybrid")
        split.cache[key] = plan_window_keys(slots, needs, me, split.layout.length, group_ranks())
    found: WindowKeys | None = split.cache[key]
    return found


def _attend_pieces(kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: tuple[Any, ...],
                   split: ContextSplit, ranks: range, width: int | None, scale: Any,
                   keys: WindowKeys | None = None) -> torch.Tensor:
    """The output ``[B, len(ranks) * width, H, D]`` of queries holding ranks ``ranks``' tokens, each rank's padded to
    ``width`` (``None``: one rank's ``[B, s, H, D]``, unpadded): the runs of each piece, zeros in the padding; ``q``,
    ``k`` and ``v`` (every token, in its own order; with ``keys``, the keys the windows reach, as
    :attr:`~tplower.context.window.WindowKeys.segments` lays them) stay in the graph even where no query sees a
    key (a group of ranks that holds no token, or only fully masked ones)."""
    layout, parts, used = split.layout, [], False
    for i, r in enumerate(ranks):
        at, own = i * (width or 0), []
        for start, length in layout.pieces(r):
            mine = clip(runs, start, start + length)
            used = used or bool(mine)
            own.append(attend_runs(kernel, q, k, v, mine, start, start + length, at, scale,
                                   split.cache.setdefault("bands", {}),
                                   keys.key_at(start) if keys is not None and length else 0))
            at += length
        piece = own[0] if len(own) == 1 else torch.cat(own, dim=1)
        parts.append(piece if width is None else _pad_seq(piece, 1, width))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    if not used:  # every query here fully masked (or none held): keep q, k and v in the graph, so their gradients'
        # exchanges and the projections' gradient reductions run on this rank as on the others (exact zeros)
        out = out + 0 * sum(t.narrow(2, 0, 1).sum() for t in (q, k, v))
    return out


def ulysses(ca: ContextAttention, split: ContextSplit, module: Any, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, mask: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    """Ulysses over the whole axis (module docstring)."""
    layout, n, axis = split.layout, split.layout.size, ca.axis
    width, local = max(layout.lengths), q.shape[2]
    view, kw, k, v = _heads(ca, module, q, k, v, split.rank, n, axis, kwargs)
    order = layout.padded_order.to(q.device)
    qh, kh, vh = (_to_heads(t, ca.mesh, axis, n, width).index_select(2, order) for t in (q, k, v))
    if isinstance(mask, tuple):  # the runs: the kernel once per run, no mask
        out = attend_runs(kernel_call(ca, view, kw), qh, kh, vh, clip(mask, 0, layout.length), 0, layout.length, 0,
                          kw.get("scaling"), split.cache.setdefault("bands", {}))
    else:
        out = ca.kernel(view, qh, kh, vh, mask, **kw)[0]  # [B, S, H/n, D]
    if torch.compiler.is_compiling() or width * n > layout.length:  # a zero row for the padding slots (index_select
        # saves no input; index_copy did); compiled, always (unused for even pieces): no guard on whether they are
        out = torch.cat([out, out.new_zeros((out.shape[0], 1, *out.shape[2:]))], dim=1)
    padded = out.index_select(1, layout.padded_source.to(out.device))
    return _first(_to_seq(padded, ca.mesh, axis, n, width), 1, local)


def allgather(ca: ContextAttention, split: ContextSplit, module: Any, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, mask: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    """All-gather over the whole axis (module docstring)."""
    layout, n, axis = split.layout, split.layout.size, ca.axis
    keys = _windowed(split, mask, "allgather", n, split.rank, lambda: axis_group_ranks(ca.mesh, axis))
    if keys is not None:  # a window: only the keys this rank's queries reach
        k, v = exchange_window_keys(k, v, keys, ca.mesh.get_group(axis))
        return _attend_pieces(kernel_call(ca, module, kwargs), q, k, v, mask, split,
                              range(split.rank, split.rank + 1), None, kwargs.get("scaling"), keys)
    width = max(layout.lengths)
    k, v = (_gather(_pad_seq(t, 2, width), ca.mesh, axis, n, layout.padded_order) for t in (k, v))
    if not isinstance(mask, tuple):  # the rows of the local queries' mask
        out: torch.Tensor = ca.kernel(module, q, k, v, mask, **kwargs)[0]
        return out
    kernel = kernel_call(ca, module, kwargs)
    if not layout.local_length(split.rank):  # a placeholder query: it sees every key (a finite row, then dropped)
        return kernel(q, k, v, False)
    return _attend_pieces(kernel, q, k, v, mask, split, range(split.rank, split.rank + 1), None,
                          kwargs.get("scaling"))


def hybrid(ca: ContextAttention, split: ContextSplit, module: Any, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, mask: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    """Ulysses inside a group, all-gather across the groups (module docstring); ``mask``: the batch's runs."""
    assert ca.sub_mesh is not None and isinstance(mask, tuple), "the hybrid mode runs on runs, with its two axes"
    across, inside = hybrid_axes(ca.axis)
    names = tuple(ca.sub_mesh.mesh_dim_names or ())
    layout, g, u = split.layout, ca.sub_mesh.size(names.index(across)), ca.sub_mesh.size(names.index(inside))
    width, local = max(layout.lengths), q.shape[2]
    group = split.rank // u
    view, kw, k, v = _heads(ca, module, q, k, v, split.rank % u, u, inside, kwargs)
    qh, kh, vh = (_to_heads(t, ca.sub_mesh, inside, u, width) for t in (q, k, v))  # the group's padded pieces
    sub = ca.sub_mesh
    keys = _windowed(split, mask, "hybrid", g, group, lambda: axis_group_ranks(sub, across)) if g > 1 else None
    if keys is not None:  # a window: only the keys the group's queries reach
        kh, vh = exchange_window_keys(kh, vh, keys, sub.get_group(across))
    else:
        kh, vh = (_gather(t, sub, across, g, layout.padded_order) for t in (kh, vh))
    out = _attend_pieces(kernel_call(ca, view, kw), qh, kh, vh, mask, split, range(group * u, group * u + u), width,
                         kw.get("scaling"), keys)
    return _first(_to_seq(out, ca.sub_mesh, inside, u, width), 1, local)
