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
    # 3. three SGD steps at one shape on a new mesh (cold plan caches, the lowerer made eagerly by parallelize):
    # the graph must not guard on the caches, or the second step recompiles
    mesh2 = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = tplower.parallelize(copy.deepcopy(ref), mesh2, SP)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cnt = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled_model = torch.compile(model, backend=cnt, fullgraph=True)
    x = torch.randn(4, 2 * world, 8, generator=torch.Generator().manual_seed(3)).chunk(world, 1)[rank]
    steps = []
    for _ in range(3):
        opt.zero_grad()
        compiled_model(x).square().sum().backward()
        opt.step()
        steps.append(_frames(cnt))
    out["step_frames"] = steps
    return out


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_fullgraph_cold_dynamic_batch_world2(backend: str) -> None:
    for res in run_processes(2, _body, backend, timeout=600):
        # one compile for the first batch, at most one more that makes the batch dim dynamic
        assert res["redistribute_frames"] <= 2 and res["model_frames"] <= 2, res
        assert res["mark_dynamic_frames"] == 1, res
        assert res["step_frames"] == [1, 1, 1], res


def _llama_steps(rank: int, world: int) -> dict[str, Any]:
    """Three compiled AdamW steps of a 1-layer random Llama, from a cold process; the eager copy alongside."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tplower.bench.graphs import GraphCapture, copies_around_collectives
    from tplower.run.models import LLAMA_TINY_CONFIG

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(**{**LLAMA_TINY_CONFIG, "num_hidden_layers": 1})).eval()
    compiled_model = tplower.parallelize(copy.deepcopy(ref), mesh, "auto")
    eager = tplower.parallelize(copy.deepcopy(ref), mesh, "auto")
    cap = GraphCapture()
    compiled = torch.compile(compiled_model, backend=cap, fullgraph=True)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (compiled_model, eager)]
    ids = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(1))
    frames, losses = [], []
    for _ in range(3):
        pair = []
        for model, opt in zip((compiled, eager), opts, strict=True):
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            pair.append(float(loss))
        losses.append(pair)
        frames.append(cap.frames)
    return {"frames": frames, "losses": losses, "graphs": (len(cap.forward), len(cap.backward)),
            "forward_near": copies_around_collectives(cap.forward[0]),
            "backward_near": copies_around_collectives(cap.backward[0])}


@pytest.mark.slow
def test_parallelized_llama_compiles_once_from_a_cold_process() -> None:
    # The first trace meets cold plan caches; the graph must not guard on them (it would recompile at step 2).
    for res in run_processes(2, _llama_steps, timeout=600):
        assert res["frames"] == [1, 1, 1] and res["graphs"] == (1, 1), res
        for compiled_loss, eager_loss in res["losses"]:
            assert abs(compiled_loss - eager_loss) <= 1e-4 * max(1.0, abs(eager_loss)), res["losses"]
        assert res["losses"][2][1] < res["losses"][0][1], res["losses"]  # the steps train
        # every all_reduce of the row-parallel outputs (forward) and of the column-parallel inputs' gradients
        # (backward) has no copy next to it; the one copy is the lm_head's gather of the vocabulary dim
        fwd = [n for name, n in res["forward_near"] if name.endswith("all_reduce")]
        bwd = [n for name, n in res["backward_near"] if name.endswith("all_reduce")]
        assert fwd and not any(fwd) and bwd and not any(bwd), res
