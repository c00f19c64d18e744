"""Parameters whose gradients are summed alike share one ``all_reduce`` in backward (:func:`local_parameters`).

Four parameters replicated over a ``cp`` axis, each rank computing on its own data (as under context
parallelism): their gradients must be the sum over the ranks of what one process computes on each rank's data,
with one collective for the four, also when one parameter is unused on one rank only (the ranks' collectives still
line up), and no gradient at all (``None``, as one process leaves it) for one that no rank uses, or when the views
get no gradient on any rank; every gradient can be saved, pickled and deep-copied. Two gloo ranks; the reference is
one process per rank's data, summed by hand.
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from tplower.core.lower.traffic import CollectiveTraffic
from tplower.runtime.params import local_parameters, param_layout, shard_parameter
from tplower.testing import run_processes

SHAPES = [(4, 3), (3,), (2, 2), (2,)]  # the last one no rank uses


def _values() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(s) for s in SHAPES]


def _loss(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor, x: torch.Tensor, use_c: bool
          ) -> torch.Tensor:
    out = ((x @ a) * b).square().sum()
    return out + c.sum() * x.sum() if use_c else out


def _data(rank: int) -> tuple[torch.Tensor, bool]:
    torch.manual_seed(10 + rank)
    return torch.randn(5, 4), rank == 0  # rank 1 never touches the third parameter


def _body(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    layout = param_layout(mesh, (Replicate(),), None, "tp", summed=("cp",))
    params = [shard_parameter(torch.nn.Parameter(v), layout, f"p{i}") for i, v in enumerate(_values())]
    x, use_c = _data(rank)
    with CollectiveTraffic() as comm:
        views = local_parameters(params, [layout] * len(params))
        _loss(*views, x, use_c).backward()  # type: ignore[arg-type]
    grads = [p.grad for p in params]
    return {"counts": dict(comm.counts),
            "dtensor": all(g is None or (isinstance(g, DTensor) and g.placements == (Replicate(),)) for g in grads),
            "grads": [None if g is None else g.to_local() for g in grads],
            "kept": _kept(grads), "none": _no_gradient(params, layout)}


def _kept(grads: list[torch.Tensor | None]) -> list[bool]:
    """Each gradient through ``torch.save``/``torch.load``, ``pickle`` and ``copy.deepcopy``: its values back."""
    out = []
    for g in grads:
        if g is None:
            continue
        buffer = io.BytesIO()
        torch.save(g, buffer)
        buffer.seek(0)
        copies = [torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(g)), copy.deepcopy(g)]
        out.append(all(torch.equal(c.to_local(), g.to_local()) for c in copies))
    return out


class _NoWeightGradient(torch.autograd.Function):
    """``x * (a.sum() + b.sum())`` whose backward gives the weights no gradient (a user's own function)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * (a.sum() + b.sum())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return grad, None, None


def _no_gradient(params: list[torch.Tensor], layout: Any) -> list[bool]:
    """Two grouped parameters whose views get no gradient on any rank: ``None``, as one process leaves them."""
    fresh = [torch.nn.Parameter(DTensor.from_local(p.to_local().detach().clone(), p.device_mesh, p.placements))
             for p in params[:2]]
    x = torch.ones(3, requires_grad=True)
    views = local_parameters(fresh, [layout] * 2)
    _NoWeightGradient.apply(x, *views).sum().backward()
    return [p.grad is None for p in fresh]


def _one_process() -> list[torch.Tensor | None]:
    """Each rank's data through the plain parameters in one process, the gradients summed over the ranks (``None``
    for a parameter no rank's loss reads, as autograd leaves it)."""
    total: list[torch.Tensor | None] = [None] * len(SHAPES)
    for rank in range(2):
        leaves = [v.clone().requires_grad_() for v in _values()]
        x, use_c = _data(rank)
        _loss(*leaves, x, use_c).backward()
        for i, leaf in enumerate(leaves):
            if leaf.grad is not None:
                total[i] = leaf.grad if total[i] is None else total[i] + leaf.grad
    return total


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_processes(2, _body)


def test_summed_gradients_share_one_all_reduce_and_equal_the_ranks_sum(ranks: list[dict[str, Any]]) -> None:
    want = _one_process()
    for r in ranks:
        assert r["dtensor"]
        assert sum(r["counts"].values()) == 1, r["counts"]  # one collective for the four gradients
        assert want[3] is None and r["grads"][3] is None  # no gradient where no rank used it: weight decay skips it
        for got, ref in zip(r["grads"][:3], want[:3], strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_every_gradient_can_be_saved_pickled_and_deep_copied(ranks: list[dict[str, Any]]) -> None:
    """The grouped gradients each own their storage (a DTensor over a slice of the shared buffer could not be)."""
    for r in ranks:
        assert r["kept"] == [True, True, True], r["kept"]


def test_a_grouped_backward_without_any_gradient_leaves_none_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["none"] == [True, True], r["none"]
