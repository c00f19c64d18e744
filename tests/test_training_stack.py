"""A parallelized model in the rest of a training stack, against one process and ``parallelize_module``.

Every test builds the same small pre-norm MLP block three ways: one process
(the oracle), PyTorch's ``parallelize_module`` (the convention tplower's
parameters follow), and :func:`tplower.parallelize`. Checked: ``state_dict``
and DCP checkpoints (round trip, into the unparallelized model, at another tp
size), ``get_state_dict``, ``clip_grad_norm_`` and optimizer steps (SGD,
AdamW foreach and fused), FSDP2 on the dp axis of a dp x tp mesh, activation
checkpointing and bf16 autocast; and the refusal of already sharded models.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from tplower import TPLowerError
from tplower.nn.parallelize import parallelize
from tplower.testing import run_processes, run_threaded

from blocks import PLAIN, SP, Block, D

B, T = 2, 4
TOL = {"atol": 2e-5, "rtol": 1e-4}






def _torch_plan(sp: bool) -> dict[str, Any]:
    if not sp:
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1))}


def _make(seed: int = 0, ckpt: bool = False) -> Block:
    """The block with weights from its own generator (threads share torch's global one)."""
    model = Block(ckpt)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def _x(seed: int = 1, batch: int = B) -> torch.Tensor:
    return torch.randn(batch, T, D, generator=torch.Generator().manual_seed(seed))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _variants(mesh: DeviceMesh, sp: bool, seed: int = 0, ckpt: bool = False) -> dict[str, nn.Module]:
    """One process, parallelize_module and tplower: three copies of the same block."""
    ref = _make(seed, ckpt)
    theirs = parallelize_module(copy.deepcopy(ref), mesh, _torch_plan(sp))
    ours = parallelize(copy.deepcopy(ref), mesh, SP if sp else PLAIN)
    return {"ref": ref, "torch": theirs, "tplower": ours}


def _cut(sp: bool, t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    return t.chunk(world, 1)[rank] if sp else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _out(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _local(model(x))


def _assert_params_equal(model: nn.Module, ref: nn.Module, label: str, **tol: float) -> None:
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(_full(p.detach()), want[name].detach(), **(tol or TOL),
                                   msg=lambda m, n=name: f"{label} {n}: {m}")


# ---- state_dict and DCP -------------------------------------------------------------------------------------

def _checkpoint_body(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    v = _variants(mesh, sp=True)
    ours, theirs = v["tplower"], v["torch"]
    sd, their_sd = ours.state_dict(), theirs.state_dict()
    assert list(sd) == list(their_sd)
    for k, t in sd.items():  # the same DTensors as parallelize_module's: placements, global shape, mesh
        assert isinstance(t, DTensor), k
        assert (t.placements, t.shape, t.device_mesh) == (their_sd[k].placements, their_sd[k].shape,
                                                            their_sd[k].device_mesh), k
        torch.testing.assert_close(t.to_local(), their_sd[k].to_local(), rtol=0, atol=0)
    # load_state_dict from another parallelized copy with other weights
    other = parallelize(_make(seed=5), mesh, SP)
    ours.load_state_dict(other.state_dict())
    _assert_params_equal(ours, _make(seed=5), "load_state_dict")
    # DCP round trip: save, scramble, load
    ours.load_state_dict(parallelize(_make(seed=7), mesh, SP).state_dict())
    dcp.save(ours.state_dict(), checkpoint_id=ckpt_dir)
    ours.load_state_dict(other.state_dict())
    sd = ours.state_dict()
    dcp.load(sd, checkpoint_id=ckpt_dir)
    ours.load_state_dict(sd)
    _assert_params_equal(ours, _make(seed=7), "DCP round trip")
    # the parallel model's output after the round trip, for the one-process reload
    return {"out": _out(ours, _x().chunk(world, 1)[rank]).detach().tolist()}  # plain data crosses processes


def _reshard_body(rank: int, world: int, ckpt_dir: str) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = parallelize(_make(seed=3), mesh, SP)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=ckpt_dir)
    model.load_state_dict(sd)
    _assert_params_equal(model, _make(seed=7), f"DCP load at tp={world}")
    want = _make(seed=7)(_x()).detach()
    torch.testing.assert_close(_out(model, _x().chunk(world, 1)[rank]), want.chunk(world, 1)[rank], **TOL)


@pytest.fixture
def ckpt_dir() -> Any:
    path = tempfile.mkdtemp(prefix="tplower-dcp-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_state_dict_and_dcp_round_trip_one_process_reload_and_reshard(ckpt_dir: str) -> None:
    outs = run_processes(2, _checkpoint_body, ckpt_dir)
    # DCP load into the unparallelized model, in this process, without a process group
    plain = _make(seed=0)
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=ckpt_dir, no_dist=True)
    plain.load_state_dict(sd)
    _assert_params_equal(plain, _make(seed=7), "one-process DCP load")
    full = plain(_x()).detach()
    torch.testing.assert_close(torch.cat([torch.tensor(o["out"]) for o in outs], 1), full, **TOL)
    # the same checkpoint into the model parallelized at tp=4
    run_threaded(4, _reshard_body, ckpt_dir)


# ---- optimizer state, clipping, optimizer steps -----------------------------------------------------------

_OPTS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.05, fused=True),
}


def _bit_identical_across_ranks(t: torch.Tensor) -> bool:
    local = t.detach().contiguous()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, local)
    return all(torch.equal(p, pieces[0]) for p in pieces)


