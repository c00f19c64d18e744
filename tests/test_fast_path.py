"""redistribute_local's fast path: a call seen before gives the answer and the errors a first call gives.

The fast path (:mod:`tplower.core.lower.callcache`) serves a call from the
program the full path built for the same arguments. Checked here: every
enumerated transition run twice on the same meshes equals DTensor both
times, the second time from the fast path; bad calls on a warm cache raise
exactly what they raise on a cold one; a new shape, dtype or global shape
gets its own answer (values from a hand-written single-process reference);
``check=True`` and the debug switch still take the checked path; and the
two small caches behind it (identity map, call cache) by themselves.
"""

from __future__ import annotations

import gc
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import tplower.core.lower.redistribute as redistribute_mod
from tplower import mesh_lowerer, redistribute_local, set_cache_size
from tplower.conformance import check_cases, failures, one_axis_cases
from tplower.core.lower.cache import LRUCache
from tplower.core.lower.callcache import CallCache, IdentityMap
from tplower.testing import run_threaded


def _counting_hits(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """Fast-path hits per rank (threads of the threaded group), counted from now on."""
    hits: Counter[int] = Counter()
    lock = threading.Lock()
    real = CallCache.lookup

    def lookup(self: CallCache[Any], *args: Any) -> Any:
        found = real(self, *args)
        if found is not None:
            with lock:
                hits[dist.get_rank()] += 1
        return found

    monkeypatch.setattr(CallCache, "lookup", lookup)
    return hits


# ---- the same answers as DTensor, first call and repeat ------------------------------------------------------


def _twice_body(rank: int, world: int, hits: Counter[int]) -> dict[str, Any]:
    cases = list(one_axis_cases((world,), 0, ("R", "S(0)", "S(1)", "P(sum)", "P(avg)"), [(10, 2), (2, 4)]))
    meshes: dict[tuple[int, ...], DeviceMesh] = {}
    first = check_cases(rank, world, cases, meshes)
    after_first = hits[rank]
    second = check_cases(rank, world, cases, meshes)  # the same mesh objects: every call was seen before
    ran = sum(r.status not in ("both_raise", "tplower_raises") for r in first)
    return {"first": first, "second": second, "after_first": after_first, "after_second": hits[rank], "ran": ran}


def test_repeated_calls_equal_dtensor_and_come_from_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    hits = _counting_hits(monkeypatch)
    per_rank = run_threaded(3, _twice_body, hits)  # an odd world: uneven pieces, a rank with nothing on (2, 4)
    assert not failures([r["first"] for r in per_rank]) and not failures([r["second"] for r in per_rank])
    for r in per_rank:
        assert [c.status for c in r["first"]] == [c.status for c in r["second"]]
        assert r["after_first"] == 0  # every case is a new call
        assert r["ran"] > 50 and r["after_second"] == r["ran"]  # every call that ran comes back from the fast path


# ---- the same errors, warm and cold --------------------------------------------------------------------------


def _bad_calls(x: torch.Tensor, mesh: DeviceMesh, two_axes: DeviceMesh) -> dict[str, Callable[[], object]]:
    """Calls that fail on every rank, each next to a good call it resembles (warmed first)."""
    dt = DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
    return {
        "bad dst string": lambda: redistribute_local(x, mesh, "S(0)", "Q"),
        "shard dim out of range": lambda: redistribute_local(x, mesh, "S(0)", "S(9)"),
        "one placement too many": lambda: redistribute_local(x, mesh, "S(0),R", "R"),
        "uneven global shape that does not fit": lambda: redistribute_local(x, mesh, "S(0)", "R", global_shape=(7, 3)),
        "float in global_shape": lambda: redistribute_local(x, mesh, "S(0)", "R", global_shape=(4.0, 3)),
        "bool in global_shape": lambda: redistribute_local(x, mesh, "S(0)", "R", global_shape=(4, True)),
        "grad that does not fit the output": lambda: redistribute_local(x, mesh, "R", "S(0)", grad="R"),
        "src not a placement": lambda: redistribute_local(x, mesh, 0, "R"),  # type: ignore[arg-type]
        "local a list": lambda: redistribute_local(x.tolist(), mesh, "S(0)", "R"),  # type: ignore[arg-type]
        "local a DTensor": lambda: redistribute_local(dt, mesh, "S(0)", "R"),
        "mesh None": lambda: redistribute_local(x, None, "S(0)", "R"),  # type: ignore[arg-type]
        "check not a bool": lambda: redistribute_local(x, mesh, "S(0)", "R", check="yes"),  # type: ignore[arg-type]
        "the same strings on another mesh": lambda: redistribute_local(x, two_axes, "S(0)", "R"),
    }


def _error(call: Callable[[], object]) -> str:
    try:
        call()
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _errors_body(rank: int, world: int) -> dict[str, list[str]]:
    x = torch.ones(2, 3)
    out: dict[str, list[str]] = {}
    warm = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("tp",))
    two_axes = init_device_mesh("cpu", (world, 1), mesh_dim_names=("a", "b"))
    for _ in range(2):  # the good calls the bad ones resemble, now on the fast path
        redistribute_local(x, warm, "S(0)", "R")
        redistribute_local(x, warm, "S(0)", "R", global_shape=(4, 3))
        redistribute_local(x, warm, "R", "S(0)")
    for name, call in _bad_calls(x, warm, two_axes).items():
        out[name] = [_error(call), _error(call)]  # a bad call raises every time
    for name in out:  # each on a mesh of its own, never used before: a cold call
        cold = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("tp",))
        out[name].append(_error(_bad_calls(x, cold, two_axes)[name]))
    return out


