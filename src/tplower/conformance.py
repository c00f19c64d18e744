"""DTensor as the oracle: run one transition both ways and compare, forward and backward.

A :class:`Case` is ``(mesh shape, global shape, src, dst, grad, dtype)``.
:func:`check_case` runs on every rank of a live mesh: it builds this rank's
local input from a seeded global tensor (shards cut with ``torch.chunk``
directly, partial values perturbed per coordinate), runs DTensor
(``from_local -> redistribute -> to_local(grad_placements=grad)``, then
``backward`` with a seeded local gradient) and :func:`tplower.redistribute_local`
on the same input and gradient, and compares the local output and the local
input gradient. One idea, the oracle: the check of one case and the
enumerations of cases (:func:`one_axis_cases`, :func:`random_cases`) it runs.

Where DTensor's ``redistribute`` refuses a pair that tplower lowers
(``S(d) -> P``), the oracle is the meaning of the placements instead: the
output, redistributed to ``R`` by DTensor, must equal the input's full
tensor, and the input gradient must equal DTensor's redistribution of the
gradient to ``src`` with ``Partial`` read as ``Replicate``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .core.language.placements import LINEAR_REDUCE_OPS, parse_placements, replicate_partials
from .core.lower.redistribute import mesh_lowerer, redistribute_local
from .core.support.argcheck import check_bool, check_mesh, check_shape, describe

__all__ = [
    "Case",
    "CaseFailure",
    "CaseResult",
    "check_case",
    "check_cases",
    "failures",
    "grads_for",
    "make_mesh",
    "mixable",
    "one_axis_cases",
    "quiet_dtensor_logs",
    "random_cases",
    "summarize",
]

_TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12), torch.bfloat16: (2e-2, 2e-2),
        torch.float16: (2e-3, 2e-3)}
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Case:
    """One transition to check; placements as canonical comma lists.

    Raises:
        TypeError: a shape that is not a sequence of ints, placements that
            are not strings, or ``contiguous`` not a bool.
        ValueError: ``dtype`` not one of float32, float64, bfloat16, float16.
    """

    mesh_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    src: str
    dst: str
    grad: str | None = None
    dtype: str = "float32"
    contiguous: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "mesh_shape", check_shape(self.mesh_shape, "mesh_shape", "Case"))
        object.__setattr__(self, "global_shape", check_shape(self.global_shape, "global_shape", "Case"))
        for name in ("src", "dst", "grad", "dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) and not (name == "grad" and value is None):
                raise TypeError(f"Case: {name} must be a str" + (" or None" if name == "grad" else "")
                                + f", got {describe(value)}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"Case: dtype={self.dtype!r}; allowed: {', '.join(_DTYPES)}")
        check_bool(self.contiguous, "contiguous", "Case")

    @property
    def id(self) -> str:
        """Readable id, e.g. ``2x2 (5,3,2) S(0),R->R,R g=R,R float32``."""
        mesh = "x".join(map(str, self.mesh_shape))
        shape = ",".join(map(str, self.global_shape))
        grad = f" g={self.grad}" if self.grad else ""
        nc = " strided" if not self.contiguous else ""
        return f"{mesh} ({shape}) {self.src}->{self.dst}{grad} {self.dtype}{nc}"


@dataclass(frozen=True)
class CaseResult:
    """What :func:`check_case` found on one rank.

    ``status``: ``match`` (equal to DTensor), ``match_semantic`` (DTensor
    refuses the pair; tplower equals the placements' meaning),
    ``both_raise``, ``mismatch``, ``tplower_raises`` or ``modified_input``.
    ``lowered``: tplower ran its own collectives (not the DTensor fallback).
    """

    case: Case
    status: str
    lowered: bool
    detail: str = ""

    @property
    def ok(self) -> bool:
        """Whether the case passed on this rank."""
        return self.status in ("match", "match_semantic", "both_raise")


def make_mesh(mesh_shape: Sequence[int], device_type: str = "cpu") -> DeviceMesh:
    """A mesh over all ranks with axes named ``dim0``, ``dim1``, ... (``tp`` for a 1-D mesh).

    Raises:
        TypeError: ``mesh_shape`` is not a sequence of ints.
    """
    mesh_shape = check_shape(mesh_shape, "mesh_shape", "make_mesh")
    names = ("tp",) if len(mesh_shape) == 1 else tuple(f"dim{i}" for i in range(len(mesh_shape)))
    return init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=names)


def _values(shape: Sequence[int], seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64).to(dtype)


def _seed(base: int, placements: Sequence[Placement], coord: Sequence[int], *, keep: type) -> int:
    # Ranks that must hold the same values (Replicate axes) get the same seed.
    key = [c if not isinstance(p, Replicate) and isinstance(p, keep) else -1
           for p, c in zip(placements, coord, strict=True)]
    return base + hash(tuple(key)) % 100_003


def _local_input(case: Case, mesh: DeviceMesh, src: Sequence[Placement], dtype: torch.dtype) -> torch.Tensor:
    coord = mesh.get_coordinate()
    assert coord is not None
    t = _values(case.global_shape, 1, dtype)
    for p, n, c in zip(src, mesh.shape, coord, strict=True):
        if isinstance(p, Shard):
            pieces = torch.chunk(t, n, dim=p.dim)
            t = pieces[c] if c < len(pieces) else t.narrow(p.dim, t.size(p.dim), 0)
    if any(isinstance(p, Partial) for p in src):
        t = t + _values(t.shape, _seed(7, src, coord, keep=Partial), dtype)
    return t.contiguous().to(mesh.device_type)


def _strided(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 0:
        return t
    wide = t.new_zeros(t.shape[:-1] + (2 * t.shape[-1],))
    wide[..., ::2] = t
    return wide[..., ::2]


def _dtensor_run(local: torch.Tensor, mesh: DeviceMesh, src: tuple[Placement, ...], dst: tuple[Placement, ...],
                 grad: tuple[Placement, ...], gshape: tuple[int, ...],
                 grad_seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    x = local.clone().requires_grad_(local.dtype.is_floating_point)
    stride = torch.empty(gshape, device="meta").stride()
    dt = DTensor.from_local(x, mesh, src, run_check=False, shape=torch.Size(gshape), stride=stride)
    out = dt.redistribute(mesh, dst).to_local(grad_placements=grad)
    if x.requires_grad:
        out.backward(_values(out.shape, grad_seed, local.dtype).to(local.device))
    return out.detach(), x.grad


def _full(local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...],
          gshape: tuple[int, ...]) -> torch.Tensor:
    stride = torch.empty(gshape, device="meta").stride()
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(gshape), stride=stride)
    return dt.full_tensor()


def _moved(local: torch.Tensor, mesh: DeviceMesh, src: tuple[Placement, ...], dst: tuple[Placement, ...],
           gshape: tuple[int, ...]) -> torch.Tensor:
    stride = torch.empty(gshape, device="meta").stride()
    dt = DTensor.from_local(local, mesh, src, run_check=False, shape=torch.Size(gshape), stride=stride)
    return dt.redistribute(mesh, dst).to_local()


def _close(a: torch.Tensor | None, b: torch.Tensor | None, dtype: torch.dtype) -> bool:
    if a is None or b is None:
        return a is None and b is None
    atol, rtol = _TOL.get(dtype, (0.0, 0.0))
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=atol, rtol=rtol))


def check_case(case: Case, mesh: DeviceMesh) -> CaseResult:
    """Run ``case`` with DTensor and with tplower on this rank of ``mesh``; compare.

    Must be called on every rank of ``mesh`` with the same case.

    Raises:
        TypeError: ``case`` is not a :class:`Case` or ``mesh`` not a
            ``DeviceMesh`` (before any collective).
    """
    if not isinstance(case, Case):
        raise TypeError(f"check_case: case must be a tplower.conformance.Case, got {describe(case)}")
    check_mesh(mesh, "mesh", "check_case")
    dtype = _DTYPES[case.dtype]
    nd = len(case.global_shape)
    names = mesh.mesh_dim_names
    src = parse_placements(case.src, names, tensor_ndim=nd, arg="src")
    dst = parse_placements(case.dst, names, tensor_ndim=nd, arg="dst")
    grad = replicate_partials(dst) if case.grad is None else parse_placements(case.grad, names, tensor_ndim=nd)
    coord = mesh.get_coordinate()
    assert coord is not None
    gshape = case.global_shape
    local = _local_input(case, mesh, src, dtype)
    grad_seed = _seed(11, grad, coord, keep=object)
    try:
        ref_out, ref_grad = _dtensor_run(local, mesh, src, dst, grad, gshape, grad_seed)
        ref_err = None
    except Exception as exc:  # DTensor refuses the pair
        ref_out, ref_grad, ref_err = None, None, exc
    x = local if case.contiguous else _strided(local)
    before = x.clone()
    x = x.detach().requires_grad_(dtype.is_floating_point)
    try:
        prog = mesh_lowerer(mesh).program(case.src, case.dst, x.shape, x.device.type, grad=case.grad,
                                          global_shape=gshape)
        lowered = prog.fallback_reason is None
        out = redistribute_local(x, mesh, case.src, dst=case.dst, grad=case.grad, global_shape=gshape)
        if x.requires_grad:
            out.backward(_values(out.shape, grad_seed, dtype).to(x.device))
    except Exception as exc:
        if ref_err is not None:
            return CaseResult(case, "both_raise", False, f"{type(ref_err).__name__} / {type(exc).__name__}: {exc}")
        return CaseResult(case, "tplower_raises", False, f"{type(exc).__name__}: {exc}")
    if not torch.equal(x.detach(), before):
        return CaseResult(case, "modified_input", lowered, "the input changed")
    if ref_err is None:
        if not _close(out.detach(), ref_out, dtype):
            return CaseResult(case, "mismatch", lowered, f"forward differs: {out} vs {ref_out}")
        if not _close(x.grad, ref_grad, dtype):
            return CaseResult(case, "mismatch", lowered, f"backward differs: {x.grad} vs {ref_grad}")
        return CaseResult(case, "match", lowered)
    # DTensor refuses: compare with the meaning of the placements.
    want = _full(local, mesh, src, gshape)
    got = _full(out.detach(), mesh, dst, gshape)
    if not _close(got, want, dtype):
        return CaseResult(case, "mismatch", lowered, f"global value differs (DTensor refuses: {ref_err})")
    if x.requires_grad:
        g = _values(out.shape, grad_seed, dtype).to(x.device)
        want_grad = _moved(g, mesh, grad, replicate_partials(src), gshape)
        if not _close(x.grad, want_grad, dtype):
            return CaseResult(case, "mismatch", lowered, f"gradient differs (DTensor refuses: {ref_err})")
    return CaseResult(case, "match_semantic", lowered, f"DTensor: {type(ref_err).__name__}: {ref_err}")


class CaseFailure(AssertionError):
    """A case failed on this rank (``check_cases(..., fail_fast=True)``); ``result`` is its :class:`CaseResult`."""

    def __init__(self, result: CaseResult) -> None:
        self.result = result
        super().__init__(f"{result.case.id}: {result.status}: {result.detail[:300]}")


def check_cases(rank: int, world_size: int, cases: Sequence[Case],
                meshes: dict[tuple[int, ...], DeviceMesh] | None = None, *,
                fail_fast: bool = False) -> list[CaseResult]:
    """Rank body for the harnesses: check every case, one mesh per mesh shape (kept in ``meshes``).

    With ``fail_fast`` the first case that fails on this rank raises
    :class:`CaseFailure` there: the harness then ends the other ranks at once
    (:func:`tplower.testing.run_processes`), where otherwise they could wait
    in the next case's collective for the process group's timeout (a rank
    whose tplower call raised has left a peer inside a collective). Use
    ``functools.partial(check_cases, fail_fast=True)`` as the harness body.

    Raises:
        TypeError: ``cases`` is not a sequence of :class:`Case` (before any collective).
        ValueError: a case needs another number of ranks than ``world_size``.
        CaseFailure: with ``fail_fast``, a case failed on this rank.
    """
    del rank
    if not isinstance(cases, Sequence) or not all(isinstance(c, Case) for c in cases):
        raise TypeError(f"check_cases: cases must be a sequence of tplower.conformance.Case, got {describe(cases)}")
    quiet_dtensor_logs()
    meshes = {} if meshes is None else meshes
    results = []
    for case in cases:
        size = 1
        for s in case.mesh_shape:
            size *= s
        if size != world_size:
            raise ValueError(f"case {case.id} needs {size} ranks, the world has {world_size}")
        mesh = meshes.get(case.mesh_shape)
        if mesh is None:
            mesh = meshes[case.mesh_shape] = make_mesh(case.mesh_shape)
        result = check_case(case, mesh)
        if fail_fast and not result.ok:
            raise CaseFailure(result)
        results.append(result)
    return results


def quiet_dtensor_logs() -> None:
    """Silence DTensor's warnings about its own CPU fallbacks (noise in every rank's log)."""
    for name in ("torch.distributed.tensor", "torch.distributed.tensor._redistribute"):
        logging.getLogger(name).setLevel(logging.ERROR)


def grads_for(dst: Sequence[str]) -> list[str | None]:
    """Every gradient placement DTensor accepts for an output placed ``dst``.

    On each axis a gradient of an ``R`` or ``P`` output may be ``R`` or
    ``P(sum)``; a sharded output's gradient is sharded the same way.
    ``None`` (the default, ``replicate_partials(dst)``) comes first.
    """
    options = [("R", "P(sum)") if not p.startswith("S") else (p,) for p in dst]
    combos = [",".join(c) for c in itertools.product(*options)]
    default = ",".join("R" if p.startswith("P") else p for p in dst)
    return [None] + [c for c in combos if c != default]


def one_axis_cases(mesh_shape: Sequence[int], axis: int, placements: Iterable[str],
                   shapes: Iterable[Sequence[int]], others: Iterable[str] = ("R",),
                   dtype: str = "float32") -> Iterator[Case]:
    """Every ``src -> dst`` pair from ``placements`` on ``axis``, every grad, every shape.

    The other axes hold one of ``others`` (the same on src and dst). A
    tensor that would mix ``max``/``min`` Partials with another reduce op is
    skipped (it has no single value; DTensor and tplower refuse it alike);
    ``sum`` and ``avg`` mix.
    """
    pl = list(placements)
    for shape, other, a, b in itertools.product(list(shapes), list(others), pl, pl):
        src = [other] * len(mesh_shape)
        dst = list(src)
        src[axis], dst[axis] = a, b
        if not (mixable(src) and mixable(dst)):
            continue
        for g in grads_for(dst):
            yield Case(tuple(mesh_shape), tuple(shape), ",".join(src), ",".join(dst), g, dtype)


def mixable(placements: Sequence[str]) -> bool:
    """Whether a list of canonical placement strings is ``Partial`` with one reduce op or only sum/avg (see
    :func:`tplower.core.language.placements.check_reduce_ops`)."""
    ops = {p[2:-1] for p in placements if p.startswith("P(")}
    return len(ops) <= 1 or ops <= set(LINEAR_REDUCE_OPS)


def summarize(results: Sequence[Sequence[CaseResult]]) -> dict[str, int]:
    """Counts over all ranks' results: one case counts once, failing if any rank failed.

    ``lowered``: tplower ran its own collectives; ``dtensor_fallback``: it
    handed the case to DTensor; ``refused``: both refused the pair; plus one
    count per status.
    """
    counts: dict[str, int] = {"cases": 0, "lowered": 0, "dtensor_fallback": 0, "refused": 0}
    for per_rank in zip(*results, strict=True):
        counts["cases"] += 1
        bad = [r for r in per_rank if not r.ok]
        status = bad[0].status if bad else per_rank[0].status
        counts[status] = counts.get(status, 0) + 1
        if status == "both_raise":
            counts["refused"] += 1
        else:
            counts["lowered" if all(r.lowered for r in per_rank) else "dtensor_fallback"] += 1
    return counts


def failures(results: Sequence[Sequence[CaseResult]]) -> list[str]:
    """One line per failed (case, rank)."""
    return [f"rank {rank}: {r.case.id}: {r.status}: {r.detail[:300]}"
            for rank, per_rank in enumerate(results) for r in per_rank if not r.ok]



def random_cases(seed: int, count: int, mesh_shape: Sequence[int],
                 dtypes: Sequence[str] = ("float32", "float64", "bfloat16")) -> list[Case]:
    """``count`` random cases on ``mesh_shape`` from a fixed ``seed``: placements, shapes (dims 0..9), grads, dtypes.

    One reduce op per case (mixes of sum and avg are checked by ``tests/test_mixed_partials.py``).
    """
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.randint(0, 9) for _ in range(ndim))
        op = rng.choice(("sum", "avg", "max", "min"))
        choices = ["R", "P(" + op + ")"] + [f"S({d})" for d in range(-ndim, ndim)]
        src = [rng.choice(choices) for _ in mesh_shape]
        dst = [rng.choice(choices) for _ in mesh_shape]
        grad = rng.choice(grads_for(dst))
        out.append(Case(tuple(mesh_shape), shape, ",".join(src), ",".join(dst), grad, rng.choice(list(dtypes)),
                        contiguous=rng.random() < 0.8))
    return out
