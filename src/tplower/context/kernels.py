"""The model's attention kernel run per :class:`~tplower.context.runs.Run`: no mask, ``O(S)`` memory with ``sdpa``.

:func:`attend_runs` computes the attention output of a range of queries
from the runs that cover it, one kernel call per run (rows with the same run
together), and lays the pieces end to end; a query no run covers sees no key
and gets zeros (``sdpa``'s answer for a fully masked row, as one process's).

Three kinds of call:

* a causal run whose queries start where its keys start: the model's own
  kernel with no mask (``sdpa`` then runs ``is_causal``, its flash path);
* a full run: the model's own kernel with no mask and ``is_causal=False``;
* a causal run whose queries start after its first key (the all-gather
  mode's query pieces, ``[start, stop)`` of a document that began at
  ``key_start``): each query sees the whole prefix ``[key_start, start)`` and
  the diagonal block ``[start, stop)`` causally, which no single ``is_causal``
  call aligns (``sdpa``'s causal mask is aligned to the top left). Two calls
  of ``sdpa``'s CPU flash kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``,
  the op ``F.scaled_dot_product_attention`` runs on CPU without a mask), the
  prefix without a mask and the diagonal block causal, are combined by their
  log-sum-exp (``F.scaled_dot_product_attention`` does not return it); their
  backward runs the kernel's own backward per block with the combined output
  and log-sum-exp, as ring attention does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .runs import Run

__all__ = ["OffsetCausal", "attend_runs", "offset_causal"]

#: ``(q, k, v, causal, mask) -> [B', L, H, D]``: the model's kernel, with no mask (``None``) or an additive one
#: ``[1, 1, L, K]`` (0 where a key is seen, ``-inf`` elsewhere; ``causal`` is then false)
Kernel = Callable[..., torch.Tensor]

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class OffsetCausal(torch.autograd.Function):
    """Queries ``[B, H, L, D]`` after a prefix of ``P`` keys: the prefix whole, then ``L`` keys causally.

    Forward: ``sdpa``'s CPU flash kernel on the prefix (no mask) and on the
    diagonal block (``is_causal``), each with its log-sum-exp ``l1``, ``l2``;
    the output is ``o1 * exp(l1 - l) + o2 * exp(l2 - l)`` with
    ``l = logaddexp(l1, l2)``. Backward: the kernel's backward on each block
    with the combined output and ``l`` (the rows' softmax over both blocks),
    the query gradients summed. Key/value heads may be fewer than query heads
    (the kernel groups them).
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k_diag: torch.Tensor,
                v_diag: torch.Tensor, scale: float | None) -> torch.Tensor:
        o1, l1 = _FLASH(q, k_prefix, v_prefix, 0.0, False, scale=scale)
        o2, l2 = _FLASH(q, k_diag, v_diag, 0.0, True, scale=scale)
        lse = torch.logaddexp(l1, l2)
        out: torch.Tensor = (o1 * (l1 - lse).exp().unsqueeze(-1) + o2 * (l2 - lse).exp().unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k_prefix, v_prefix, k_diag, v_diag, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k_prefix, v_prefix, k_diag, v_diag, out, lse = ctx.saved_tensors
        g = grads[0].contiguous()
        dq1, dk1, dv1 = _FLASH_BACKWARD(g, q, k_prefix, v_prefix, out, lse, 0.0, False, scale=ctx.scale)
        dq2, dk2, dv2 = _FLASH_BACKWARD(g, q, k_diag, v_diag, out, lse, 0.0, True, scale=ctx.scale)
        return dq1 + dq2, dk1, dv1, dk2, dv2, None


def offset_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                  scale: float | None) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, L, D]`` over ``k``/``v`` ``[B, H_kv, prefix + L, D]`` aligned to the bottom right.

    The query ``i`` sees the keys ``0 .. prefix + i``. Returns ``[B, L, H, D]`` (the layout transformers' kernels
    return). CPU tensors (the kernel is ``sdpa``'s CPU flash kernel).
    """
    diag = k.shape[2] - prefix
    out: torch.Tensor = OffsetCausal.apply(q, k.narrow(2, 0, prefix), v.narrow(2, 0, prefix),
                                           k.narrow(2, prefix, diag), v.narrow(2, prefix, diag), scale)
    return out.transpose(1, 2)


def _rows(t: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    if rows == tuple(range(t.shape[0])):
        return t
    if rows == tuple(range(rows[0], rows[-1] + 1)):
        return t.narrow(0, rows[0], len(rows))
    return t.index_select(0, torch.tensor(rows, device=t.device))


def _by_start(parts: list[tuple[int, int, torch.Tensor]]) -> list[tuple[int, int, torch.Tensor]]:
    """``parts`` ordered by their start, by insertion (``torch.compile`` traces comparisons of the starts, which
    may be symbolic sizes, but not ``sorted`` with them as keys)."""
    out: list[tuple[int, int, torch.Tensor]] = []
    for p in parts:
        i = len(out)
        while i > 0 and out[i - 1][0] > p[0]:
            i -= 1
        out.insert(i, p)
    return out


def _assemble(batch: int, lo: int, hi: int, pieces: list[tuple[Run, torch.Tensor]], like: torch.Tensor,
              heads: int, dim: int) -> torch.Tensor:
    """``[batch, hi - lo, heads, dim]``: each run's output at its queries, zeros where no run is."""

    def row(parts: list[tuple[int, int, torch.Tensor]], width: int) -> torch.Tensor:
        seq, at = [], lo
        for start, stop, t in _by_start(parts):
            if start > at:
                seq.append(like.new_zeros((width, start - at, heads, dim)))
            seq.append(t)
            at = stop
        if hi > at:
            seq.append(like.new_zeros((width, hi - at, heads, dim)))
        return seq[0] if len(seq) == 1 else torch.cat(seq, dim=1)

    every = tuple(range(batch))
    if all(run.rows == every for run, _ in pieces):
        return row([(run.start, run.stop, t) for run, t in pieces], batch)
    rows = [row([(run.start, run.stop, t.narrow(0, run.rows.index(b), 1)) for run, t in pieces if b in run.rows], 1)
            for b in range(batch)]
    return torch.cat(rows, dim=0)


def window_blocks(run: Run) -> list[tuple[int, int, int, int]] | None:
    """The blocks ``(a, b, kl, kh)`` a run with a sliding window is computed in: queries ``[a, b)`` (at most
    ``window`` of them) against keys ``[kl, kh)``, every key any of them sees and no other (at most
    ``2 * window - 1``); ``None`` where the window hides no key from any query of the run (it runs whole).

    A causal run's query ``q`` sees ``[max(key_start, q - window + 1), q]``; a full run's (padding after a span)
    sees ``[max(key_start, q - window + 1), key_stop)``, none from ``key_stop + window - 1`` on (those queries are
    left out: zeros, a fully masked row's answer).
    """
    w = run.window
    if w is None or run.stop - w <= run.key_start:
        return None
    stop = run.stop if run.causal else min(run.stop, run.key_stop + w - 1)
    blocks = []
    for a in range(run.start, stop, w):
        b = min(a + w, stop)
        blocks.append((a, b, max(run.key_start, a - w + 1), b if run.causal else run.key_stop))
    return blocks


def _band(a: int, b: int, kl: int, kh: int, causal: bool, window: int, like: torch.Tensor,
          made: dict[Any, torch.Tensor]) -> torch.Tensor:
    """The additive mask ``[1, 1, b - a, kh - kl]`` of a window block: 0 where query ``q`` sees key ``j``
    (``q - window < j``, and ``j <= q`` when causal), ``-inf`` elsewhere; blocks of one shape share one."""
    key = (b - a, kh - kl, a - kl, int(causal), window, like.dtype, like.device)
    if key not in made:
        rows = torch.arange(a, b, device=like.device).unsqueeze(1)
        cols = torch.arange(kl, kh, device=like.device).unsqueeze(0)
        seen = cols > rows - window
        if causal:
            seen = seen & (cols <= rows)
        made[key] = torch.zeros(seen.shape, dtype=like.dtype, device=like.device).masked_fill_(
            seen.logical_not(), float("-inf")).view(1, 1, *seen.shape)
    return made[key]


def attend_runs(kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list[Run], lo: int,
                hi: int, q_at: int, scale: float | None, bands: dict[Any, torch.Tensor] | None = None,
                k_at: int = 0) -> torch.Tensor:
    """The attention output ``[B, hi - lo, H, D]`` of the queries at global positions ``[lo, hi)``.

    A run with a sliding window (:attr:`Run.window`) is computed in blocks of ``window`` queries, each against
    the ``2 * window - 1`` keys at most that its queries see, with an additive band mask
    (:func:`window_blocks`): ``O(S * window)`` time and memory where the whole mask is ``O(S^2)``.

    Args:
        kernel: the model's kernel with no mask, ``causal`` or full, or with a band mask (:data:`Kernel`).
        q: ``[B, H, *, D]`` holding those queries from index ``q_at`` on.
        k, v: ``[B, H_kv, *, D]`` the keys the runs see, in global order from global position ``k_at`` on (every
            key: ``k_at=0``; the all-gather mode under a window holds only the keys its pieces reach,
            :mod:`tplower.context.window`).
        runs: the runs of the batch clipped to ``[lo, hi)`` (:func:`~tplower.context.runs.clip`).
        scale: the softmax scale the model passes (``None``: ``1/sqrt(D)``), for the offset blocks.
        bands: the window blocks' masks made so far (one per block shape), shared by the calls of a batch (its
            layers: one mask a shape for the whole model, saved once for backward); ``None``: this call's own.
        k_at: the global position of ``k``'s and ``v``'s first key.
    """
    batch, heads, dim = q.shape[0], q.shape[1], v.shape[3]
    pieces = []
    bands = {} if bands is None else bands
    for run in runs:
        blocks = window_blocks(run)
        if blocks is not None:
            assert run.window is not None
            for a, b, kl, kh in blocks:
                qs = _rows(q, run.rows).narrow(2, q_at + a - lo, b - a)
                ks, vs = (_rows(t, run.rows).narrow(2, kl - k_at, kh - kl) for t in (k, v))
                mask = _band(a, b, kl, kh, run.causal, run.window, q, bands)
                pieces.append((Run(run.rows, a, b, kl, kh, run.causal, run.window), kernel(qs, ks, vs, False, mask)))
            continue
        qs = _rows(q, run.rows).narrow(2, q_at + run.start - lo, run.stop - run.start)
        keys = (_rows(k, run.rows).narrow(2, run.key_start - k_at, run.key_stop - run.key_start),
                _rows(v, run.rows).narrow(2, run.key_start - k_at, run.key_stop - run.key_start))
        if run.causal and run.start > run.key_start:
            out = offset_causal(qs, *keys, run.start - run.key_start, scale)
        else:
            out = kernel(qs, *keys, run.causal)
        pieces.append((run, out))
    if not pieces:
        return q.new_zeros((batch, hi - lo, heads, dim))
    return _assemble(batch, lo, hi, pieces, q, heads, dim)
