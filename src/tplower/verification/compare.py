"""Reading local tensors back to global values by their placements, comparing them, and naming likely causes.

Every function here is collective over the mesh and reaches its collectives
alike on every rank (verdicts are reduced over the ranks before any branch
that issues another collective).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = ["Comparer", "bias_cause", "grad_cause", "param_cause"]

Placements = tuple[Placement, ...]


@dataclass(frozen=True)
class Comparer:
    """Compares on one mesh: reads local tensors back by placements, reduces verdicts over the ranks."""

    mesh: DeviceMesh
    atol: float
    rtol: float

    def allmax(self, x: float) -> float:
        t = torch.tensor([math.inf if math.isnan(x) else x], dtype=torch.float64)
        dist.all_reduce(t, dist.ReduceOp.MAX, group=self.mesh.get_group(0))
        return float(t[0])

    def local_shape(self, shape: Sequence[int], place: Placements) -> tuple[int, ...]:
        out = list(shape)
        coord = self.mesh.get_coordinate()
        assert coord is not None
        for i, p in enumerate(place):
            if isinstance(p, Shard):
                n, c = self.mesh.size(i), coord[i]
                size = out[p.dim]
                step = -(-size // n)
                out[p.dim] = max(0, min(size, (c + 1) * step) - c * step)
        return tuple(out)

    def read(self, local: torch.Tensor, place: Placements, ref: torch.Tensor) -> torch.Tensor | None:
        """The global value of ``local`` under ``place`` (``None`` on every rank when a rank's shape is wrong)."""
        want = self.local_shape(ref.shape, place)
        if self.allmax(0.0 if tuple(local.shape) == want else 1.0) > 0:
            return None
        if all(isinstance(p, Replicate) for p in place):
            return local.detach()
        stride = torch.empty(ref.shape).stride()
        dt = DTensor.from_local(local.detach().contiguous(), self.mesh, place, run_check=False,
                                shape=ref.shape, stride=stride)
        return dt.full_tensor()

    def diff(self, got: torch.Tensor | None, ref: torch.Tensor, floor: float = 0.0) -> tuple[float, bool]:
        """Largest |got - ref| over all ranks, and whether ``got`` is within the tolerances everywhere.

        ``floor``: the least scale ``rtol`` applies to (a gradient that is zero
        in exact arithmetic, such as attention's key bias, is rounding noise
        the size of its module's other gradients).
        """
        if got is None or got.shape != ref.shape:
            d, bad = math.inf, 1.0
        else:
            a, b = got.double(), ref.double()
            err = (a - b).abs()
            d = float(err.max()) if err.numel() else 0.0
            scale = max(float(b.abs().max()) if b.numel() else 0.0, floor)
            bad = 0.0 if bool((err <= self.atol + self.rtol * scale).all()) else 1.0
        return self.allmax(d), self.allmax(bad) == 0.0

    def allowed(self, ref: torch.Tensor | None, floor: float = 0.0) -> float:
        """The largest difference :meth:`diff` lets pass for the one-process tensor ``ref``: ``atol + rtol *
        max(max|ref|, floor)`` (``atol`` alone for no tensor)."""
        scale = float(ref.detach().abs().max()) if ref is not None and ref.numel() else 0.0
        return self.atol + self.rtol * max(scale, floor)

    def compare(self, local: torch.Tensor | None, place: Placements, ref: torch.Tensor,
                floor: float = 0.0) -> tuple[float, bool]:
        if self.allmax(0.0 if local is not None else 1.0) > 0:
            return math.inf, False
        assert local is not None
        return self.diff(self.read(local, place, ref), ref, floor)


def _multiple(got: torch.Tensor | None, ref: torch.Tensor, cmp: Comparer) -> float | None:
    """``k`` when ``got`` is ``k`` times ``ref`` on every rank, ``k`` (or ``1/k``) whole and not 1; else ``None``.

    ``got`` may differ across ranks (a gradient declared ``R``), so each rank finds its own ``k`` and the
    ranks agree on it (a collective every rank reaches alike).
    """
    k_local = 0.0
    if got is not None and got.shape == ref.shape:
        a, b = got.double().flatten(), ref.double().flatten()
        den = float(b @ b)
        k = float(a @ b) / den if den else 0.0
        cands = [float(round(k))] + ([1 / round(1 / k)] if abs(k) > 1e-12 and round(1 / k) else [])
        for cand in cands:
            err = (a - cand * b).abs()
            scale = abs(cand) * float(b.abs().max())
            if cand not in (0.0, 1.0) and bool((err <= cmp.atol + cmp.rtol * scale).all()):
                k_local = cand
                break
    hi, lo = cmp.allmax(k_local), -cmp.allmax(-k_local)
    return hi if hi == lo and hi != 0.0 else None


def _tp_name(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names
    return names[0] if names else "tp"


def grad_cause(local: torch.Tensor, place: Placements, ref: torch.Tensor, cmp: Comparer, field_name: str,
                qual: str, name: str, bias: str | None) -> tuple[str | None, str | None]:
    """(cause, plan change) for a gradient that diverges, from what the numbers say.

    ``bias``: the boundary's deferred bias; it is added after the output move, so an output gradient
    made partial-aware (``out_grad: P(sum)``) needs the bias gradient reduced too.
    """
    n, axis = cmp.mesh.size(), _tp_name(cmp.mesh)

    def entry(place: str) -> str:
        text = f"in the plan entry for {qual!r} add  {field_name}: {{{name!r}: {{{axis}: {place}}}}}"
        if bias is not None and field_name == "out_grad" and place == '"P(sum)"':
            text += f", param_grads: {{{bias!r}: {{{axis}: \"P(sum)\"}}}}"
        return text

    if all(isinstance(p, Replicate) for p in place):
        if cmp.compare(local, (Partial("sum"),), ref)[1]:
            return ("gradient placement R where P(sum) belongs: each rank holds a partial gradient and only their "
                    f"sum over {axis!r} is the right one", entry('"P(sum)"'))
    if any(isinstance(p, Partial) for p in place):
        if cmp.compare(local, (Replicate(),), ref)[1]:
            return ("gradient placement P(sum) where R belongs: the gradient is already whole on every rank, so "
                    f"reading it as partial sums it {n} times", entry('"R"'))
    k = _multiple(cmp.read(local, place, ref), ref, cmp)
    if k is not None and k == n:
        return (f"the gradient is {n}x the right one: it is summed over {n} ranks once too often (P(sum) where R "
                "belongs, or a reduction applied twice)", entry('"R"'))
    if k is not None and abs(k * n - 1) < 1e-9:
        return (f"the gradient is 1/{n} of the right one: a reduction is missing (R where P(sum) belongs)",
                entry('"P(sum)"'))
    if k is not None:
        return f"the gradient is {k:g}x the right one", None
    return None, None


def bias_cause(got: torch.Tensor | None, ref: torch.Tensor, bias: torch.Tensor | None, n: int,
                cmp: Comparer, qual: str) -> tuple[str | None, str | None]:
    if got is None or bias is None or got.shape != ref.shape:
        return None, None
    try:
        expect = ref.double() + (n - 1) * bias.detach().double()
    except RuntimeError:
        return None, None
    if cmp.diff(got, expect.expand_as(ref))[1]:
        return (f"a bias added on every rank: the output is off by {n - 1}x the bias of {qual!r} (its output stays "
                "partial, so the bias is in every rank's part)",
                f"in the plan entry for {qual!r} drop deferred_bias and reduce the output first "
                "(style rowwise), or use a module without bias")
    return None, None



def param_cause(local: torch.Tensor, place: Placements, want: torch.Tensor, cmp: Comparer, qual: str,
                 pname: str) -> tuple[str | None, str | None]:
    n, axis = cmp.mesh.size(), _tp_name(cmp.mesh)
    got = cmp.read(local, place, want)
    k = _multiple(got, want, cmp)
    if k is not None and k == n and pname.endswith("bias"):
        return (f"a bias added on every rank: the gradient of {pname!r} is {n}x the right one",
                f"in the plan entry for {qual!r} drop deferred_bias and reduce the output first (style rowwise), "
                "or use a module without bias")
    if all(isinstance(p, Replicate) for p in place):
        hi = cmp.read(local, (Partial("max"),), want)
        lo = cmp.read(local, (Partial("min"),), want)
        spread = float((hi - lo).abs().max()) if hi is not None and lo is not None and hi.numel() else 0.0
        summed_ok = cmp.compare(local, (Partial("sum"),), want)[1]
        if spread > cmp.atol or summed_ok:
            how = "its sum over the ranks is the right one" if summed_ok else "no rank has the right one"
            return (f"a missing reduction: the replicated parameter {pname!r} gets a different gradient on each "
                    f"rank (spread {spread:.3g}); {how}",
                    f"in the plan entry for {qual!r} add  param_grads: {{{pname!r}: {{{axis}: \"P(sum)\"}}}} "
                    "(a norm on sequence-sharded activations: style sequence_parallel)")
    if k is not None:
        return f"the gradient is {k:g}x the right one", None
    return None, None

