"""Uneven activation dims at ``parallelize`` boundaries: the ``uneven`` declaration and the debug check.

A sequence that does not divide over tp (3 and 5 on 2 ranks, 7 on 4) is cut
as ``torch.chunk`` cuts it (5 on 2 = 3 + 2, 7 on 4 = 2 + 2 + 2 + 1). Two
models, each against one process (forward output, input gradient, every
parameter gradient): a colwise ``nn.Linear`` whose input arrives sharded on
the sequence, and a pre-norm sequence-parallel MLP block
(norm -> colwise -> rowwise). Without a declaration, the debug check
(``TPLOWER_DEBUG=1``) makes every rank raise the same error naming the
module, the input and the dim.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tplower import TPLowerError
from tplower.nn.parallelize import parallelize
from tplower.nn.plans import resolve_entry
from tplower.testing import RankFailure, run_processes, run_threaded

from blocks import Block, D

TOL = {"atol": 2e-5, "rtol": 1e-4}




def _linear_plan(uneven: bool) -> dict[str, Any]:
    return {"": {"style": "colwise", "in_src": {"0": {"tp": "S(1)"}}, **({"uneven": ["0"]} if uneven else {})}}


def _block_plan(uneven: bool) -> dict[str, Any]:
    # only up's input is sharded at its source; down's output is a partial sum of the whole sequence,
    # which the reduce_scatter cuts in torch.chunk pieces: declaring it costs nothing and changes nothing
    return {"norm": "sequence_parallel",
            "up": {"style": "colwise", "in_src": {"0": {"tp": "S(1)"}}, **({"uneven": ["0"]} if uneven else {})},
            "down": {"style": "rowwise", "out_dst": {"out": {"tp": "S(1)"}},
                     **({"uneven": ["out"]} if uneven else {})}}


#: name -> (make the model, plan(uneven), input shape at sequence T, dim the output is cut on against one process)
MODELS: dict[str, tuple[Any, Any, Any, int]] = {
    "linear_colwise": (lambda: nn.Linear(4, 8, bias=False), _linear_plan, lambda t: (1, t, 4), -1),
    "sp_block": (Block, _block_plan, lambda t: (2, t, D), 1),
}


def _seeded(model: nn.Module, seed: int = 0) -> nn.Module:
    """Weights from the model's own generator (threads share torch's global one)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def _parity(rank: int, world: int, name: str, seq: int) -> tuple[int, ...]:
    """One model at one sequence length against one process; returns this rank's local input shape."""
    make, plan, shape, out_dim = MODELS[name]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ref = _seeded(make())
    ours = parallelize(_seeded(make()), mesh, plan(True))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape(seq), generator=gen, requires_grad=True)
    want = ref(x)
    g = torch.randn(want.shape, generator=gen)
    (want * g).sum().backward()
    assert x.grad is not None
    x_local = x.detach().chunk(world, 1)[rank].clone().requires_grad_()
    out = ours(x_local)
    torch.testing.assert_close(out, want.detach().chunk(world, out_dim)[rank], **TOL)
    (out * g.chunk(world, out_dim)[rank]).sum().backward()
    assert x_local.grad is not None
    torch.testing.assert_close(x_local.grad, x.grad.chunk(world, 1)[rank], **TOL)
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for n, p in ours.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), n
        torch.testing.assert_close(p.grad.full_tensor(), grads[n], **TOL, msg=lambda m, n=n: f"{name} {n}: {m}")
    return tuple(x_local.shape)


def _parity_all(rank: int, world: int, seqs: list[int]) -> list[tuple[int, ...]]:
    return [_parity(rank, world, name, seq) for name in MODELS for seq in seqs]


def test_declared_uneven_matches_one_process_gloo_world2_seq3_and_5() -> None:
    shapes = run_processes(2, _parity_all, [3, 5])
    # torch.chunk pieces: 3 = 2 + 1, 5 = 3 + 2 (linear at 3, 5; block at 3, 5)
    assert [s[1] for s in shapes[0]] == [2, 3, 2, 3]
    assert [s[1] for s in shapes[1]] == [1, 2, 1, 2]