def test_bad_calls_raise_on_a_warm_cache_what_they_raise_on_a_cold_one() -> None:
    per_rank = run_threaded(2, _errors_body)
    expected = {  # the words each message must hold
        "bad dst string": "dst='Q' is not a valid placement",
        "shard dim out of range": "shard dim 9 is out of range",
        "one placement too many": "has 2 placements but the mesh has 1 axis",
        "uneven global shape that does not fit": "local tensor has shape (2, 3)",
        "float in global_shape": "TypeError: redistribute_local: global_shape must be a sequence of non-negative ints",
        "bool in global_shape": "TypeError: redistribute_local: global_shape must be a sequence of non-negative ints",
        "grad that does not fit the output": "does not fit the output",
        "src not a placement": "TypeError",
        "local a list": "TypeError: redistribute_local: local must be a torch.Tensor",
        "local a DTensor": "TypeError: redistribute_local: local must be this rank's local torch.Tensor",
        "mesh None": "TypeError: redistribute_local: mesh must be a torch.distributed.device_mesh.DeviceMesh",
        "check not a bool": "TypeError",
        "the same strings on another mesh": "has 1 placement but the mesh has 2 axes",
    }
    for rank, got in enumerate(per_rank):
        assert got.keys() == expected.keys()
        for name, (warm, again, cold) in got.items():
            assert warm == again == cold, (rank, name)
            assert expected[name] in warm, (rank, name, warm)


# ---- new shapes, dtypes and global shapes get their own answer -----------------------------------------------


def _piece(rank: int, rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(rows * 3, dtype=dtype).reshape(rows, 3) + 100 * rank).contiguous()


