"""gloo's small all_reduces as one all_to_all (:mod:`tplower.core.lower.exchange`): the same answers, chosen by size.

References: the native ``dist.all_reduce`` on the same inputs (2 ranks: the same bits), the sum in rank order of
every rank's input rebuilt from its seed (4 ranks), and DTensor's ``redistribute`` forward and backward.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate

import tplower
from tplower.core.lower.backends import EXCHANGE_ENV, backend_caps
from tplower.core.lower.exchange import exchange_reduce
from tplower.core.support.errors import TPLowerError
from tplower.testing import run_processes

OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _value(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """A strided [33, 9] view (every other column of [33, 17]): the exchange must not need contiguous input."""
    return torch.randn(33, 17, generator=torch.Generator().manual_seed(10 + rank)).to(dtype)[:, ::2]


def _against_native(rank: int, world: int) -> list[str]:
    wrong = []
    for dtype in DTYPES:
        for op, red in OPS.items():
            x = _value(rank, dtype)
            before = x.clone()
            got = exchange_reduce(x, op=op, n=world, group=dist.group.WORLD)
            want = x.contiguous()
            dist.all_reduce(want, op=red)
            if not torch.equal(x, before):
                wrong.append(f"{dtype} {op}: input modified")
            if got.shape != x.shape or not torch.equal(got, want):
                wrong.append(f"{dtype} {op}: {(got.double() - want.double()).abs().max().item()}")
    return wrong


def test_the_exchange_is_the_native_all_reduce_bit_for_bit_on_two_ranks() -> None:
    assert run_processes(2, _against_native, timeout=300) == [[], []]


def _rank_order(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dtype in DTYPES:
        inputs = torch.stack([_value(r, dtype) for r in range(world)])  # every rank's input, made again here
        for op in OPS:
            got = exchange_reduce(_value(rank, dtype), op=op, n=world, group=dist.group.WORLD)
            want = {"sum": inputs.sum(0), "avg": inputs.sum(0) / world, "max": inputs.amax(0),
                    "min": inputs.amin(0)}[op]
            out[f"{dtype} {op}"] = (torch.equal(got, want), got)
    return out


def test_on_four_ranks_every_rank_gets_the_reduction_in_rank_order() -> None:
    ranks = run_processes(4, _rank_order, timeout=300)
    for key, (equal, got) in ranks[0].items():
        assert equal, key
        assert all(torch.equal(r[key][1], got) for r in ranks[1:]), key  # the same bits on every rank


def _chosen(rank: int, world: int, exchange: str | None) -> dict[str, Any]:
    """P(sum) -> R with a P(sum) gradient through redistribute_local: which collective ran, and the answers."""
    if exchange is not None:
        os.environ[EXCHANGE_ENV] = exchange
    calls = {"all_reduce": 0, "all_to_all_single": 0}
    for name in calls:
        native = getattr(dist, name)

        def counted(*a: Any, _native: Any = native, _name: str = name, **k: Any) -> Any:
            calls[_name] += 1
            return _native(*a, **k)
        setattr(dist, name, counted)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    for label, shape in (("small", (4, 6)), ("large", (600, 600))):  # 96 B and 1.44 MB a rank
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        seed = torch.randn(*shape, generator=torch.Generator().manual_seed(50 + rank))
        before = dict(calls)
        y = tplower.redistribute_local(x, mesh, "P(sum)", "R", grad="P(sum)")
        y.backward(seed)
        ran = {k: calls[k] - before[k] for k in calls}
        xd = x.detach().clone().requires_grad_()
        yd = DTensor.from_local(xd, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local(
            grad_placements=[Partial()])
        yd.backward(seed)
        out[label] = {"ran": ran, "forward": torch.equal(y.detach(), yd.detach()), "grad": torch.equal(x.grad, xd.grad)}
    return out


@pytest.mark.parametrize("exchange", [None, "0"], ids=["default", "off"])
def test_redistribute_local_runs_the_exchange_below_the_size_and_equals_dtensor(exchange: str | None) -> None:
    for res in run_processes(2, _chosen, exchange, timeout=300):
        small = {"all_reduce": 0, "all_to_all_single": 2} if exchange is None else \
            {"all_reduce": 2, "all_to_all_single": 0}  # forward and backward
        assert res["small"]["ran"] == small, res
        assert res["large"]["ran"] == {"all_reduce": 2, "all_to_all_single": 0}, res
        assert all(res[k]["forward"] and res[k]["grad"] for k in ("small", "large")), res


@pytest.mark.parametrize("raw", ["-1", "1MiB", "0.5"])
def test_a_bad_exchange_size_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(EXCHANGE_ENV, raw)
    with pytest.raises(TPLowerError, match=rf"{EXCHANGE_ENV}={raw!r}: expected a whole number of bytes"):
        backend_caps("gloo")


def test_the_size_comes_from_the_variable_for_gloo_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EXCHANGE_ENV, raising=False)
    assert backend_caps("gloo").exchange_bytes == 1 << 20
    monkeypatch.setenv(EXCHANGE_ENV, "4096")
    assert backend_caps("gloo").exchange_bytes == 4096 and backend_caps("nccl").exchange_bytes == 0
