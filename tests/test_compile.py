"""torch.compile: ``redistribute_local`` and a parallelized model, fullgraph from a cold process, dynamic batch.

One spawn of 2 gloo ranks (a cold process: the mesh is first used inside the
compiled function) runs everything with aot_eager (AOT autograd's traced
forward and backward graphs; inductor, whose cold compile takes about 40 s here,
with ``TPLOWER_SLOW=1``) and compares with eager,
forward and backward (float32, 1e-5). A dim that no placement shards changes
over batches 8, 6, 10, 12, 7: at most one recompile (then the dim is
dynamic), and ``mark_dynamic`` on it works.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import tplower
from tplower.testing import run_processes

from blocks import SP, Block

BATCHES = (8, 6, 10, 12, 7)
TOL = {"atol": 1e-5, "rtol": 1e-5}






def _transitions(x: torch.Tensor, mesh: Any) -> torch.Tensor:
    """Three transitions on a [batch, 4, 6] local tensor: gather, reduce_scatter, all_to_all."""
    a = tplower.redistribute_local(x, mesh, "S(1)", "R")
    b = tplower.redistribute_local(a * 2, mesh, "P(sum)", "S(2)")
    c = tplower.redistribute_local(b, mesh, "S(2)", "S(1)")
    return c.sin()


def _frames(counter: Any) -> int:
    return int(counter.frame_count)


def _body(rank: int, world: int, backend: str) -> dict[str, Any]:
    import torch._dynamo.testing

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    # 1. redistribute_local, cold: this is the first use of the mesh, inside the compiled function
    cnt = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(_transitions, backend=cnt, fullgraph=True)
    worst = 0.0
    for b in BATCHES:
        x = torch.randn(b, 2, 6, generator=torch.Generator().manual_seed(b + rank)).requires_grad_()
        xe = x.detach().clone().requires_grad_()
        y, ye = compiled(x, mesh), _transitions(xe, mesh)
        torch.testing.assert_close(y, ye, **TOL)
        y.square().sum().backward()
        ye.square().sum().backward()
        torch.testing.assert_close(x.grad, xe.grad, **TOL)
        worst = max(worst, float((y - ye).abs().max()))
    out["redistribute_frames"] = _frames(cnt)
    # mark_dynamic on the unsharded batch dim: no constraint violation, no recompile
    torch._dynamo.reset()
    cnt = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(_transitions, backend=cnt, fullgraph=True)
    for b in (5, 9):
        x = torch.randn(b, 2, 6)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x, mesh), _transitions(x, mesh), **TOL)
    out["mark_dynamic_frames"] = _frames(cnt)
    # 2. a parallelized block (sequence parallel: every kind of boundary), batch dim unsharded
    torch.manual_seed(0)
    ref = Block()
    eager = tplower.parallelize(copy.deepcopy(ref), mesh, SP)
    model = tplower.parallelize(copy.deepcopy(ref), mesh, SP)
    cnt = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled_model = torch.compile(model, backend=cnt, fullgraph=True)
    for b in BATCHES:
        x = torch.randn(b, 2 * world, 8, generator=torch.Generator().manual_seed(b)).chunk(world, 1)[rank]
        y, ye = compiled_model(x), eager(x)
        torch.testing.assert_close(y, ye, **TOL)
        y.square().sum().backward()
        ye.square().sum().backward()
    for (name, p), pe in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad.to_local(), pe.grad.to_local(), atol=1e-4, rtol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
    out["model_frames"] = _frames(cnt)
    return out


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_fullgraph_cold_dynamic_batch_world2(backend: str) -> None:
    for res in run_processes(2, _body, backend, timeout=600):
        # one compile for the first batch, at most one more that makes the batch dim dynamic
        assert res["redistribute_frames"] <= 2 and res["model_frames"] <= 2, res
        assert res["mark_dynamic_frames"] == 1, res