def _train_body(rank: int, world: int, sp: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    norms: dict[str, list[float]] = {}
    for opt_name, make_opt in _OPTS.items():
        v = _variants(mesh, sp)
        if not sp:
            # parallelize_module leaves the norm's parameters plain here, and clip_grad_norm_ then refuses the
            # mix of DTensor and plain gradients; tplower's "replicate" style makes them Replicate DTensors.
            del v["torch"]
            v["tplower"] = parallelize(_make(), mesh, {"norm": "replicate", **PLAIN})
        opts = {k: make_opt(m.parameters()) for k, m in v.items()}
        for step in range(3):
            x = _x(10 + step)
            for k, m in v.items():
                opts[k].zero_grad()
                out = _out(m, x if k == "ref" else _cut(sp, x, world, rank))
                out.square().sum().backward()
                norm = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1.0)
                norms.setdefault(f"{opt_name}/{k}", []).append(float(_full(norm)))
                opts[k].step()
        for k in v.keys() - {"ref"}:
            _assert_params_equal(v[k], v["ref"], f"{opt_name} {k} after 3 steps", atol=1e-4, rtol=1e-4)
        for name, p in v["tplower"].named_parameters():
            if isinstance(p, DTensor) and p.placements == (Replicate(),):
                assert _bit_identical_across_ranks(p.to_local()), f"{opt_name}: {name} differs across ranks"
        if opt_name == "adamw_foreach" and sp:  # model and optimizer state through get_state_dict, as for torch's
            msd, osd = get_state_dict(v["tplower"], opts["tplower"])
            tmsd, tosd = get_state_dict(v["torch"], opts["torch"])
            assert set(msd) == set(tmsd) and set(osd["state"]) == set(tosd["state"])
            for k, st in osd["state"].items():
                for field in ("exp_avg", "exp_avg_sq"):
                    ours_t, theirs_t = st[field], tosd["state"][k][field]
                    assert isinstance(ours_t, DTensor) and ours_t.placements == theirs_t.placements, (k, field)
                    torch.testing.assert_close(ours_t.full_tensor(), theirs_t.full_tensor(), atol=1e-5, rtol=1e-4)
    return norms


def _stack_body(rank: int, world: int) -> dict[str, Any]:
    """The optimizer runs (plain and sequence parallel) and the precision checks, in one spawn of 2 gloo ranks (a
    failed check fails the spawn, and so each test that reads it, with the rank's traceback)."""
    _precision_body(rank, world)
    return {"plain": _train_body(rank, world, False), "sequence_parallel": _train_body(rank, world, True)}


@pytest.fixture(scope="module")
def stack() -> list[dict[str, Any]]:
    res: list[dict[str, Any]] = run_processes(2, _stack_body)
    return res


