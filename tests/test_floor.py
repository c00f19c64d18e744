"""The model bench's communication floor (tplower.bench.floor): the same step on a ``fake`` group moves nothing.

A train step of a small MLP, parallelized by tplower, by ``parallelize_module``
and by the hand-written Megatron copy, once on the real gloo group and once
on :func:`floor_group`'s fake group of the same ranks; every collective is
recorded at the dispatcher with the backend of its group. The floor step
issues the same collectives as the real one, all on the fake group, none on
gloo. The share arithmetic and the report's columns against hand-computed
tables.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from tplower.bench.floor import comm_share, floor_group, paired_share, with_shares
from tplower.core.lower.traffic import _group

D, H = 8, 16
PLAN = {"up": "colwise", "down": "rowwise"}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Backends(TorchDispatchMode):
    """Every collective operator dispatched, as ``(operator, backend of its group)``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        group = _group(args) if func.namespace in ("c10d", "_c10d_functional") else None
        if group is not None:  # a collective (wait_tensor and the autograd wrapper name no group)
            self.seen.append((func._opname, str(dist.get_backend(group))))
        return func(*args, **(kwargs or {}))


def _parallel(lib: str, base: nn.Module, mesh: Any, group: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tplower.bench.megatron import megatronize
    from tplower.nn.parallelize import parallelize

    model = copy.deepcopy(base)
    if lib == "tplower":
        return parallelize(model, mesh, PLAN, axis=mesh.mesh_dim_names[0])
    if lib == "dtensor":
        return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return megatronize(model, PLAN, group)


def _steps(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    fake, fake_mesh = floor_group()
    torch.manual_seed(0)
    base = MLP()
    x = torch.randn(4, D)
    out: dict[str, Any] = {}
    for lib in ("tplower", "dtensor", "megatron"):
        for where, m, g in (("real", mesh, mesh.get_group()), ("floor", fake_mesh, fake)):
            model = _parallel(lib, base, m, g)
            with Backends() as seen:  # the input's gradient too: the colwise input's backward all_reduce
                model(x.clone().requires_grad_()).square().sum().backward()
            out[f"{lib}:{where}"] = seen.seen
    y = torch.full((3,), float(rank + 1))
    dist.all_reduce(y, group=fake)
    out["fake_all_reduce"] = y.tolist()
    return out


def test_the_floor_step_issues_the_same_collectives_on_the_fake_group_and_none_on_gloo() -> None:
    from tplower.testing import run_processes

    for rank, got in enumerate(run_processes(2, _steps)):
        assert got["fake_all_reduce"] == [float(rank + 1)] * 3  # its own value back: nothing moved
        for lib in ("tplower", "dtensor", "megatron"):
            real, floor = got[f"{lib}:real"], got[f"{lib}:floor"]
            assert real and {b for _, b in real} == {"gloo"}, (lib, real)
            assert {b for _, b in floor} == {"fake"}, (lib, floor)
            assert [op for op, _ in floor] == [op for op, _ in real], lib
            assert len(real) == 2, (lib, real)  # the rowwise output's all_reduce, the colwise input gradient's


def test_share_is_the_median_of_each_rounds_ratio() -> None:
    # rounds (step, floor): (3, 2) -> 0.5, (8, 4) -> 1.0, (5, 2) -> 1.5; median 1.0 (the ratio of medians: 0.25)
    assert paired_share([3.0, 8.0, 5.0], [2.0, 4.0, 2.0]) == 1.0
    assert comm_share(6.0, 4.0) == 0.5
    with pytest.raises(ValueError, match="floor_ms=0"):
        comm_share(1.0, 0.0)
    with pytest.raises(ValueError, match="paired samples"):
        paired_share([1.0], [1.0, 2.0])


def _row(variant: str, steps: list[float]) -> dict[str, Any]:
    return {
        "model": "m",
        "tp": 2,
        "variant": variant,
        "forward_ms": 1.0,
        "train_step_ms": sorted(steps)[1],
        "forward_samples_ms": [1.0] * 3,
        "step_samples_ms": steps,
    }


def test_model_table_reads_each_copy_against_its_floor() -> None:
    from tplower.bench.phases import BenchResult
    from tplower.bench.report import model_table, target_lines

    rows = with_shares(
        [
            _row("one_process", [9.0, 9.0, 9.0]),
            _row("tplower", [11.0, 12.0, 12.0]),
            _row("tplower_floor", [10.0, 10.0, 10.0]),
            _row("dtensor", [15.0, 15.0, 15.0]),
            _row("dtensor_floor", [10.0, 10.0, 10.0]),
        ]
    )
    assert "comm_share" not in rows[0] and "comm_share" not in rows[2]
    assert rows[1]["floor_ms"] == 10.0 and rows[1]["comm_share"] == pytest.approx(0.2)
    assert rows[3]["comm_share"] == pytest.approx(0.5)
    res = BenchResult(config={}, meta={}, model=rows)
    table = model_table(res)
    assert table[0].endswith("| floor ms | comm share |")
    assert table[3].endswith("| 10.0 | +0.200 |") and table[2].endswith("| - | - |")
    line = [t for t in target_lines(res) if "communication share" in t]
    assert line == [
        "- m communication share of the eager train step, (step - floor) / floor: tplower +0.200, "
        "dtensor +0.500; tplower's the smallest of tplower, dtensor: met"
    ]


@pytest.fixture(scope="module", autouse=True)
def _native_all_reduce(native_all_reduce: None) -> None:
    """This module counts collectives by the names the lowering gives them: gloo's small all_reduces run natively."""
