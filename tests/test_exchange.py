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

OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}  # the exchange's reductions; max and min run natively
DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _value(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """A strided [33, 9] view (every other column of [33, 17]): the exchange must not need contiguous input."""
    full = torch.randn(33, 17, generator=torch.Generator().manual_seed(10 + rank))
    return (full * 100 if not dtype.is_floating_point else full).to(dtype)[:, ::2]


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
    for dtype in (*DTYPES, torch.int32, torch.int8):
        inputs = torch.stack([_value(r, dtype) for r in range(world)])  # every rank's input, made again here
        for op in OPS if dtype.is_floating_point else ("sum",):
            got = exchange_reduce(_value(rank, dtype), op=op, n=world, group=dist.group.WORLD)
            want = inputs.sum(0, dtype=dtype)
            want = want / world if op == "avg" else want
            out[f"{dtype} {op}"] = (torch.equal(got, want) and got.dtype == dtype, got)
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
    calls = {"all_reduce": 0, "all_to_all_single": 0}  # counted at torch.distributed's functions
    for name in calls:
        native = getattr(dist, name)

        def counted(*a: Any, _native: Any = native, _name: str = name, **k: Any) -> Any:
            calls[_name] += 1
            return _native(*a, **k)
        setattr(dist, name, counted)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    for label, shape, op in (("small", (4, 6), "sum"), ("large", (600, 600), "sum"), ("max", (4, 6), "max")):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(rank)).requires_grad_()  # 96 B, 1.44 MB
        seed = torch.randn(*shape, generator=torch.Generator().manual_seed(50 + rank))
        before = dict(calls)
        grad = "P(sum)" if op == "sum" else "R"  # DTensor takes no P(sum) gradient back to P(max)
        y = tplower.redistribute_local(x, mesh, f"P({op})", "R", grad=grad)
        y.backward(seed)
        ran = {k: calls[k] - before[k] for k in calls}
        xd = x.detach().clone().requires_grad_()
        yd = DTensor.from_local(xd, mesh, [Partial(op)]).redistribute(mesh, [Replicate()]).to_local(
            grad_placements=[Partial() if op == "sum" else Replicate()])
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
        # P(max): the native max (its NaN and signed-zero rules) whatever the size; an R gradient moves nothing back
        assert res["max"]["ran"] == {"all_reduce": 1, "all_to_all_single": 0}, res
        assert all(res[k]["forward"] and res[k]["grad"] for k in ("small", "large", "max")), res


def _dynamic(rank: int, world: int) -> dict[str, Any]:
    """P(sum) -> R compiled (aot_eager, fullgraph) over inputs whose dim 0 is marked dynamic, before and past the
    limit (8 and 600 rows of 256 float32: 16 KiB and 1.2 MB a rank), with a range that spans both."""
    from torch._dynamo.backends.common import aot_autograd

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    graphs: list[list[str]] = []

    def keep(gm: Any, _inputs: Any) -> Any:
        graphs.append([str(n.target) for n in gm.graph.nodes
                       if "c10d" in str(n.target) and "wait" not in str(n.target)])
        return gm.forward

    f = torch.compile(lambda t: tplower.redistribute_local(t * 1.0, mesh, "P(sum)", "R"),
                      backend=aot_autograd(fw_compiler=keep), fullgraph=True)
    right = []
    for rows in (8, 600):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rank))
        torch._dynamo.mark_dynamic(x, 0, min=2, max=4096)
        right.append(torch.equal(f(x), DTensor.from_local(x, mesh, [Partial()]).redistribute(
            mesh, [Replicate()]).to_local()))
    # static sizes while inductor is set to bucket all_reduces (what prepare_trainer sets under cp): native, so
    # the compiler can join them
    from torch._inductor import config

    with config.patch(bucket_all_reduces_fx="all"):
        torch._dynamo.reset()
        g = torch.compile(lambda t: tplower.redistribute_local(t * 1.0, mesh, "P(sum)", "R"),
                          backend=aot_autograd(fw_compiler=keep), fullgraph=True)
        g(torch.randn(8, 256))
    return {"graphs": graphs, "right": right}


def test_a_symbolic_size_or_inductors_bucketing_runs_the_native_all_reduce() -> None:
    """The limit is decided only on sizes known without a guard: a dynamic dim (even one whose range spans the limit)
    compiles once to the native all_reduce, where a guard on the size would have refused the range. A static size
    traced while inductor buckets all_reduces compiles to the native one too."""
    for res in run_processes(2, _dynamic, timeout=300):
        assert res["graphs"] == [["_c10d_functional.all_reduce.default"]] * 2 and res["right"] == [True, True], res


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