@pytest.mark.parametrize("part", ["plain", "sequence_parallel"])
def test_clip_grad_norm_and_optimizers_match_one_process(stack: list[dict[str, Any]], part: str) -> None:
    for norms in (r[part] for r in stack):
        for key, values in norms.items():
            opt, who = key.split("/")
            if who != "ref":  # the global norm, as one process computes it
                torch.testing.assert_close(torch.tensor(values), torch.tensor(norms[f"{opt}/ref"]),
                                           atol=1e-4, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


# ---- FSDP2 on the dp axis -----------------------------------------------------------------------------------

def _fsdp_body(rank: int, world: int, sp: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_coordinate()
    ntp = world // 2
    ref = _make()
    models = {"torch": parallelize_module(copy.deepcopy(ref), mesh["tp"], _torch_plan(sp)),
              "tplower": parallelize(copy.deepcopy(ref), mesh, SP if sp else PLAIN)}
    x = _x(2, batch=2 * B)
    want = ref(x)
    want.square().sum().backward()
    for label, model in models.items():
        fully_shard(model, mesh=mesh["dp"])
        mine = x.chunk(2, 0)[dp]
        out = _out(model, mine.chunk(ntp, 1)[tp] if sp else mine)
        out.square().sum().backward()  # FSDP2 averages over dp: half the one-process gradient of the sum
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            assert p.grad is not None, (label, name)
            torch.testing.assert_close(_full(p.grad), ref_params[name].grad / 2, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, n=name, lb=label: f"FSDP2 {lb} {n} grad: {m}")
    # whole tensors into FSDP2's dp shards of tensor-parallel shards (_StridedShard over dp, Shard over tp): a resume
    models["tplower"].load_state_dict(_make(seed=5).state_dict())
    _assert_params_equal(models["tplower"], _make(seed=5), "load_state_dict of whole tensors under FSDP2")


@pytest.mark.parametrize("sp", [False, True], ids=["plain", "sequence_parallel"])
def test_fsdp2_on_dp_of_dp_tp_mesh_matches_one_process(sp: bool) -> None:
    run_threaded(4, _fsdp_body, sp)


# ---- activation checkpointing, autocast ------------------------------------------------------------------------

def _precision_body(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for sp in (False, True):
        v = _variants(mesh, sp, ckpt=True)
        x = _x(3)
        grads = {}
        for k, m in v.items():
            xin = (x if k == "ref" else _cut(sp, x, world, rank)).clone().requires_grad_()
            _out(m, xin).square().sum().backward()
            grads[k] = xin.grad
        _assert_grads(v, sp, world, rank, "checkpoint")
        torch.testing.assert_close(grads["tplower"], _cut(sp, grads["ref"], world, rank), **TOL)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the block without its float32 residual
            outs = {k: _local(m._mlp(x if k == "ref" else _cut(sp, x, world, rank)))  # type: ignore[operator]
                    for k, m in v.items()}
        assert {o.dtype for o in outs.values()} == {torch.bfloat16}, {k: o.dtype for k, o in outs.items()}
        torch.testing.assert_close(outs["tplower"], outs["torch"], atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(outs["tplower"], _cut(sp, outs["ref"], world, rank), atol=6e-2, rtol=2e-2)


def _assert_grads(v: dict[str, nn.Module], sp: bool, world: int, rank: int, label: str) -> None:
    ref = dict(v["ref"].named_parameters())
    for name, p in v["tplower"].named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(_full(p.grad), ref[name].grad, **TOL, msg=lambda m, n=name: f"{label} {n}: {m}")


def test_activation_checkpointing_and_bf16_autocast_match_one_process(stack: list[dict[str, Any]]) -> None:
    assert len(stack) == 2  # each rank compared against one process in the shared spawn (_precision_body's checks)


# ---- refusals ---------------------------------------------------------------------------------------------------

def _refusal_body(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    msgs = []
    theirs = parallelize_module(_make(), mesh, _torch_plan(False))
    with pytest.raises(TPLowerError, match="module 'up': parameter 'weight' is already a DTensor") as e1:
        parallelize(theirs, mesh, PLAIN)
    msgs.append(str(e1.value))
    ours = parallelize(_make(), mesh, PLAIN)
    with pytest.raises(TPLowerError, match="already parallelized") as e2:
        parallelize(ours, mesh, PLAIN)
    msgs.append(str(e2.value))
    return msgs


def test_already_sharded_models_are_refused_naming_the_module() -> None:
    for msgs in run_threaded(2, _refusal_body):
        assert "Shard(dim=0)" in msgs[0] or "S(0)" in msgs[0], msgs[0]

