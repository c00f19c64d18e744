"""Every public function given a wrong type raises TypeError naming the argument, before any collective.

The wrong values are the ones users pass by mistake: a nested list, a NumPy
array, ``None``, and a DTensor where a local tensor is expected. Pure
functions are called directly; functions that need a process group run on
2 threaded ranks, each of which must raise the same error without issuing a
collective (every collective entry point tplower calls is counted).
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import tplower.core.lower.agreement
import tplower.core.lower.collectives
from tplower import (
    TPCollectiveLowerer,
    TPExecutionOp,
    TPOperators,
    classify_axis,
    classify_boundary_form,
    classify_tp_transition,
    create_tp_collective_lowerer,
    explain_plan_lines,
    format_placement,
    format_placements,
    mesh_lowerer,
    parse_placement,
    parse_placements,
    plan_steps,
    plan_transition,
    redistribute_local,
    replicate_partials,
)
from tplower.conformance import Case, check_case, check_cases, make_mesh
from tplower.core.support.errors import TPLowerError, TPLowerTypeError
from tplower.nn.parallelize import parallelize
from tplower.testing import run_threaded

BAD: dict[str, Any] = {"list": [[1.0, 2.0]], "ndarray": np.array([1.0, 2.0]), "None": None}
R, S0 = Replicate(), Shard(0)

# (function and argument, call with the bad value, the name the message must give, values that are allowed there)
PURE: list[tuple[str, Callable[[Any], object], str, tuple[str, ...]]] = [
    ("parse_placement.text", lambda v: parse_placement(v), "placement", ()),
    ("parse_placements.spec", lambda v: parse_placements(v, ("tp",)), r"placements(\[0\])?", ()),
    ("parse_placements.mesh_dim_names", lambda v: parse_placements("R", v), "mesh_dim_names", ("None",)),
    ("parse_placements.tensor_ndim", lambda v: parse_placements("R", ("tp",), tensor_ndim=v), "tensor_ndim",
     ("None",)),
    ("format_placement.p", lambda v: format_placement(v), "p", ()),
    ("format_placements.placements", lambda v: format_placements(v), "placements", ()),
    ("replicate_partials.placements", lambda v: replicate_partials(v), "placements", ()),
    ("classify_axis.src", lambda v: classify_axis(v, R), "src", ()),
    ("classify_axis.dst", lambda v: classify_axis(S0, v), "dst", ()),
    ("plan_transition.src", lambda v: plan_transition(v, (R,), (4,), (2,), (0,)), "src", ()),
    ("plan_transition.dst", lambda v: plan_transition((S0,), v, (4,), (2,), (0,)), "dst", ()),
    ("plan_transition.grad", lambda v: plan_transition((S0,), (R,), (4,), (2,), (0,), v), "grad", ("None",)),
    ("plan_transition.global_shape", lambda v: plan_transition((S0,), (R,), v, (2,), (0,)), "global_shape", ()),
    ("plan_transition.mesh_shape", lambda v: plan_transition((S0,), (R,), (4,), v, (0,)), "mesh_shape", ()),
    ("plan_transition.coord", lambda v: plan_transition((S0,), (R,), (4,), (2,), v), "coord", ()),
    ("plan_steps.src", lambda v: plan_steps(v, (R,), (4,), (2,), (0,)), "src", ()),
    ("plan_steps.global_shape", lambda v: plan_steps((S0,), (R,), v, (2,), (0,)), "global_shape", ()),
    ("classify_tp_transition.src", lambda v: classify_tp_transition(v, "R", ("tp",)), r"src(\[0\])?", ()),
    ("classify_tp_transition.mesh_dim_names", lambda v: classify_tp_transition("R", "R", v), "mesh_dim_names", ()),
    ("TPCollectiveLowerer.mesh_dim_names", lambda v: TPCollectiveLowerer(v, None, 2, 0, "gloo"),  # type: ignore[arg-type]
     "mesh_dim_names", ()),
    ("TPCollectiveLowerer.group", lambda v: TPCollectiveLowerer(("tp",), v, 2, 0, "gloo"), "group", ("None",)),
    ("TPCollectiveLowerer.group_size", lambda v: TPCollectiveLowerer(("tp",), None, v, 0, "gloo"),  # type: ignore[arg-type]
     "group_size", ()),
    ("TPCollectiveLowerer.backend", lambda v: TPCollectiveLowerer(("tp",), None, 2, 0, v),  # type: ignore[arg-type]
     "backend", ()),
    ("TPExecutionOp.tensor_dim", lambda v: TPExecutionOp("all_gather", None, 2, 0, v),  # type: ignore[arg-type]
     "tensor_dim", ("None",)),
    ("classify_boundary_form.mesh_dim_names", lambda v: classify_boundary_form("colwise", v), "mesh_dim_names", ()),
    ("explain_plan_lines.mesh_dim_names", lambda v: explain_plan_lines({"a": "colwise"}, v), "mesh_dim_names", ()),
    ("Case.mesh_shape", lambda v: Case(v, (4,), "R", "R"), "mesh_shape", ()),
    ("Case.src", lambda v: Case((2,), (4,), v, "R"), "src", ()),
    ("check_case.case", lambda v: check_case(v, None), "case", ()),  # type: ignore[arg-type]
    ("check_cases.cases", lambda v: check_cases(0, 2, v), "cases", ()),
    ("make_mesh.mesh_shape", lambda v: make_mesh(v), "mesh_shape", ()),
]


def _pure_cases() -> Iterator[Any]:
    for name, call, arg, allowed in PURE:
        for label, value in BAD.items():
            if label not in allowed:
                yield pytest.param(call, value, arg, id=f"{name}-{label}")


@pytest.mark.parametrize(("call", "value", "arg"), list(_pure_cases()))
def test_pure_function_wrong_type_names_the_argument(call: Callable[[Any], object], value: Any, arg: str) -> None:
    with pytest.raises(TypeError, match=rf"(^|: ){arg} must be") as info:
        call(value)
    assert not isinstance(info.value, TPLowerError)  # a type error, not a bad value of the right type
    shown = "None" if value is None else type(value).__name__
    assert shown in str(info.value), str(info.value)  # the message shows what was given


def test_wrong_type_messages_suggest_the_fix() -> None:
    with pytest.raises(TypeError, match=r"classify_axis: src must be a Placement .* got str 'S\(0\)'; "
                                        r"parse it with tplower.parse_placement\('S\(0\)'\)"):
        classify_axis("S(0)", R)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"mesh_dim_names must be .* got str 'tp'; write \('tp',\) for a one-axis"):
        parse_placements("R", "tp")


COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather_object", "all_gather", "broadcast")
_WATCHED = threading.local()  # per rank thread: count collectives only inside the calls under test


@contextlib.contextmanager
def _watched() -> Iterator[None]:
    _WATCHED.on = True
    try:
        yield
    finally:
        _WATCHED.on = False


@pytest.fixture
def collective_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Ranks of every collective issued inside :func:`_watched` while the test runs (each entry point wrapped)."""
    calls: list[int] = []

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(_WATCHED, "on", False):
                calls.append(dist.get_rank())
            return fn(*args, **kwargs)
        return wrapper

    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, counted(getattr(dist, name)))
    for module in (tplower.core.lower.collectives, tplower.core.lower.agreement):
        monkeypatch.setattr(module, "_all_gather_base", counted(module._all_gather_base))
    coll = tplower.core.lower.collectives
    monkeypatch.setattr(coll, "_reduce_scatter_base", counted(coll._reduce_scatter_base))
    return calls


