"""parallelize: a two-layer MLP and a transformer block, sharded by a plan, against two oracles.

Oracle 1: the same model on one process (outputs, input gradient, and each
parameter gradient cut to this rank's shard), for the plain TP plan and a
sequence-parallel plan. Oracle 2: the same block sharded by PyTorch's own
``parallelize_module`` (ColwiseParallel / RowwiseParallel on DTensor), for
the plain TP plan. Both on real gloo at world 2 and the threaded group at
world 4; tiny transformers Llama and BERT models at world 2.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from tplower import TPLowerError
from tplower.nn.parallelize import installed_boundary, parallelize
from tplower.testing import run_processes, run_threaded

B, T, D, H, HEADS = 2, 8, 16, 32, 4
TOL = {"atol": 2e-5, "rtol": 1e-4}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Attention(nn.Module):
    """Reshapes by its head count, as BERT's self-attention does."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.n_heads, self.head_dim = HEADS, D // HEADS

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(a.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(D), Attention(), nn.LayerNorm(D), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


_SP_IN = {"style": "colwise", "in_src": {"0": {"tp": "S(1)"}}}  # all_gather the sequence, reduce_scatter back
_SP_OUT = {"style": "rowwise", "out_dst": {"out": {"tp": "S(1)"}}}  # reduce_scatter the sequence
PLANS = {
    "mlp": {"up": "colwise", "down": "rowwise"},
    "mlp_sp": {"up": _SP_IN, "down": _SP_OUT},
    "block": {"attn": {"local_attrs": {"n_heads": "divide"}}, "attn.*": "colwise", "attn.o": "rowwise",
              "mlp.up": "colwise", "mlp.down": "rowwise"},
    "block_sp": str(Path(__file__).parent.parent / "examples" / "plans" / "block_sp.yaml"),
}
# Expected shard dim of each parameter, written from the Megatron layout (None: replicated).
SHARD_DIMS = {"up.weight": 0, "up.bias": 0, "down.weight": 1, "q.weight": 0, "q.bias": 0, "k.weight": 0,
              "k.bias": 0, "v.weight": 0, "v.bias": 0, "o.weight": 1}
CASES = [("mlp", MLP, False), ("mlp_sp", MLP, True), ("block", Block, False), ("block_sp", Block, True)]


def _seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _make(cls: type[nn.Module]) -> nn.Module:
    """The model with weights from its own generator (threads share torch's global one)."""
    model = cls()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def _shard(full: torch.Tensor, name: str, world: int, rank: int) -> torch.Tensor:
    dim = SHARD_DIMS.get(".".join(name.split(".")[-2:]))
    return full if dim is None else full.chunk(world, dim)[rank]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _DTensorOps(TorchDispatchMode):
    """Records every operator called with a DTensor argument (DTensor's own dispatch runs after the mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(isinstance(a, DTensor) for a in pytree.tree_leaves((args, kwargs or {}))):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _no_dtensor() -> Iterator[None]:
    """No activation moves through DTensor: no redistribute and no operator on a DTensor, forward or backward.

    Parameters are DTensors; their local tensors are taken by ``to_local``
    and their gradients wrapped back by its backward, neither of which runs
    an operator on a DTensor.
    """
    boom = AssertionError("DTensor.redistribute ran on the tp_collective path")
    with mock.patch.object(DTensor, "redistribute", side_effect=boom), _DTensorOps() as mode:
        yield
    assert not mode.seen, f"operators ran on DTensors: {mode.seen[:5]}"


def _run(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    out = model(x)
    (out * g).sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad


def _run_grads(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Output, input gradient and parameter gradients through ``autograd.grad`` (nothing accumulated)."""
    x = x.clone().requires_grad_()
    out = model(x)
    params = list(model.parameters())
    grads = torch.autograd.grad(out, [x, *params], g)
    for p, gp in zip(params, grads[1:], strict=True):
        p.grad = gp
    return (out.detach(), *grads)


def _check_case(label: str, make: type[nn.Module], sp: bool, mesh: DeviceMesh, rank: int, world: int,
                guard: bool) -> nn.Module:
    ref = _make(make)
    model = parallelize(copy.deepcopy(ref), mesh, PLANS[label])
    x, g = _seeded(1, B, T, D), _seeded(2, B, T, D)
    want_out, want_dx = _run(ref, x, g)
    cut = (lambda t: t.chunk(world, 1)[rank]) if sp else (lambda t: t)
    with _no_dtensor() if guard else contextlib.nullcontext():
        out, dx, *_ = _run_grads(model, cut(x), cut(g))
    torch.testing.assert_close(out, cut(want_out), **TOL, msg=lambda m: f"{label} output: {m}")
    torch.testing.assert_close(dx, cut(want_dx), **TOL, msg=lambda m: f"{label} input grad: {m}")
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = _shard(ref_params[name].grad, name, world, rank)
        if label == "block" and name.startswith("ln"):  # outside the plan: a Replicate DTensor, its gradient whole
            assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), name
            assert all(q.is_replicate() for q in p.placements) and p.grad.placements == p.placements, name
            torch.testing.assert_close(p.grad.to_local(), want, **TOL, msg=lambda m, n=name: f"{label} {n} grad: {m}")
            continue
        # The ecosystem's convention: a DTensor parameter with the global shape, and a DTensor gradient
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), name
        assert p.shape == ref_params[name].shape and p.grad.placements == p.placements, name
        local = p.to_local()
        assert local.shape == want.shape, (label, name, local.shape, want.shape)
        assert local.untyped_storage().nbytes() == local.numel() * local.element_size(), f"{name} keeps a full copy"
        torch.testing.assert_close(p.grad.to_local(), want, **TOL, msg=lambda m, n=name: f"{label} {n} grad: {m}")
    return model


