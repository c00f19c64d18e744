"""What a lowered transition traces to under torch.compile: the collective and nothing else.

Two gloo ranks compile ``redistribute_local`` for the even, contiguous common
case with a backend that keeps AOT autograd's forward and backward graphs
(:class:`tplower.bench.graphs.GraphCapture`), run forward and backward, and
count the graphs' operators. The ideal, which DTensor's traced
``redistribute`` also reaches: one functional collective and its
``wait_tensor`` per communicating direction, no copy (``clone``, ``copy``,
``new_empty`` + ``copy_``, pads) around it, nothing else. The values are
checked against the global tensor each rank builds from the same seeds.

gloo's small all_reduces run as one ``all_to_all`` (:mod:`tplower.core.lower.exchange`): the graphs above are
counted with that turned off (``TPLOWER_GLOO_EXCHANGE_BYTES=0``), and the exchange's own graph is counted
beside them.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import tplower
from tplower.bench.graphs import GraphCapture, copies_around_collectives, op_counts
from tplower.core.lower.backends import EXCHANGE_ENV
from tplower.testing import run_processes

# (src, dst, grad, local shape): even shards of a [4, 6] global tensor on 2 ranks.
EVEN = (
    ("S(0)", "R", None, (2, 6)),
    ("S(0)", "R", "P(sum)", (2, 6)),
    ("P(sum)", "R", None, (4, 6)),
    ("P(sum)", "R", "P(sum)", (4, 6)),
    ("P(sum)", "S(0)", None, (4, 6)),
)
#: S(1) -> R: one interleaving copy after the gather; the local piece of the gradient is a view.
DIM1 = ("S(1)", "R", None, (4, 3))


def _value(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + rank))


def _expected(src: str, dst: str, world: int, rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The output on ``rank``, from every rank's input made again here (no collective)."""
    pieces = [_value(r, shape) for r in range(world)]
    if src == "S(0)":
        full = torch.cat(pieces, 0)
    elif src == "S(1)":
        full = torch.cat(pieces, 1)
    else:  # P(sum)
        full = torch.stack(pieces).sum(0)
    return full if dst == "R" else full.chunk(world, 0)[rank]


def _run(cases: tuple[tuple[str, str, str | None, tuple[int, ...]], ...], mesh: Any, rank: int,
         world: int) -> dict[str, Any]:
    """Compile the transitions of ``cases`` as one function, check values and gradients, count its graphs."""
    cap = GraphCapture()

    def f(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(tplower.redistribute_local(x, mesh, src, dst, grad=grad)
                     for x, (src, dst, grad, _) in zip(xs, cases, strict=True))

    xs = [_value(rank, shape).requires_grad_() for *_, shape in cases]
    ys = torch.compile(f, backend=cap, fullgraph=True)(*xs)
    for y, (src, dst, _, shape) in zip(ys, cases, strict=True):
        torch.testing.assert_close(y.detach(), _expected(src, dst, world, rank, shape), atol=1e-6, rtol=1e-6)
    seeds = [torch.randn(y.shape, generator=torch.Generator().manual_seed(7)) for y in ys]
    torch.autograd.backward(ys, seeds)
    xe = [x.detach().clone().requires_grad_() for x in xs]
    torch.autograd.backward(f(*xe), seeds)
    for x, e in zip(xs, xe, strict=True):
        torch.testing.assert_close(x.grad, e.grad)
    return {"frames": cap.frames, "graphs": (len(cap.forward), len(cap.backward)),
            "forward": op_counts(cap.forward[0]), "backward": op_counts(cap.backward[0]),
            "forward_near": copies_around_collectives(cap.forward[0]),
            "backward_near": copies_around_collectives(cap.backward[0])}


def _body(rank: int, world: int, exchange: str | None) -> dict[str, Any]:
    if exchange is not None:
        os.environ[EXCHANGE_ENV] = exchange
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return _run((*EVEN, DIM1) if exchange == "0" else SMALL, mesh, rank, world)


#: P(sum) -> R with an R and a P gradient: each all_reduce of 96 bytes a rank runs as the exchange.
SMALL = (("P(sum)", "R", None, (4, 6)), ("P(sum)", "R", "P(sum)", (4, 6)))


@pytest.fixture(scope="module")
def graphs() -> dict[str, Any]:
    res: list[dict[str, Any]] = run_processes(2, _body, "0", timeout=300)
    assert res[0] == res[1]
    return res[0]


def test_a_small_all_reduce_on_gloo_traces_to_one_all_to_all() -> None:
    """By default (no ``TPLOWER_GLOO_EXCHANGE_BYTES``): each all_reduce is one ``all_to_all_single`` and its wait,
    beside the local work (the copies out, the sum of the two that came back), forward and backward; the
    values and gradients are checked in ``_run`` against the global tensor and eager."""
    for g in run_processes(2, _body, None, timeout=300):
        assert g["frames"] == 1 and g["graphs"] == (1, 1), g
        for side, want in (("forward", 2), ("backward", 1)):
            names = [name.rpartition(".")[2] for name, _ in g[f"{side}_near"]]
            assert names == ["all_to_all_single"] * want, (side, names)
            assert g[side]["collective"] == g[side]["wait"] == want, (side, g[side])


def test_even_transitions_trace_to_the_collectives_alone(graphs: dict[str, Any]) -> None:
    g = graphs
    assert g["frames"] == 1 and g["graphs"] == (1, 1), g
    # forward: all_gather, all_gather, all_reduce, all_reduce, reduce_scatter (then S(1)'s all_gather);
    # backward (DESIGN's table): a view (the local piece of an R gradient), reduce_scatter, nothing, all_reduce,
    # all_gather (then S(1)'s local piece, a view)
    for side, collectives in (("forward", 5), ("backward", 3)):
        near = g[f"{side}_near"]
        assert [n for _, n in near[:collectives]] == [0] * collectives, (side, near)
        assert g[side]["collective"] == g[side]["wait"] == len(near), (side, g[side])
        assert g[side]["other"] == 0, (side, g[side])
    names = [name.rpartition(".")[2] for name, _ in g["forward_near"]]
    assert names == ["all_gather_into_tensor"] * 2 + ["all_reduce"] * 2 + ["reduce_scatter_tensor"] \
        + ["all_gather_into_tensor"], names


def test_gather_of_a_later_dim_adds_one_interleaving_copy(graphs: dict[str, Any]) -> None:
    # S(1) -> R gathers rank-major blocks of dim 0; putting them side by side along dim 1 is one copy (DTensor:
    # split + cat), the only copy of the forward. Its backward (grad R) is the local piece of dim 1: a view.
    g = graphs
    assert len(g["forward_near"]) == 6 and g["forward_near"][5][1] == 1 and g["forward"]["copy"] == 1, g
    assert len(g["backward_near"]) == 3 and g["backward"]["copy"] == 0, g