def test_declared_uneven_matches_one_process_threaded_world4_seq7() -> None:
    shapes = run_threaded(4, _parity_all, [7])
    assert [s[0][1] for s in shapes] == [2, 2, 2, 1]  # 7 = 2 + 2 + 2 + 1


def _debug(rank: int, world: int, seq: int, set_env: bool) -> dict[str, str]:
    """Each model undeclared under the debug check: the error text per model; then declared, still checked."""
    if set_env:
        os.environ["TPLOWER_DEBUG"] = "1"  # read when the mesh's lowerer is made
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for name, (make, plan, shape, _) in MODELS.items():
        model = parallelize(_seeded(make()), mesh, plan(False))
        x = torch.randn(shape(seq), generator=torch.Generator().manual_seed(1)).chunk(world, 1)[rank]
        try:
            model(x)
            out[name] = "no error"
        except TPLowerError as exc:
            out[name] = str(exc)
    declared = parallelize(nn.Linear(4, 8, bias=False), mesh, _linear_plan(True))
    assert tuple(declared(torch.ones(1, seq, 4).chunk(world, 1)[rank]).shape) == (1, seq, 8 // world)
    return out


@pytest.mark.slow  # its threaded twin runs in CI
def test_debug_check_names_module_input_and_dim_on_every_rank_gloo_world2() -> None:
    results = run_processes(2, _debug, 3, True)
    assert results[0] == results[1]  # every rank raises the same message
    msgs = results[0]
    assert msgs["linear_colwise"] == (
        "module '', input '0': ranks disagree before the collective (debug check):\n"
        "  global_shape differs: (1, 4, 4) on ranks [0]; (1, 2, 4) on ranks [1]\n"
        "  local size of dim 1 differs: 2 on ranks [0]; 1 on ranks [1] "
        "(uneven shards: name '0' in the entry's 'uneven' field)")
    assert msgs["sp_block"].startswith("module 'up', input '0': ranks disagree before the collective")
    assert "local size of dim 1 differs: 2 on ranks [0]; 1 on ranks [1]" in msgs["sp_block"]


def test_debug_check_threaded_world4_seq7(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPLOWER_DEBUG", "1")
    results = run_threaded(4, _debug, 7, False)
    assert all(r == results[0] for r in results)
    assert "local size of dim 1 differs: 2 on ranks [0, 1, 2]; 1 on ranks [3]" in results[0]["sp_block"]
    assert results[0]["linear_colwise"].startswith("module '', input '0': ranks disagree")


def _wrong_pieces(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = parallelize(_seeded(nn.Linear(4, 8, bias=False)), mesh, _linear_plan(True))
    try:
        model(torch.ones(1, 1 + rank, 4))  # 1 + 2: not torch.chunk's 2 + 1
    except TPLowerError as exc:
        return str(exc)
    return "no error"


def test_declared_sizes_that_are_not_chunk_pieces_raise_alike() -> None:
    msgs = run_threaded(2, _wrong_pieces)
    assert msgs[0] == msgs[1] == ("module '', input '0': the local sizes of dim 1 along mesh axis 'tp' are [1, 2] "
                                  "(by mesh coordinate), not the torch.chunk pieces [2, 1] of 3")


def _unknown_name(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize(nn.Linear(4, 8), mesh, {"": {"style": "colwise", "uneven": ["x"]}})


def test_uneven_naming_no_declared_input_or_output_is_a_plan_error() -> None:
    with pytest.raises(RankFailure, match=r"plan\[''\]\.uneven: \['x'\] name no declared input or output"):
        run_threaded(2, _unknown_name)


@pytest.mark.parametrize("value", ["0", [True], ["0", 1.5], {"0": [1]}], ids=repr)
def test_uneven_field_schema(value: Any) -> None:
    with pytest.raises(TPLowerError, match=r"plan\['up'\]\.uneven: .* must be a list of input and output names"):
        resolve_entry({"style": "colwise", "uneven": value}, "up")
    assert resolve_entry({"style": "colwise", "uneven": [0, "out"]}, "up").uneven == ("0", "out")
