"""Plan caches stay bounded: evicted programs come back the same, and memory stays flat while shapes change.

The soak runs 2 gloo ranks through calls whose local shapes never repeat (both the sharded and the
unsharded dim change): ``redistribute_local`` on random transitions, forward and backward, and training
steps of a sequence-parallel MLP block parallelized with :func:`tplower.parallelize` at random batch and
sequence lengths. A sample of calls is checked against DTensor (:func:`tplower.conformance.check_case`
and ``parallelize_module`` on the same block). After warm-up the resident memory must grow by less than
5 MiB and the mesh's program cache must stay at its bound.

Short form (CI): 400 shapes, bound 64 through ``TPLOWER_CACHE_SIZE``. Long form: ``TPLOWER_SOAK=N``
(N >= 20000 distinct local shapes for the issue; about 3 minutes on 2 cores) at the default bound. The
memory curve is printed at the end of the run (the ``tplower reliability`` section).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import os
import random
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

import tplower.core.lower.cache as cache_mod
from tplower import TPExecutionOp, mesh_lowerer, parallelize, redistribute_local, set_cache_size
from tplower.conformance import Case, check_case, quiet_dtensor_logs
from tplower.core.lower.cache import CACHE_SIZE_ENV, DEFAULT_CACHE_SIZE, LRUCache, cache_size
from tplower.testing import run_processes, run_threaded

from blocks import SP, Block, D

SOAK = int(os.environ.get("TPLOWER_SOAK", "0"))
SHORT_SHAPES, SHORT_BOUND = 400, 64
GROWTH_LIMIT_MIB = 5.0
MODEL_EVERY = 4  # one model step per this many redistribute_local calls
TRANSITIONS = (("S(0)", "R"), ("S(1)", "R"), ("P(sum)", "R"), ("P(sum)", "S(1)"), ("S(0)", "S(1)"),
               ("S(1)", "S(0)"), ("R", "S(0)"))
TOL = {"atol": 2e-5, "rtol": 1e-4}
ONEDNN_CACHE = 16  # oneDNN primitives kept per process in the soak's ranks (torch's default: 1024)


# ---- the cache itself ----------------------------------------------------------------------------------


def test_lru_keeps_the_most_recently_used_and_counts() -> None:
    c: LRUCache[str, int] = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1  # "a" is now the most recent: "b" goes first
    c.put("c", 3)
    assert "b" not in c and c.get("b") is None and len(c) == 2
    assert c.get_or_build("b", lambda: 20) == 20  # rebuilt, evicting "a" (least recently used)
    assert "a" not in c and c.get("c") == 3
    assert c.cache_info() == cache_mod.CacheInfo(hits=2, misses=2, size=2, maxsize=2, evictions=2)


def test_set_cache_size_shrinks_live_caches_and_returns_the_old_bound() -> None:
    follower: LRUCache[int, int] = LRUCache()
    fixed: LRUCache[int, int] = LRUCache(10)
    for i in range(10):
        follower.put(i, i)
        fixed.put(i, i)
    old = set_cache_size(3)
    try:
        assert cache_size() == 3 and follower.maxsize == 3 and fixed.maxsize == 10
        assert [k for k in range(10) if k in follower] == [7, 8, 9] and len(fixed) == 10
        assert LRUCache[int, int]().maxsize == 3
    finally:
        assert set_cache_size(old) == 3


@pytest.mark.parametrize("bad", [0, -1, 2.5, "8", True, None])
def test_a_bad_size_is_a_value_error_naming_the_argument(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"n=.* is not a valid cache size; allowed: an integer >= 1"):
        set_cache_size(bad)
    with pytest.raises(ValueError, match=r"maxsize=.* allowed: an integer >= 1"):
        LRUCache(bad if bad is not None else 0)


def test_the_environment_variable_sets_the_default_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_mod, "_bound", None)
    monkeypatch.delenv(CACHE_SIZE_ENV, raising=False)
    assert cache_size() == DEFAULT_CACHE_SIZE
    monkeypatch.setattr(cache_mod, "_bound", None)
    monkeypatch.setenv(CACHE_SIZE_ENV, " 7 ")
    assert LRUCache[int, int]().maxsize == 7
    for bad in ("0", "lots", "1e3"):
        monkeypatch.setattr(cache_mod, "_bound", None)
        monkeypatch.setenv(CACHE_SIZE_ENV, bad)
        with pytest.raises(ValueError, match=rf"TPLOWER_CACHE_SIZE=.*{bad}.* allowed: an integer >= 1"):
            LRUCache[int, int]()


def _evict_body(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    lowerer = mesh_lowerer(mesh)

    def gather(rows: int) -> tuple[list[float], list[float]]:
        x = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3).add(100 * rank).requires_grad_()
        out = redistribute_local(x, mesh, "S(0)", "R")
        out.backward(torch.ones_like(out))
        assert x.grad is not None
        return out.flatten().tolist(), x.grad.flatten().tolist()

    first = gather(2)
    plan = lowerer.program("S(0)", "R", (2, 3), "cpu").plan
    gather(3), gather(4)  # bound 2: the (2, 3) program is dropped
    before = lowerer.cache_info()
    again = gather(2)  # rebuilt
    after = lowerer.cache_info()
    op = TPExecutionOp("all_gather", mesh.get_group(), world, rank, tensor_dim=1)
    seen = [op.execute(torch.full((2, k), float(rank))).tolist() for k in (1, 2, 3, 1)]
    return {"same": first == again, "same_plan": lowerer.program("S(0)", "R", (2, 3), "cpu").plan == plan,
            "before": before, "after": after, "op": op.cache_info(), "op_first": seen[0] == seen[3]}


def test_an_evicted_program_is_rebuilt_with_the_same_result() -> None:
    old = set_cache_size(2)
    try:
        results = run_threaded(2, _evict_body)
    finally:
        set_cache_size(old)
    for r in results:
        assert r["same"] and r["same_plan"] and r["op_first"]
        assert r["before"].size == 2 and r["before"].evictions >= 1 and (r["before"].misses, r["after"].misses) == (
            3, 4)  # 3 shapes, then (2, 3) again after its eviction
        assert r["op"].size == 2 and r["op"].misses == 4 and r["op"].evictions == 2


# ---- the soak --------------------------------------------------------------------------------------------




#: Sequence parallel: activations S(1) (the sequence) between blocks; both sharded and unsharded dims change.
SP_PLAN = SP


def _models(mesh: DeviceMesh) -> tuple[nn.Module, nn.Module]:
    ref = Block()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    theirs = parallelize_module(copy.deepcopy(ref), mesh, {
        "norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1))})
    return parallelize(ref, mesh, SP_PLAN), theirs


def _distinct(n: int, cols: int, seed: int) -> list[tuple[int, int]]:
    """``n`` distinct pairs ``(a, b)``, ``1 <= b <= cols``, in random order."""
    rows = max(16, -(-n // cols))
    grid = [(a, b) for a in range(1, rows + 1) for b in range(1, cols + 1)]
    random.Random(seed).shuffle(grid)
    return grid[:n]


def _clear_dtensor_caches() -> None:
    # The oracle's own caches (DTensor keeps its plans and shape propagation per shape, unbounded): not tplower's.
    from torch.distributed.tensor import _redistribute

    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's cache
    FakeTensorMode.cache_clear()  # shape propagation's dispatch cache


def _rss_mib() -> float:
    # After a collection and malloc_trim: memory held, not memory glibc keeps for reuse.
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _redistribute_call(mesh: DeviceMesh, shape: tuple[int, int], src: str, dst: str, seed: int,
                       check: bool) -> str | None:
    if check:  # DTensor on the same input and gradient, forward and backward
        gshape = list(shape)
        if src.startswith("S"):
            gshape[int(src[2])] *= mesh.size()
        result = check_case(Case((mesh.size(),), tuple(gshape), src, dst), mesh)
        _clear_dtensor_caches()
        return None if result.ok else f"{result.case.id}: {result.status}: {result.detail[:200]}"
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    out = redistribute_local(x, mesh, src, dst)
    torch.autograd.grad(out, x, torch.ones_like(out))
    return None


def _model_step(ours: nn.Module, theirs: nn.Module, batch: int, seq: int, seed: int, check: bool) -> str | None:
    gen = torch.Generator().manual_seed(seed)
    x, g = torch.randn(batch, seq, D, generator=gen), torch.randn(batch, seq, D, generator=gen)
    mine = x.clone().requires_grad_()
    out = ours(mine)
    out.backward(g)
    error = None
    if check:
        ref_x = x.clone().requires_grad_()
        ref = theirs(ref_x)
        ref.backward(g)
        pairs = [("output", out, ref), ("input grad", mine.grad, ref_x.grad)] + [
            (f"{n}.grad", p.grad, q.grad) for (n, p), q in zip(ours.named_parameters(), theirs.parameters(),
                                                                strict=True)]
        for what, a, b in pairs:
            a, b = (t.full_tensor() if isinstance(t, DTensor) else t for t in (a, b))  # DTensor's may be Partial
            if a is None or b is None or not torch.allclose(a, b, **TOL):
                error = f"model step batch={batch} seq={seq}: {what} differs from parallelize_module's"
                break
        theirs.zero_grad(set_to_none=True)
        _clear_dtensor_caches()
    ours.zero_grad(set_to_none=True)
    return error


def _soak_body(rank: int, world: int, n: int, check_every: int) -> dict[str, Any]:
    quiet_dtensor_logs()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    lowerer = mesh_lowerer(mesh)
    ours, theirs = _models(mesh)
    rng = random.Random(1234)  # the same on every rank, so the ranks' collectives pair up
    shapes = _distinct(n, 64, seed=1)
    steps = _distinct(n // MODEL_EVERY, 4, seed=2)  # (seq, batch): local sequence and batch both change
    bound = cache_size()
    warm: int | None = None  # warm-up ends at half the calls or when the cache is full, whichever is later
    curve: list[tuple[str, int, float]] = [("start", 0, _rss_mib())]
    sizes: dict[str, int] = {}
    errors: list[str] = []
    checked = 0
    for i, shape in enumerate(shapes):
        src, dst = rng.choice(TRANSITIONS)
        check = i % check_every == 0
        if check:  # the checked calls go through every transition in turn
            src, dst = TRANSITIONS[i // check_every % len(TRANSITIONS)]
        errors.append(_redistribute_call(mesh, shape, src, dst, seed=1000 * i + rank, check=check) or "")
        if i % MODEL_EVERY == 0 and i // MODEL_EVERY < len(steps):
            seq, batch = steps[i // MODEL_EVERY]
            errors.append(_model_step(ours, theirs, batch, seq, seed=1000 * i + rank, check=check) or "")
            checked += check
        checked += check
        done = i + 1
        if warm is None and done >= n // 2 and lowerer.cache_info().size == bound:
            warm = done
            curve.append(("after warm-up", done, _rss_mib()))
            sizes["after warm-up"] = bound
        elif done % max(1, n // 8) == 0 and done < n:
            curve.append(("", done, _rss_mib()))
        if warm is not None:
            largest = max(sizes.get("largest after warm-up", 0), lowerer.cache_info().size)
            sizes["largest after warm-up"] = largest
    curve.append(("end", n, _rss_mib()))
    info = lowerer.cache_info()
    sizes["end"] = info.size
    return {"curve": curve, "sizes": sizes, "bound": bound, "warm": warm, "errors": [e for e in errors if e],
            "checked": checked, "misses": info.misses, "evictions": info.evictions,
            "distinct_shapes": len(set(shapes)) + len({(b, s, D) for s, b in steps})}


def _soak(n: int, check_every: int, label: str, report: dict[str, object], timeout: float,
          monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's oneDNN keeps a primitive per new GELU shape (about 32 KiB each, up to 1024 by default): its own
    # bounded cache, not tplower's. Kept small here so the curve shows tplower's memory.
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE))
    per_rank = run_processes(2, _soak_body, n, check_every, timeout=timeout)
    for rank, r in enumerate(per_rank):
        assert not r["errors"], f"rank {rank}: " + "\n".join(r["errors"][:10])
        assert r["warm"] is not None and n - r["warm"] >= n // 4, (
            f"rank {rank}: the program cache reached its bound {r['bound']} only at call {r['warm']} of {n}")
        assert r["sizes"] == dict.fromkeys(("after warm-up", "largest after warm-up", "end"), r["bound"]), (
            rank, r["sizes"])
        warm = next(mib for what, _, mib in r["curve"] if what == "after warm-up")
        growth = r["curve"][-1][2] - warm
        assert growth < GROWTH_LIMIT_MIB, f"rank {rank}: RSS grew {growth:.1f} MiB after warm-up: {r['curve']}"
    r = per_rank[0]
    points = ", ".join(f"{what + ' ' if what else ''}@{i}: {mib:.1f}" for what, i, mib in r["curve"])
    report[label] = (f"{r['distinct_shapes']} distinct local shapes, {r['checked']} calls checked against DTensor, "
                     f"0 mismatches; program cache bound {r['bound']}, size after warm-up "
                     f"{r['sizes']['after warm-up']} and at the end {r['sizes']['end']} ({r['misses']} misses, "
                     f"{r['evictions']} evictions); "
                     f"rank 0 RSS MiB {points}")


@pytest.mark.slow  # a soak
def test_soak_changing_shapes_short(monkeypatch: pytest.MonkeyPatch, reliability_report: dict[str, object]) -> None:
    monkeypatch.setenv(CACHE_SIZE_ENV, str(SHORT_BOUND))  # read by each spawned rank's first cache
    _soak(SHORT_SHAPES, 40, f"cache soak, short ({SHORT_SHAPES} shapes, bound {SHORT_BOUND})", reliability_report,
          timeout=300, monkeypatch=monkeypatch)


@pytest.mark.skipif(not SOAK, reason="the long soak runs with TPLOWER_SOAK=N (N >= 20000 distinct local shapes)")
def test_soak_changing_shapes_long(monkeypatch: pytest.MonkeyPatch, reliability_report: dict[str, object]) -> None:
    bound = cache_size()
    if SOAK < 4 * bound:
        pytest.skip(f"TPLOWER_SOAK={SOAK} is too short to fill and cycle a cache of {bound}; use >= {4 * bound}")
    _soak(SOAK, 200, f"cache soak, long ({SOAK} shapes, bound {bound})", reliability_report, timeout=3600,
          monkeypatch=monkeypatch)