def _torch_oracle(mesh: DeviceMesh, world: int, ours: nn.Module) -> None:
    theirs = _make(Block)
    styles = {f"attn.{n}": ColwiseParallel() for n in "qkv"}
    styles |= {"attn.o": RowwiseParallel(), "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    parallelize_module(theirs, mesh, styles)
    theirs.attn.n_heads //= world
    x, g = _seeded(1, B, T, D), _seeded(2, B, T, D)
    out, dx = _run(theirs, x, g)
    ours.zero_grad()
    our_out, our_dx = _run(ours, x, g)
    torch.testing.assert_close(our_out, out, **TOL)
    torch.testing.assert_close(our_dx, dx, **TOL)
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        their = theirs_params[name]
        if not isinstance(their, DTensor):  # outside the plan: theirs stays plain, ours is a Replicate DTensor
            assert isinstance(p, DTensor) and all(q.is_replicate() for q in p.placements), name
            assert isinstance(p.grad, DTensor)
            torch.testing.assert_close(p.grad.to_local(), their.grad, **TOL,
                                       msg=lambda m, n=name: f"torch oracle {n}: {m}")
            continue
        assert (p.placements, p.shape, p.device_mesh) == (their.placements, their.shape, their.device_mesh), name
        assert p.grad is not None and their.grad is not None
        assert p.grad.placements == their.grad.placements, (name, p.grad.placements, their.grad.placements)
        torch.testing.assert_close(p.grad.to_local(), their.grad.to_local(), **TOL,
                                   msg=lambda m, n=name: f"torch oracle {n}: {m}")


def _parity_body(rank: int, world: int, guard: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    forms = {}
    for label, make, sp in CASES:
        model = _check_case(label, make, sp, mesh, rank, world, guard)
        if label == "block":
            _torch_oracle(mesh, world, model)
        info = installed_boundary(model.mlp.down if label.startswith("block") else model.down)
        forms[label] = f"{info.form.form}/{info.mode}" if info else "none"
    if guard:  # one spawn for both checks: real processes, where warnings can be caught per rank
        return {"forms": forms, "live": _live_mesh_body(rank, world)}
    return {"forms": forms}


def test_parity_gloo_world2_and_live_mesh_disagreement_runs_dtensor_with_a_warning() -> None:
    for res in run_processes(2, _parity_body, True):
        assert set(res["forms"].values()) == {"tp_collective/lowered"}
        reason, caught = res["live"]
        assert reason is not None and "backend 'mystery' is unknown" in reason
        assert any("'down'" in m and "DTensor" in m for m in caught), caught


def test_parity_threaded_world4() -> None:
    for res in run_threaded(4, _parity_body, False):
        assert set(res["forms"].values()) == {"tp_collective/lowered"}


def _live_mesh_body(rank: int, world: int) -> tuple[str | None, list[str]]:
    ref = _make(MLP)
    x, g = _seeded(1, B, T, D), _seeded(2, B, T, D)
    want = _run(ref, x, g)[0]
    # A group that orders its ranks unlike the mesh is still lowered, in mesh-coordinate order.
    permuted = DeviceMesh("cpu", list(reversed(range(world))), mesh_dim_names=("tp",))
    model = parallelize(copy.deepcopy(ref), permuted, PLANS["mlp"])
    torch.testing.assert_close(_run(model, x, g)[0], want, **TOL)
    info = installed_boundary(model.down)
    assert info is not None and info.mode == "lowered"
    # A backend tplower does not know: that boundary runs on DTensor, with a warning.
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with warnings.catch_warnings(record=True) as caught, \
            mock.patch("tplower.nn.moves.dist.get_backend", return_value="mystery"):
        warnings.simplefilter("always")
        model = parallelize(copy.deepcopy(ref), mesh, PLANS["mlp"])
    torch.testing.assert_close(_run(model, x, g)[0], want, **TOL)
    info = installed_boundary(model.down)
    assert info is not None and info.mode == "dtensor"
    return info.reason, [str(w.message) for w in caught]


class _TwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), x


def _edges_body(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = []
    m = parallelize(_TwoOut(), mesh, {"": {"in_src": {"extra": {"tp": "S(0)"}}, "in_dst": {"extra": {"tp": "R"}},
                                           "out_src": {"3": {"tp": "S(0)"}}, "out_dst": {"3": {"tp": "R"}}}})
    try:
        m(torch.ones(2, D), None)  # a missing optional input passes through; output 3 does not exist
    except TPLowerError as exc:
        out.append(str(exc))
    with pytest.raises(TPLowerError, match="bias would be added on every rank"):
        parallelize(MLP(), mesh, {"down": "local_rowwise"})
    uneven = parallelize(nn.Linear(D, 3), mesh, {"": "colwise"})  # 3 outputs on 2 ranks: torch.chunk's 2 + 1
    assert uneven.weight.to_local().shape[0] == (2, 1)[rank] and uneven.weight.shape[0] == 3
    # copy.deepcopy of a parallelized model (as of parallelize_module's): its own parameters, the same groups
    ref = _make(MLP)
    x, g = _seeded(1, B, T, D), _seeded(2, B, T, D)
    twin = copy.deepcopy(parallelize(copy.deepcopy(ref), mesh, PLANS["mlp"]))
    want_out, want_grad = _run(ref, x, g)
    got_out, got_grad = _run(twin, x, g)
    torch.testing.assert_close(got_out, want_out, **TOL)
    torch.testing.assert_close(got_grad, want_grad, **TOL)
    return out


def test_missing_inputs_pass_and_bad_output_index_names_module() -> None:
    for msgs in run_threaded(2, _edges_body):
        assert len(msgs) == 1 and "module ''" in msgs[0] and "index 3" in msgs[0]



def _scaled_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A local-compute injection: this rank's columns of ``2 * linear(x)``."""
    return 2 * F.linear(x, module.weight, module.bias)


def _mesh2d_body(rank: int, world: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_coordinate()
    ref = _make(MLP)
    # The root gathers the dp-sharded batch (a non-tp axis: DTensor runs it); up/down lower on tp.
    plan = {"": {"in_src": {"x": {"dp": "S(0)"}}, "in_dst": {"x": {"dp": "R"}}}, **PLANS["mlp"]}
    model = parallelize(copy.deepcopy(ref), mesh, plan)
    x, g = _seeded(1, 2 * B, T, D), _seeded(2, 2 * B, T, D)
    want_out, want_dx = _run(ref, x, g)
    out, dx = _run(model, x.chunk(2, 0)[dp], g)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(dx, want_dx.chunk(2, 0)[dp], **TOL)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh == mesh["tp"], name  # as parallelize_module(mesh["tp"])
        torch.testing.assert_close(_local(p.grad), _shard(ref_params[name].grad, name, world // 2, tp), **TOL)
    lin = _make(MLP).up
    region = parallelize(copy.deepcopy(lin), mesh, {"": {"style": "colwise_rep",
                                                         "local_compute": "test_parallelize:_scaled_linear"}})
    torch.testing.assert_close(region(x), 2 * lin(x).detach(), **TOL)
    infos = {"root": installed_boundary(model), "up": installed_boundary(model.up),
             "region": installed_boundary(region)}
    return {k: f"{v.form.form}/{v.mode}" for k, v in infos.items() if v is not None}


def test_dp_tp_mesh_generic_root_and_region_threaded_world4() -> None:
    for forms in run_threaded(4, _mesh2d_body):
        assert forms == {"root": "generic/dtensor", "up": "tp_collective/lowered", "region": "region/lowered"}


# ---- transformers models, parallelized by their own plan vocabulary ------------------------------------
HF_SHARD_DIMS = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "gate_proj.weight": 0,
                 "up_proj.weight": 0, "o_proj.weight": 1, "down_proj.weight": 1, "query.weight": 0, "query.bias": 0,
                 "key.weight": 0, "key.bias": 0, "value.weight": 0, "value.bias": 0, "intermediate.dense.weight": 0,
                 "intermediate.dense.bias": 0, "output.dense.weight": 1}


def _hf_body(rank: int, world: int, ref: nn.Module, plan: object) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = parallelize(copy.deepcopy(ref), mesh, plan)  # type: ignore[arg-type]
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    g = _seeded(4, 2, 8, 32)
    outs = []
    for m in (ref, model) if rank == 0 else (model,):  # rank 0 also runs the reference (threads share ref)
        out = m(input_ids=ids).last_hidden_state
        (out * g).sum().backward()
        outs.append(out.detach())
    if rank != 0:
        return
    torch.testing.assert_close(outs[1], outs[0], **TOL)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        key = next((k for k in HF_SHARD_DIMS if name.endswith(k)), None)
        want = ref_params[name].grad
        want = want if key is None else want.chunk(world, HF_SHARD_DIMS[key])[rank]
        torch.testing.assert_close(_local(p.grad), want, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_transformers_models_threaded_world2(arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "llama":
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
        ref, plan = transformers.LlamaModel(config), dict(config.base_model_tp_plan)
    else:
        config = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, vocab_size=64, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)
        ref = transformers.BertModel(config, add_pooling_layer=False)
        plan = str(Path(__file__).parent.parent / "examples" / "plans" / "bert_tp.yaml")
    run_threaded(2, _hf_body, ref.eval(), plan)


class _Copies(TorchDispatchMode):
    """Counts ``clone`` and ``copy_`` (the collectives' own work is hidden from it: see the test)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += str(func) in ("aten.clone.default", "aten.copy_.default")
        return func(*args, **(kwargs or {}))


def _in_place_body(rank: int, world: int) -> dict[str, Any]:
    ref = _make(MLP)
    model = parallelize(copy.deepcopy(ref), init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)),
                        PLANS["mlp"])
    x, g = _seeded(1, B, T, D), _seeded(2, B, T, D)
    model(x.clone().requires_grad_())  # planned and cached: the counted calls are repeats
    leaf = x.clone().requires_grad_()
    with _Copies() as fwd:
        out = model(leaf)
    out.backward(g)
    with torch.no_grad(), _Copies() as no_grad:
        model(x)
    want, want_dx = _run(ref, x, g)
    return {"forward": fwd.count, "no grad": no_grad.count,
            "equal": torch.allclose(out, want, **TOL) and torch.allclose(leaf.grad, want_dx, **TOL)}


def test_a_rowwise_linear_reduces_its_own_output_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    # down's P(sum) -> R all_reduce takes the Linear's fresh output itself, with grad and without: no copy. (The
    # backward still all-reduces up's input gradient into a new tensor: an incoming gradient may be shared.)
    real = torch.distributed.all_reduce

    def unseen(*args: Any, **kwargs: Any) -> Any:  # the threaded group's reduction copies in Python
        with torch.utils._python_dispatch._disable_current_modes():
            return real(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "all_reduce", unseen)
    for got in run_threaded(2, _in_place_body):
        assert got == {"forward": 0, "no grad": 0, "equal": True}, got