def _rank_calls(rank: int, world: int, issued: list[int]) -> dict[str, str]:
    """Each wrong call on this rank: the exception's type and message (``issued``: collectives so far)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = torch.ones(2, 3)
    dt = distribute_tensor(torch.ones(4, 3), mesh, [S0])
    lowerer = create_tp_collective_lowerer(mesh, ("tp",))
    assert lowerer is not None
    ops = TPOperators(lowerer)
    op = lowerer.execution_op("all_gather", 0)
    calls: dict[str, Callable[[Any], object]] = {
        "redistribute_local.local": lambda v: redistribute_local(v, mesh, "S(0)", "R"),
        "redistribute_local.mesh": lambda v: redistribute_local(x, v, "S(0)", "R"),
        "redistribute_local.src": lambda v: redistribute_local(x, mesh, v, "R"),
        "redistribute_local.dst": lambda v: redistribute_local(x, mesh, "S(0)", v),
        "redistribute_local.grad": lambda v: redistribute_local(x, mesh, "S(0)", "R", grad=v),
        "redistribute_local.global_shape": lambda v: redistribute_local(x, mesh, "S(0)", "R", global_shape=v),
        "redistribute_local.check": lambda v: redistribute_local(x, mesh, "S(0)", "R", check=v),
        "mesh_lowerer.mesh": lambda v: mesh_lowerer(v),
        "create_tp_collective_lowerer.mesh": lambda v: create_tp_collective_lowerer(v, ("tp",)),
        "TPOperators.lowerer": lambda v: TPOperators(v),
        "TPOperators.all_gather.t": lambda v: ops.all_gather(v, 0),
        "TPOperators.all_gather.dim": lambda v: ops.all_gather(x, v),
        "TPExecutionOp.execute.tensor": lambda v: op.execute(v),
        "parallelize.model": lambda v: parallelize(v, mesh, {"": "colwise"}),
        "parallelize.mesh": lambda v: parallelize(torch.nn.Linear(4, 4), v, {"": "colwise"}),
    }
    out = {}
    for name, call in calls.items():
        for label, value in {**BAD, "DTensor": dt}.items():
            try:
                before = issued.count(rank)
                with _watched():
                    call(value)
            except Exception as exc:
                out[f"{name}-{label}"] = f"{type(exc).__name__}: {exc}"
                if issued.count(rank) != before:
                    out[f"{name}-{label}"] += " (after a collective)"
            else:
                out[f"{name}-{label}"] = "accepted"
    return out


# arguments where a value is allowed (None: the default; a DTensor: TPOperators takes its local tensor)
ALLOWED = {"redistribute_local.grad-None", "redistribute_local.global_shape-None", "redistribute_local.check-None",
           "TPOperators.all_gather.t-DTensor"}


def test_wrong_types_raise_before_any_collective_on_every_rank(collective_calls: list[int]) -> None:
    per_rank = run_threaded(2, _rank_calls, collective_calls)
    assert per_rank[0] == per_rank[1]  # every rank alike
    assert len(per_rank[0]) == 15 * 4
    for key, outcome in per_rank[0].items():
        if key in ALLOWED:
            assert outcome == "accepted", (key, outcome)
            continue
        func, label = key.rsplit("-", 1)
        arg = func.rsplit(".", 1)[1]
        assert outcome.startswith("TypeError: ") and not outcome.endswith("(after a collective)"), (key, outcome)
        assert re.search(rf": {arg}(\[0\])? must be", outcome), (key, outcome)
        if label == "DTensor" and arg in ("local", "tensor"):
            assert "to_local()" in outcome, outcome  # says how to get the local tensor


def test_the_issues_list_argument_message() -> None:
    def body(rank: int, world: int) -> str:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        with pytest.raises(TypeError) as info:
            redistribute_local([[1.0, 2.0]], mesh, "S(0)", "R")  # type: ignore[arg-type]
        return str(info.value)

    msg = run_threaded(2, body)[0]
    assert msg == ("redistribute_local: local must be a torch.Tensor, got list [[1.0, 2.0]]; "
                   "convert it with torch.as_tensor(...)")


def _one_rank_wrong(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    local: Any = [[1.0, 2.0]] if rank == 1 else torch.ones(2, 3)
    with pytest.raises(TPLowerTypeError) as info, _watched():  # a TypeError and a TPLowerError, on both ranks
        redistribute_local(local, mesh, "S(0)", "R", check=True)
    return str(info.value)


def test_with_check_one_rank_wrong_type_raises_on_every_rank(collective_calls: list[int]) -> None:
    msgs = run_threaded(2, _one_rank_wrong)
    assert msgs[0] == msgs[1]
    assert "dtype differs: 'torch.float32' on ranks [0]; 'list' on ranks [1]" in msgs[0]
    assert "rank 1: TypeError: redistribute_local: local must be a torch.Tensor, got list" in msgs[0]
    assert issubclass(TPLowerTypeError, TypeError) and issubclass(TPLowerTypeError, TPLowerError)
    # only the debug check's own exchange ran: its digest all_gather, then the descriptions, on each rank
    assert sorted(collective_calls) == [0, 0, 1, 1]