def _gathered(rows: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The single-process answer of S(0) -> R: every rank's piece, in rank order."""
    return torch.cat([_piece(r, n, dtype) for r, n in enumerate(rows)])


def _variants_body(rank: int, world: int) -> list[tuple[str, bool, Any]]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    got: list[tuple[str, bool, Any]] = []

    def gather(label: str, rows: tuple[int, ...], dtype: torch.dtype = torch.float32, **kw: Any) -> None:
        out = redistribute_local(_piece(rank, rows[rank], dtype), mesh, "S(0)", "R", **kw)
        got.append((label, out.dtype == dtype and torch.equal(out, _gathered(rows, dtype)), tuple(out.shape)))

    for _ in range(2):  # the second round runs every call again, from the fast path
        gather("even (2, 3)", (2, 2))
        gather("float64", (2, 2), torch.float64)
        gather("int64", (2, 2), torch.int64)
        gather("more rows", (3, 3))
        gather("uneven, global (3, 3)", (2, 1), global_shape=(3, 3))
        gather("even, global (4, 3)", (2, 2), global_shape=(4, 3))
        gather("even, global as a list", (2, 2), global_shape=[4, 3])
        gather("even, global as a Size", (2, 2), global_shape=torch.Size([4, 3]))
        summed = redistribute_local(_piece(rank, 2), mesh, "P(sum)", "R")  # same shape, other placements
        got.append(("P(sum) -> R", torch.equal(summed, _piece(0, 2) + _piece(1, 2)), tuple(summed.shape)))
        spec = _Spec("P(sum)")
        via_spec = redistribute_local(_piece(rank, 2), mesh, spec, "R")
        spec.items[0] = "R"  # the same object, changed: the next call must read what it holds now (R -> R)
        kept = redistribute_local(_piece(rank, 2), mesh, spec, "R")
        ok = torch.equal(via_spec, _piece(0, 2) + _piece(1, 2)) and torch.equal(kept, _piece(rank, 2))
        got.append(("a spec changed between calls", ok, None))
        for grad, scale in ((None, 1.0), ("P(sum)", 2.0)):  # R's gradient is this rank's rows; P's is their sum
            x = _piece(rank, 2).requires_grad_()
            redistribute_local(x, mesh, "S(0)", "R", grad=grad).backward(torch.ones(4, 3))
            assert x.grad is not None
            got.append((f"gradient with grad={grad}", torch.equal(x.grad, torch.full((2, 3), scale)), None))
    lowerer = mesh_lowerer(mesh)
    stored = len(lowerer.calls)
    lowerer.release()
    got.append(("release empties the call cache", stored > 0 and len(lowerer.calls) == 0, stored))
    return got


def test_each_shape_dtype_and_global_shape_gets_its_own_answer() -> None:
    for rank, got in enumerate(run_threaded(2, _variants_body)):
        for label, ok, shape in got:
            assert ok, (rank, label, shape)
        rounds = [g for g in got if g[0] != "release empties the call cache"]
        assert rounds[: len(rounds) // 2] == rounds[len(rounds) // 2 :]  # the fast round equals the first
        shapes = {label: shape for label, _, shape in got}
        assert shapes["uneven, global (3, 3)"] == (3, 3) and shapes["even, global (4, 3)"] == (4, 3)


# ---- the checked path is still taken when asked for ----------------------------------------------------------


def _checked_body(rank: int, world: int, checked: list[int]) -> tuple[int, int, int, bool]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = _piece(rank, 2)
    want = _gathered((2, 2))
    outs = [redistribute_local(x, mesh, "S(0)", "R") for _ in range(2)]  # warm
    base = checked.count(rank)
    outs.append(redistribute_local(x, mesh, "S(0)", "R", check=True))
    with_check = checked.count(rank) - base
    lowerer = mesh_lowerer(mesh)
    lowerer.debug = True  # as TPLOWER_DEBUG=1: every call is checked
    try:
        outs.append(redistribute_local(x, mesh, "S(0)", "R"))
        with_debug = checked.count(rank) - base - with_check
        outs.append(redistribute_local(x, mesh, "S(0)", "R", check=False))  # an explicit False skips the check
        skipped = checked.count(rank) - base - with_check - with_debug
    finally:
        lowerer.debug = False
    return with_check, with_debug, skipped, all(torch.equal(o, want) for o in outs)


def test_check_and_the_debug_switch_still_take_the_checked_path(monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[int] = []
    real = redistribute_mod.MeshLowerer.checked

    def spy(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        checked.append(dist.get_rank())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(redistribute_mod.MeshLowerer, "checked", spy)
    for with_check, with_debug, skipped, equal in run_threaded(2, _checked_body, checked):
        assert (with_check, with_debug, skipped) == (1, 1, 0) and equal


# ---- the caches by themselves --------------------------------------------------------------------------------


class _Spec(Sequence[str]):
    """A placement list that can change after a call yet hashes by identity (as any plain class does)."""

    def __init__(self, *items: str) -> None:
        self.items = list(items)

    def __getitem__(self, i: Any) -> Any:
        return self.items[i]

    def __len__(self) -> int:
        return len(self.items)


class _Key:
    """A weakly referenceable object that equals every other ``_Key`` (as two equal meshes do)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key)

    def __hash__(self) -> int:
        return 0


def test_identity_map_finds_this_object_only_and_forgets_it_when_it_dies() -> None:
    m: IdentityMap[str] = IdentityMap()
    a, b = _Key(), _Key()
    m.put(a, "a")
    assert m.get(a) == "a" and m.get(b) is None and a == b  # equal is not enough: the same object is
    m.put(b, "b")
    assert (m.get(a), m.get(b), len(m)) == ("a", "b", 2)
    del a
    gc.collect()
    assert len(m) == 1 and m.get(b) == "b"
    with pytest.raises(TypeError):
        m.put(3, "an int cannot be weakly referenced")


def test_call_cache_keys_exactly_counts_hits_and_keeps_its_bound() -> None:
    old = set_cache_size(2)
    try:
        counts: LRUCache[Any, str] = LRUCache()
        calls: CallCache[str] = CallCache(counts)
        x = torch.zeros(4, 3)
        calls.store(x, "S(0)", "R", None, (8, 3), "p")
        assert calls.lookup(x, "S(0)", "R", None, (8, 3)) == "p" and counts.cache_info().hits == 1
        assert calls.lookup(x, "S(0)", "R", None, torch.Size([8, 3])) == "p"  # the same global shape
        assert calls.lookup(x, "S(0)", "R", None, (8.0, 3)) is None  # equal in Python, refused by check_shape
        assert calls.lookup(x.double(), "S(0)", "R", None, (8, 3)) == "p"  # a program does not depend on dtype
        assert calls.lookup(torch.zeros(5, 3), "S(0)", "R", None, (8, 3)) is None
        assert calls.lookup(x, ["S(0)"], "R", None, (8, 3)) is None  # unhashable: a miss, never an error
        calls.store(x, ["S(0)"], "R", None, None, "list")  # mutable: never stored
        calls.store(x, _Spec("S(0)"), "R", None, None, "mutable")  # hashable, but it could change: never stored
        calls.store(x, "S(0)", {"tp": "R"}, None, None, "mapping")
        calls.store(x, (_Key(),), "R", None, None, "tuple of another object")  # only strings and placements
        calls.store(x, "S(0)", "R", None, [8, 3], "list shape")
        assert len(calls) == 1
        calls.store(x, "S(0)", "R", "P(sum)", None, "q")
        calls.store(x, ("S(0)",), ("R",), None, None, "r")
        assert len(calls) == 2 and calls.lookup(x, "S(0)", "R", None, (8, 3)) is None  # the oldest dropped
        assert calls.lookup(x, ("S(0)",), ("R",), None, None) == "r" and counts.cache_info().hits == 4
    finally:
        set_cache_size(old)
