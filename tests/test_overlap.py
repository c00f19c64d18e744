"""The overlapped column-parallel linear (``parallelize(..., overlap=True)``) against the unfused pair and one process.

Oracles: the same model parallelized with ``overlap=False`` (the transition
and the linear as two autograd nodes: gradients equal bit for bit where no
move is shared, within float rounding where q/k/v's shared all_reduce
becomes one each) and the model on one process. The order: the operators
a backward dispatches, recorded at the dispatcher: with ``overlap`` the
input gradient's ``all_reduce`` is issued before the weight gradient's
matmul, without it after. Real gloo processes at world 2.
"""

from __future__ import annotations

import copy
from importlib.util import find_spec
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from tplower.nn.parallelize import parallelize
from tplower.testing import run_processes

D, H = 12, 16  # colwise weight [H/2, D] = [8, 12] per rank; rowwise [D, H/2] = [12, 8]: the shapes tell them apart


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class QKV(nn.Module):
    """Three column-parallel siblings reading one tensor (their moves are shared unless overlapped)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, H) for _ in range(3))
        self.o = nn.Linear(H, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.tanh(self.q(x)) * self.k(x) + self.v(x))


class Events(TorchDispatchMode):
    """The backward's matmuls (by output shape) and all_reduces (by shape as rows), in the order dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mm.default:
            self.seen.append(("mm", tuple(out.shape)))
        elif func._opname == "allreduce_":  # as rows of features: the fused node reduces a flattened [-1, in]
            t = args[0][0]
            self.seen.append(("all_reduce", (t.numel() // t.shape[-1], t.shape[-1])))
        return out


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}


def _step(model: nn.Module, x: torch.Tensor, record: bool = False) -> tuple[dict[str, torch.Tensor], Any]:
    x = x.detach().clone().requires_grad_()
    loss = model(x).square().sum()
    events = Events()
    if record:
        with events:
            loss.backward()
    else:
        loss.backward()
    return {"x": x.grad, **_grads(model)}, events.seen


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _fused_nodes(model: nn.Module, x: torch.Tensor) -> int:
    """How many OverlappedLinear nodes one forward puts in the graph."""
    seen, todo, found = set(), [model(x.detach().clone().requires_grad_()).sum().grad_fn], 0
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        found += type(fn).__name__ == "OverlappedLinearBackward"
        todo += [f for f, _ in fn.next_functions]
    return found


def _small_models(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    x = torch.randn(3, 5, D)
    out: dict[str, Any] = {}
    for name, base, plan in (
        ("mlp", MLP(), {"up": "colwise", "down": "rowwise"}),
        ("qkv", QKV(), {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}),
    ):
        one, _ = _step(copy.deepcopy(base), x)
        on = parallelize(copy.deepcopy(base), mesh, plan, overlap=True)
        off = parallelize(copy.deepcopy(base), mesh, plan, overlap=False)
        got_on, seen_on = _step(on, x, record=True)
        got_off, seen_off = _step(off, x, record=True)
        out[name] = {
            "on_off": _diff(got_on, got_off),
            "on_one": _diff(got_on, one),
            "off_one": _diff(got_off, one),
            "seen_on": seen_on,
            "seen_off": seen_off,
            "fused_on": _fused_nodes(on, x),
            "fused_off": _fused_nodes(off, x),
        }
    return out


def _body(rank: int, world: int) -> dict[str, Any]:
    """The small models, and tiny Llama where transformers is installed: one spawn of 2 gloo ranks."""
    return {**_small_models(rank, world), "llama": _llama(rank, world) if find_spec("transformers") else None}


@pytest.fixture(scope="module")
def small() -> dict[str, Any]:
    return run_processes(2, _body)[0]  # type: ignore[no-any-return]


def test_mlp_gradients_equal_the_unfused_bit_for_bit_and_one_process(small: dict[str, Any]) -> None:
    mlp = small["mlp"]
    assert mlp["fused_on"] == 1 and mlp["fused_off"] == 0
    assert mlp["on_off"] == 0.0
    assert mlp["on_one"] < 1e-5 and mlp["off_one"] < 1e-5


def test_shared_siblings_each_all_reduce_their_own_gradient(small: dict[str, Any]) -> None:
    qkv = small["qkv"]
    assert qkv["fused_on"] == 3 and qkv["fused_off"] == 0
    assert qkv["on_off"] < 1e-6  # three all_reduces summed against one of the sum: float rounding only
    assert qkv["on_one"] < 1e-5
    reduces = [e for e in qkv["seen_on"] if e[0] == "all_reduce"]
    assert reduces == [("all_reduce", (15, D))] * 3
    assert [e for e in qkv["seen_off"] if e[0] == "all_reduce"] == [("all_reduce", (15, D))]


def _order(seen: list[tuple[str, tuple[int, ...]]], weight: tuple[int, ...]) -> list[str]:
    """The colwise layer's backward events: input-gradient matmul, its all_reduce, weight-gradient matmul."""
    names = {("mm", (15, D)): "grad_input", ("all_reduce", (15, D)): "all_reduce", ("mm", weight): "grad_weight"}
    return [names[e] for e in seen if e in names]


def test_the_all_reduce_is_issued_before_the_weight_gradient(small: dict[str, Any]) -> None:
    colwise_weight = (H // 2, D)
    assert _order(small["mlp"]["seen_on"], colwise_weight) == ["grad_input", "all_reduce", "grad_weight"]
    # unfused, the linear's node computes both products before the transition's node reduces
    assert _order(small["mlp"]["seen_off"], colwise_weight) == ["grad_input", "grad_weight", "all_reduce"]
    # each of q, k, v: its own input gradient, its all_reduce, then its weight gradient
    assert _order(small["qkv"]["seen_on"], colwise_weight) == ["grad_input", "all_reduce", "grad_weight"] * 3


def _llama(rank: int, world: int) -> dict[str, float]:
    from tplower.run.models import LLAMA_TINY, load_model, sentences
    from tplower.run.tasks import make_batch, training_loss
    from tplower.runtime.boundary import _Boundary

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    batch = make_batch(LLAMA_TINY, None, sentences()[:4])
    grads: dict[str, dict[str, torch.Tensor]] = {}
    losses: dict[str, float] = {}
    fused = 0
    for key in ("one", "on", "off"):
        model = load_model(LLAMA_TINY)[0]
        if key != "one":
            parallelize(model, mesh, "auto", overlap=key == "on")
        if key == "on":
            fused = sum(
                isinstance(b := m.__dict__.get("forward"), _Boundary) and b.static.overlap for m in model.modules()
            )
        loss = training_loss("causal_lm", model, batch)
        loss.backward()
        losses[key] = float(loss)
        grads[key] = _grads(model)
    return {
        "on_off": _diff(grads["on"], grads["off"]),
        "on_one": _diff(grads["on"], grads["one"]),
        "loss": abs(losses["on"] - losses["one"]),
        "overlapped_modules": float(fused),
    }


def test_tiny_llama_gradients_match_unfused_and_one_process(small: dict[str, Any]) -> None:
    pytest.importorskip("transformers")
    got = small["llama"]
    # q, k, v, gate, up per layer (2 layers) and lm_head are colwise linears; o, down rowwise
    assert got["overlapped_modules"] == 11
    assert got["on_off"] < 1e-6 and got["on_one"] < 1e-5 and got["loss"] < 1e-5, got


def _starts(rank: int, world: int) -> dict[str, bool]:
    import torch.distributed as dist

    from tplower.core.lower import collectives as C
    from tplower.core.lower.overlap import all_reduce_start

    group = dist.group.WORLD
    x = torch.arange(6.0).reshape(2, 3) * (rank + 1)
    out = {}
    for op, native in (("sum", True), ("avg", True), ("avg", False), ("max", True)):
        want = C.all_reduce(x, group=group, op=op, n=world, native=native)
        got = all_reduce_start(x.clone(), group=group, op=op, n=world, native=native).wait()
        out[f"{op}:{native}"] = torch.equal(got, want)
    empty = torch.empty(0, 3)
    out["empty"] = all_reduce_start(empty, group=group, op="sum", n=world).wait() is empty
    return out


def test_a_started_all_reduce_equals_the_bound_step() -> None:
    from tplower.testing import run_threaded

    for got in run_threaded(2, _starts):
        assert all(got.values()), got


def _released(rank: int, world: int) -> str:
    from tplower.runtime.boundary import _Boundary

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = parallelize(MLP(), mesh, {"up": "colwise", "down": "rowwise"}, overlap=True)
    x = torch.randn(3, D, requires_grad=True)
    loss = model(x).sum()
    b = model.up.__dict__["forward"]
    assert isinstance(b, _Boundary)
    mv = b.static.ins[0]
    b.lowerer.program(mv.src, mv.dst, x.shape, "cpu", grad=mv.grad).release()  # as tplower.shutdown() does
    try:
        loss.backward()
    except Exception as exc:  # the type is what is checked
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_backward_after_the_groups_were_released_says_so() -> None:
    from tplower.testing import run_threaded

    for msg in run_threaded(2, _released):
        assert msg.startswith("TPLowerError: this tplower program's process groups were destroyed"), msg


@pytest.fixture(scope="module", autouse=True)
def _native_all_reduce(native_all_reduce: None) -> None:
    """This module counts collectives by the names the lowering gives them: gloo's small all_reduces run natively."""
