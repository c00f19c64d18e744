"""Packed parameters (``_StridedShard``: fused gate/up, tensor-parallel expert weights) through DCP.

Saved at one layout and loaded at another and into one process, against the one-process weights bit for bit:
tp=2 -> one process, one process -> tp=2, tp=2 -> tp=4 (threaded ranks), and a real
mixture-of-experts model (Qwen3-MoE, ``"auto"``, gloo processes) saved at tp=2 and read back in one process and
at tp=2.
"""

from __future__ import annotations

import copy
import hashlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import tplower
from tplower.run.hf_table import architectures, input_ids, tiny_model
from tplower.state.packed_checkpoint import PackedLocal
from tplower.testing import run_processes, run_threaded

PLAN = {"experts": "moe_tp_experts", "experts.gate_up_proj": "packed_colwise", "experts.down_proj": "rowwise"}


class _Experts(nn.Module):
    """Two experts, ``[experts, gate; up, hidden]`` and ``[experts, hidden, intermediate]``, intermediate 4."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up_proj = nn.Parameter(torch.randn(2, 8, 4, generator=g))
        self.down_proj = nn.Parameter(torch.randn(2, 4, 4, generator=g))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("th,eih->tei", x, self.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("tei,ehi->teh", nn.functional.silu(gate) * up, self.down_proj)
        return (y.gather(1, ids[..., None].expand(-1, -1, y.shape[-1])) * w[..., None]).sum(1)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = _Experts()

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.experts(x, ids, w)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def _full_digests(model: nn.Module) -> dict[str, str]:
    return {k: _digest(v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}


def _zeroed(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _save(rank: int, world: int, folder: str) -> bool:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = tplower.parallelize(_Block(), mesh, PLAN)
    sd = model.state_dict()
    dcp.save(sd, checkpoint_id=folder)
    return isinstance(sd["experts.gate_up_proj"]._local_tensor, PackedLocal)


def _load(rank: int, world: int, folder: str) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = _zeroed(tplower.parallelize(_Block(), mesh, PLAN))
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=folder)
    model.load_state_dict(sd)
    return _full_digests(model)


def test_packed_parameters_save_at_tp2_and_load_in_one_process_and_at_tp4(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpt")
    assert run_threaded(2, _save, folder) == [True, True]  # the state dict gives the boxes
    want = _full_digests(_Block())
    one = _zeroed(_Block())
    sd = one.state_dict()
    dcp.load(sd, checkpoint_id=folder, no_dist=True)
    one.load_state_dict(sd)
    assert _full_digests(one) == want
    for got in run_threaded(4, _load, folder):  # another tp reads the same global rows
        assert got == want


def test_one_process_checkpoint_loads_into_packed_parameters(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpt")
    dcp.save(_Block().state_dict(), checkpoint_id=folder, no_dist=True)
    want = _full_digests(_Block())
    for got in run_threaded(2, _load, folder):
        assert got == want


def _moe(rank: int, world: int, folder: str) -> float:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ref = tiny_model(architectures(["qwen3_moe"])[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = tplower.parallelize(copy.deepcopy(ref), mesh, "auto")
        loaded = _zeroed(tplower.parallelize(copy.deepcopy(ref), mesh, "auto"))
    dcp.save(saved.state_dict(), checkpoint_id=folder)
    sd = loaded.state_dict()
    dcp.load(sd, checkpoint_id=folder)
    loaded.load_state_dict(sd)
    ids = input_ids()
    with torch.no_grad():
        return float((loaded(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max())


@pytest.mark.slow  # the synthetic expert block checks the same boxes
def test_moe_model_checkpoint_round_trip(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpt")
    for diff in run_processes(2, _moe, folder):
        assert diff <= 1e-5, diff
    ref: Any = tiny_model(architectures(["qwen3_moe"])[0])
    one = _zeroed(copy.deepcopy(ref))
    sd = one.state_dict()
    dcp.load(sd, checkpoint_id=folder, no_dist=True)
    for key, value in ref.state_dict().items():
        assert torch.equal(sd[key], value), key
