"""Uneven activation dims at ``parallelize`` boundaries: declared ``uneven``, undeclared, debug and compiled.

A sequence that does not divide over tp (3 and 5 on 2 ranks, 7 on 4) is cut
as ``torch.chunk`` cuts it (5 on 2 = 3 + 2, 7 on 4 = 2 + 2 + 2 + 1). Two
models, each against one process (forward output, input gradient, every
parameter gradient): a colwise ``nn.Linear`` whose input arrives sharded on
the sequence, and a pre-norm sequence-parallel MLP block
(norm -> colwise -> rowwise). Declared or not, eagerly the ranks exchange the
sizes of a sharded input dim that the plan cannot know (a sequence) and
match one process; sizes that are not ``torch.chunk`` pieces raise the same
error on every rank. Under ``torch.compile`` an undeclared dim is checked in
the graph (no graph break): uneven, every rank raises the same error before
any collective of the data, never a wrong shape or a backend abort.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tplower import TPLowerError
from tplower.nn.parallelize import parallelize
from tplower.plans.entries import resolve_entry
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


def _parity(rank: int, world: int, name: str, seq: int, declared: bool) -> tuple[int, ...]:
    """One model at one sequence length against one process; returns this rank's local output shape."""
    make, plan, shape, out_dim = MODELS[name]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ref = _seeded(make())
    ours = parallelize(_seeded(make()), mesh, plan(declared))
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
    return tuple(out.shape)


def _parity_all(rank: int, world: int, seqs: list[int]) -> list[tuple[int, ...]]:
    return [_parity(rank, world, name, seq, declared) for declared in (True, False) for name in MODELS
            for seq in seqs]


def _gloo_world2(rank: int, world: int) -> dict[str, Any]:
    """Everything the gloo checks need, in one spawn: parity at sequences 3 and 5, then compiled."""
    return {"parity": _parity_all(rank, world, [3, 5]), "compiled": _compiled(rank, world)}


@pytest.fixture(scope="module")
def gloo_world2() -> list[dict[str, Any]]:
    return run_processes(2, _gloo_world2, timeout=300)


def test_uneven_sequence_matches_one_process_declared_or_not_gloo_world2_seq3_and_5(
        gloo_world2: list[dict[str, Any]]) -> None:
    # output shapes by (declared, model, seq): the linear's [1, seq_r, 8 / 2], the block's [2, seq_r, 8], where
    # seq_r are torch.chunk's pieces: 3 = 2 + 1, 5 = 3 + 2
    for rank, pieces in enumerate(([2, 3], [1, 2])):
        want = [(1, seq, 4) for seq in (3, 5)] + [(2, p, 8) for p in pieces]
        assert gloo_world2[rank]["parity"] == want + want


def test_uneven_sequence_matches_one_process_threaded_world4_seq7() -> None:
    shapes = run_threaded(4, _parity_all, [7])
    assert [s[1][1] for s in shapes] == [2, 2, 2, 1]  # 7 = 2 + 2 + 2 + 1 (the block's output, declared)


def test_uneven_sequence_under_the_debug_check_matches_one_process_threaded_world4_seq7(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPLOWER_DEBUG", "1")
    shapes = run_threaded(4, _parity_all, [7])
    assert [s[3][1] for s in shapes] == [2, 2, 2, 1]  # the block's output, undeclared


def _wrong_pieces(rank: int, world: int, declared: bool) -> str:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = parallelize(_seeded(nn.Linear(4, 8, bias=False)), mesh, _linear_plan(declared))
    try:
        model(torch.ones(1, 1 + rank, 4))  # 1 + 2: not torch.chunk's 2 + 1
    except TPLowerError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
def test_sizes_that_are_not_chunk_pieces_raise_alike(declared: bool) -> None:
    msgs = run_threaded(2, _wrong_pieces, declared)
    assert msgs[0] == msgs[1] == ("module '', input '0': the local sizes of dim 1 along mesh axis 'tp' are [1, 2] "
                                  "(by mesh coordinate), not the torch.chunk pieces [2, 1] of 3")


def _compiled(rank: int, world: int) -> dict[str, Any]:
    """The undeclared linear compiled (aot_eager, fullgraph): even sequences as eager, an uneven one an error."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = parallelize(_seeded(nn.Linear(4, 8, bias=False)), mesh, _linear_plan(False))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(1, 4, 4, generator=torch.Generator().manual_seed(2)).chunk(world, 1)[rank]
    even = float((compiled(x) - model(x)).abs().max())
    try:
        compiled(torch.randn(1, 3, 4).chunk(world, 1)[rank])
        uneven = "no error"
    except RuntimeError as exc:
        uneven = str(exc)
    return {"even": even, "uneven": uneven}


def test_compiled_uneven_sequence_raises_alike_and_an_even_one_traces_whole(
        gloo_world2: list[dict[str, Any]]) -> None:
    for r in gloo_world2:
        assert r["compiled"]["even"] == 0.0
        assert ("module '', input '0': the local sizes of dim 1 along mesh axis 'tp' differ between ranks under "
                "torch.compile; name it in the entry's 'uneven' field") in r["compiled"]["uneven"]


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
