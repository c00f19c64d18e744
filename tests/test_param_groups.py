"""Parameters whose gradients are summed alike share one ``all_reduce`` in backward (:func:`local_parameters`).

Four parameters replicated over a ``cp`` axis, each rank computing on its own data (as under context
parallelism): their gradients must be the sum over the ranks of what one process computes on each rank's data,
with one collective for the four, also when one parameter is unused on one rank only (the ranks' collectives still
line up), and no gradient at all (``None``, as one process leaves it) for one that no rank uses. Two gloo ranks;
the reference is one process per rank's data, summed by hand.
"""

from __future__ import annotations

from typing import Any

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
            "grads": [None if g is None else g.to_local() for g in grads]}


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


def test_summed_gradients_share_one_all_reduce_and_equal_the_ranks_sum() -> None:
    want = _one_process()
    for r in run_processes(2, _body):
        assert r["dtensor"]
        assert sum(r["counts"].values()) == 1, r["counts"]  # one collective for the four gradients
        assert want[3] is None and r["grads"][3] is None  # no gradient where no rank used it: weight decay skips it
        for got, ref in zip(r["grads"][:3], want[:3], strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
