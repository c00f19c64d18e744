"""Meshes whose process groups order ranks unlike the mesh: shards must follow mesh coordinates.

The reference is single-process: every rank's input is its ``torch.chunk``
piece of one seeded global tensor at its *mesh coordinate* (partial values
are weighted pieces that sum to it), the expected output is the piece of the
same global tensor under ``dst``, and the expected input gradient is the
piece of the global gradient under ``src``.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Shard

from tplower import parse_placements, redistribute_local
from tplower.core.language.placements import replicate_partials
from tplower.testing import run_threaded


def _piece(t, placements, mesh_shape, coord):
    for p, n, c in zip(placements, mesh_shape, coord, strict=True):
        if isinstance(p, Shard):
            chunks = torch.chunk(t, n, dim=p.dim)
            t = chunks[c] if c < len(chunks) else t.narrow(p.dim, t.size(p.dim), 0)
    return t


def _weight(placements, mesh_shape, coord):
    w = 1.0
    for p, n, c in zip(placements, mesh_shape, coord, strict=True):
        if isinstance(p, Partial):
            w *= (c + 1) / (n * (n + 1) / 2)  # weights over the axis sum to 1
    return w


def _body(rank, world, ranks, names, cases):
    del rank, world
    mesh = DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=names)
    coord = mesh.get_coordinate()
    shape = tuple(mesh.shape)
    bad = []
    for gshape, src_s, dst_s in cases:
        src = parse_placements(src_s, names, tensor_ndim=len(gshape))
        dst = parse_placements(dst_s, names, tensor_ndim=len(gshape))
        t = torch.randn(gshape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        g = torch.randn(gshape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        x = (_piece(t, src, shape, coord) * _weight(src, shape, coord)).requires_grad_(True)
        out = redistribute_local(x, mesh, src, dst, global_shape=gshape)
        out.backward(_piece(g, dst, shape, coord))
        ok_out = torch.allclose(out, _piece(t, dst, shape, coord))
        ok_grad = torch.allclose(x.grad, _piece(g, replicate_partials(src), shape, coord))
        if not (ok_out and ok_grad):
            bad.append((gshape, src_s, dst_s, ok_out, ok_grad))
    return bad


def _cases(ndim_mesh):
    srcs = ["R", "S(0)", "S(1)", "P(sum)"]
    dsts = ["R", "S(0)", "S(1)"]
    combos_src = [",".join(c) for c in itertools.product(srcs, repeat=ndim_mesh)]
    combos_dst = [",".join(c) for c in itertools.product(dsts, repeat=ndim_mesh)]
    return [(shape, s, d) for shape in [(5, 3), (3, 7), (4, 4)] for s in combos_src for d in combos_dst
            if s.count("P") <= 1]


def test_permuted_1d_world2():
    for bad in run_threaded(2, _body, [1, 0], ("tp",), _cases(1)):
        assert not bad, bad


def test_permuted_1d_world4():
    for bad in run_threaded(4, _body, [3, 1, 0, 2], ("tp",), _cases(1)):
        assert not bad, bad


def test_permuted_2d_both_axes():
    for bad in run_threaded(4, _body, [[3, 2], [1, 0]], ("dp", "tp"), _cases(2)):
        assert not bad, bad
