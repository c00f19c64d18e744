"""The runs of a batch (:mod:`tplower.context.runs`) and the offset causal kernel (:mod:`tplower.context.kernels`)
against transformers' own masks and ``F.scaled_dot_product_attention`` with an explicit mask, in one process.

A run says which keys its queries see; laid out as a ``[B, S, S]`` boolean table it must be the mask
``create_causal_mask`` builds for ``sdpa`` from the same ``attention_mask`` and ``position_ids`` (padding on either
side, packed documents, a plain batch). :func:`attend_runs` must give what ``sdpa`` gives with that mask, outputs
and gradients, for every query range a rank of either mode holds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tplower.context.kernels import Kernel, attend_runs, offset_causal
from tplower.context.runs import Run, batch_runs, clip

S = 23


def _positions(cuts: list[list[int]]) -> torch.Tensor:
    rows = []
    for row in cuts:
        p = torch.arange(S)
        for c in row:
            p[c:] = torch.arange(S - c)
        rows.append(p)
    return torch.stack(rows)


def _padding(spans: list[tuple[int, int]]) -> torch.Tensor:
    m = torch.zeros(len(spans), S, dtype=torch.long)
    for b, (lo, hi) in enumerate(spans):
        m[b, lo:hi] = 1
    return m


BATCHES = {
    "plain": (torch.arange(S).expand(2, S), None),
    "packed": (_positions([[5, 11], [1, 2, 3, 20]]), None),  # documents of 1 token too
    "left_padded": (torch.arange(S).expand(3, S), _padding([(0, S), (4, S), (S - 1, S)])),
    "right_padded": (torch.arange(S).expand(2, S), _padding([(0, 9), (0, S)])),
    "both_sides": (torch.arange(S).expand(2, S), _padding([(3, 17), (0, 0)])),  # and a row of padding only
}


def _table(runs: tuple[Run, ...], batch: int) -> torch.Tensor:
    t = torch.zeros(batch, S, S, dtype=torch.bool)
    for r in runs:
        for b in r.rows:
            for q in range(r.start, r.stop):
                t[b, q, r.key_start:(q + 1 if r.causal else r.key_stop)] = True
    return t


def _transformers_mask(positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask

    config = LlamaConfig()
    config._attn_implementation = "sdpa"
    b = positions.shape[0]
    m = create_causal_mask(config=config, inputs_embeds=torch.empty(b, S, 1), attention_mask=mask, cache=None,
                           position_ids=positions, allow_is_causal_skip=False)
    assert isinstance(m, torch.Tensor)
    return m[:, 0]


@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_runs_are_transformers_mask(kind: str) -> None:
    positions, mask = BATCHES[kind]
    runs = batch_runs(positions, mask)
    assert runs is not None
    assert torch.equal(_table(runs, positions.shape[0]), _transformers_mask(positions, mask))


def test_rows_with_the_same_runs_share_them() -> None:
    runs = batch_runs(torch.arange(S).expand(4, S), None)
    assert runs == (Run((0, 1, 2, 3), 0, S, 0, S, True),)


def test_a_mask_with_holes_has_no_runs() -> None:
    mask = _padding([(0, S)])
    mask[0, 7] = 0
    assert batch_runs(torch.arange(S).expand(1, S), mask) is None


def _sdpa(scale: float) -> Kernel:
    """``sdpa`` with no mask, as transformers' kernel returns it (``[B, L, H, D]``)."""

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True).transpose(1, 2)
    return call


#: query ranges a rank holds: Ulysses the whole sequence; all-gather head-tail pieces of cp=2 and cp=4
RANGES = [(0, S), (6, 12), (12, 18), (17, S), (0, 3), (20, 21)]


@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_attend_runs_is_sdpa_with_transformers_mask(kind: str) -> None:
    positions, mask = BATCHES[kind]
    b, h, h_kv, d = positions.shape[0], 4, 2, 8
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, n, S, d, generator=g, dtype=torch.float64).requires_grad_() for n in (h, h_kv, h_kv))
    dense = _transformers_mask(positions, mask).unsqueeze(1)
    scale = 0.3
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale, enable_gqa=True).transpose(1, 2)
    runs = batch_runs(positions, mask)
    assert runs is not None
    for lo, hi in RANGES:
        local = q.narrow(2, lo, hi - lo)  # a rank's queries from index 0 of its own tensor
        got = attend_runs(_sdpa(scale), local, k, v, clip(runs, lo, hi), lo, hi, 0, scale)
        torch.testing.assert_close(got, want[:, lo:hi], atol=1e-6, rtol=1e-6)
        gout = torch.randn(got.shape, generator=g, dtype=torch.float64)
        theirs = torch.autograd.grad(want[:, lo:hi], (q, k, v), gout, retain_graph=True)
        if not got.requires_grad:  # no query of the range sees a key: zeros, and no gradient
            assert all(not w.any() for w in theirs)
            continue
        mine = torch.autograd.grad(got, (q, k, v), gout, allow_unused=True)
        for a, w in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a if a is not None else torch.zeros_like(w), w, atol=1e-6, rtol=1e-6)


def test_offset_causal_is_the_bottom_right_causal_mask_in_float32() -> None:
    g = torch.Generator().manual_seed(5)
    prefix, length = 37, 19
    q = torch.randn(2, 4, length, 16, generator=g).requires_grad_()
    k, v = (torch.randn(2, 2, prefix + length, 16, generator=g).requires_grad_() for _ in range(2))
    mask = torch.ones(length, prefix + length, dtype=torch.bool).tril(prefix)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    got = offset_causal(q, k, v, prefix, None)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    gout = torch.randn(got.shape, generator=g)
    for a, w in zip(torch.autograd.grad(got, (q, k, v), gout), torch.autograd.grad(want, (q, k, v), gout),
                    strict=True):
        torch.testing.assert_close(a, w, atol=1e-5, rtol=1e-5)
