"""Boundary forms, plan loading and matching, explain lines, and the bare operators.

Expected forms and annotation lines are written from the single-axis table
in DESIGN.md (``S(d) -> R`` is ``all_gather(dim=d)``, ``P(sum) -> S(d)`` is
``reduce_scatter``, ...), never read back from the code under test.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tplower import TPLowerError, create_tp_collective_lowerer
from tplower.plans.entries import load_plan, match_plan, resolve_entry
from tplower.plans.forms import classify_boundary_form, explain_plan_lines
from tplower.runtime.operators import TPOperators
from tplower.testing import run_threaded

TP, DP_TP, DP_EP = ("tp",), ("dp", "tp"), ("dp", "ep")


def _entry(**moves: tuple[str, str, str]) -> dict[str, dict[str, dict[str, str]]]:
    """``x=("in", src, dst)`` -> an entry mapping, placements on tp unless written ``axis:P``."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    for name, (side, src, dst) in moves.items():
        for field, p in ((f"{side}_src", src), (f"{side}_dst", dst)):
            axis, _, pl = p.rpartition(":")
            out.setdefault(field, {})[name] = {axis or "tp": pl}
    return out


FORM_CASES = {
    "identity": (_entry(x=("in", "S(0)", "S(0)"), out=("out", "R", "R")), TP, None, "identity", []),
    "s_to_r_in_p_to_s_out": (
        _entry(x=("in", "S(1)", "R"), out=("out", "P(sum)", "S(0)")), TP, None, "tp_collective",
        ["x: tp S(1) -> R ==> all_gather(dim=1)", "out: tp P(sum) -> S(0) ==> reduce_scatter(dim=0, op=sum)"]),
    "all_to_all": (_entry(x=("in", "S(0)", "S(1)")), TP, None, "tp_collective",
                   ["x: tp S(0) -> S(1) ==> all_to_all(dim=0->1)"]),
    "non_tp_axis_change": (_entry(x=("in", "dp:S(0)", "dp:R")), DP_TP, None, "generic",
                           ["x: dp S(0) -> R ==> dtensor redistribute"]),
    "unsupported_pair": (_entry(out=("out", "P(sum)", "P(max)")), TP, None, "generic",
                         ["out: tp P(sum) -> P(max) ==> dtensor redistribute"]),
    "wrapper_injection": (_entry(x=("in", "S(1)", "R")), TP, "wrapper", "generic",
                          ["x: tp S(1) -> R ==> all_gather(dim=1)"]),
    "local_injection": (_entry(x=("in", "S(1)", "R")), TP, "local", "region",
                        ["x: tp S(1) -> R ==> all_gather(dim=1)"]),
    "local_compute_field": ({**_entry(x=("in", "R", "R")), "local_compute": "m:f"}, TP, None, "region", []),
    "ep_change_no_active_axes": (_entry(x=("in", "ep:S(0)", "ep:R")), DP_EP, None, "generic",
                                 ["x: ep S(0) -> R ==> dtensor redistribute"]),
    "dp_change_no_active_axes": (_entry(x=("in", "dp:S(0)", "dp:R")), DP_EP, None, "identity",
                                 ["x: dp S(0) -> R ==> dtensor redistribute"]),
    "no_active_axes_hf_style": ("rowwise", ("dp",), None, "identity", []),
    "no_active_axes_wrapper": (_entry(x=("in", "dp:R", "dp:R")), ("dp",), "wrapper", "generic", []),
    # colwise: forward identity, the partial input gradient all-reduced (Megatron's copy_to_tp_region)
    "hf_colwise": ("colwise", TP, None, "tp_collective",
                   ["0: tp R -> R (grad P(sum)) ==> identity; backward all_reduce(op=sum)"]),
    "hf_colwise_rep": ("colwise_rep", TP, None, "tp_collective",
                       ["0: tp R -> R (grad P(sum)) ==> identity; backward all_reduce(op=sum)",
                        "out: tp S(-1) -> R ==> all_gather(dim=-1)"]),
    "hf_rowwise_rep": ("rowwise_rep", TP, None, "tp_collective",
                       ["0: tp R -> S(-1) ==> chunk(dim=-1)", "out: tp P(sum) -> R ==> all_reduce(op=sum)"]),
    "hf_local_colwise": ("local_colwise", TP, None, "identity", []),
}


@pytest.mark.parametrize(("entry", "names", "injection", "form", "lines"), FORM_CASES.values(), ids=FORM_CASES)
def test_form_table(entry, names, injection, form, lines):
    got = classify_boundary_form(entry, names, injection)
    assert got.form == form
    assert list(got.annotations) == lines


def test_form_fields_names_order_and_identity_inputs():
    entry = {**_entry(x=("in", "S(1)", "R"), mask=("in", "R", "R"), attn=("out", "P(sum)", "R")),
             "out_names": ["attn", "weights"]}
    form = classify_boundary_form(entry, TP)
    assert form.identity_inputs == ("mask",)
    assert form.names == ("x", "mask", "attn")
    assert form.out_order == ("attn", "weights")
    assert [op.forward for op in form.inputs] == ["all_gather(dim=1)", "identity"]
    assert form.outputs[0].backward == "identity"  # grad R at a replicated output: nothing to reduce


def test_form_errors_name_module_and_field():
    bad_grad = {**_entry(x=("in", "S(0)", "R")), "in_grad": {"x": {"tp": "S(1)"}}}
    with pytest.raises(TPLowerError, match=r"plan\['blk'\]\.in_grad\['x'\]"):
        classify_boundary_form(bad_grad, TP, module="blk")
    with pytest.raises(TPLowerError, match="'sp' is not in the mesh"):
        classify_boundary_form(_entry(x=("in", "sp:S(0)", "sp:R")), TP)
    with pytest.raises(ValueError, match="injection='both'"):
        classify_boundary_form({}, TP, "both")


@pytest.mark.parametrize(("value", "match"), [
    ({"in_srcs": {}}, r"plan\['m'\]: unknown field 'in_srcs'"),
    ({"in_src": {"x": {"tp": "S(x)"}}}, r"plan\['m'\]\.in_src\['x'\].*'S\(x\)'"),
    ({"in_src": {"x": 3}}, r"plan\['m'\]\.in_src\['x'\]: 3 is not a placement"),
    ({"out_names": "out"}, r"plan\['m'\]\.out_names: 'out'"),
    ({"local_attrs": {"heads": "halve"}}, r"plan\['m'\]\.local_attrs: \{'heads': 'halve'\}"),
    ("colwize", r"style 'colwize' is unknown; allowed: colwise"),
    ("local_packed_rowwise", "no faithful translation: packed"),
    (["colwise"], r"plan\['m'\]: \['colwise'\] must be"),
])
def test_schema_errors_name_module_field_and_value(value, match):
    with pytest.raises(TPLowerError, match=match):
        load_plan({"m": value})


def test_hf_styles_per_module_kind():
    with pytest.raises(TPLowerError, match="on an embedding module has no faithful translation"):
        resolve_entry("colwise", "emb", kind="embedding")
    with pytest.raises(TPLowerError, match="defined for linear modules only"):
        resolve_entry("local_colwise", "norm", kind="other")
    emb = resolve_entry("rowwise", "emb", kind="embedding")  # transformers shards the hidden dim here
    assert emb.params == {"weight": {"tp": Shard(1)}} and emb.out_dst == {"out": {"tp": Replicate()}}
    merged = resolve_entry({"style": "rowwise", "out_dst": {"out": {"tp": "S(1)"}}}, "o", axis="mp")
    assert merged.in_src == {"0": {"mp": Shard(-1)}} and merged.out_dst == {"out": {"tp": Shard(1)}}
    assert merged.deferred_bias == "bias"


def test_load_plan_from_yaml_json_and_dict(tmp_path):
    plan = {"layers.*.mlp.up": "colwise", "layers.*.mlp.down": {"style": "rowwise", "out_names": ["out"]},
            "norm": {"params": {"*": "R"}, "param_grads": {"*": {"tp": "P(sum)"}}}}
    (tmp_path / "p.json").write_text(json.dumps(plan))
    (tmp_path / "p.yaml").write_text("layers.*.mlp.up: colwise\nlayers.*.mlp.down: {style: rowwise, out_names: [out]}\n"
                                     "norm:\n  params: {'*': R}\n  param_grads: {'*': {tp: P(sum)}}\n")
    assert load_plan(tmp_path / "p.json") == plan
    assert load_plan(str(tmp_path / "p.yaml")) == plan
    assert load_plan(plan) == plan
    (tmp_path / "list.yaml").write_text("- colwise\n")
    with pytest.raises(TPLowerError, match="top level must map"):
        load_plan(tmp_path / "list.yaml")
    with pytest.raises(TypeError, match="plan must be a mapping"):
        load_plan(3)  # type: ignore[arg-type]


def test_match_plan_globs():
    names = ["", "layers", "layers.0", "layers.0.mlp", "layers.0.mlp.up", "layers.1.mlp.up", "layers.1.x.mlp.up",
             "head"]
    got = match_plan({"layers.*.mlp.up": "colwise", "layers.1.mlp.up": "rowwise", "**.x.**": "replicate"}, names)
    assert got == {"layers.0.mlp.up": "layers.*.mlp.up", "layers.1.mlp.up": "layers.1.mlp.up",
                   "layers.1.x.mlp.up": "**.x.**"}
    with pytest.raises(TPLowerError, match="matches plan keys"):
        match_plan({"layers.*.mlp.up": "colwise", "layers.0.*.up": "rowwise"}, names)
    with pytest.raises(TPLowerError, match=r"plan key 'nothing\.\*' names no module of the model; top-level names: "
                                           "head, layers"):
        match_plan({"nothing.*": "colwise"}, names)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        match_plan({"head": "colwise", "tail": "rowwise"}, names)
    assert any("'tail' matches no module" in str(w.message) for w in caught)


def test_explain_plan_lines_for_the_example_plan():
    lines = explain_plan_lines("examples/plans/block_sp.yaml", TP)
    assert lines[:4] == [
        "ln*: identity",
        "  param *: grad tp P(sum) ==> backward all_reduce",
        "attn: tp_collective",
        "  x: tp S(1) -> R (grad P(sum)) ==> all_gather(dim=1); backward reduce_scatter(dim=1, op=sum)",
    ]
    after_o = lines[lines.index("attn.o: tp_collective") + 1]
    assert after_o == "  out: tp P(sum) -> S(1) ==> reduce_scatter(dim=1, op=sum)"
    assert explain_plan_lines({"down": "rowwise"}, DP_TP) == [
        "down: tp_collective", "  out: tp P(sum) -> R ==> all_reduce(op=sum)", "  param weight: tp S(1)",
        "  param bias: added once after the output transition"]


def _ops_body(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    lowerer = create_tp_collective_lowerer(mesh, ("tp",), replicated_grad="replicate")
    assert lowerer is not None
    ops = TPOperators(lowerer)
    full = torch.arange(world * 2 * 3 * world, dtype=torch.float32).reshape(world * 2, 3 * world)
    mine = [full * (r + 1) + r for r in range(world)]  # every rank's partial value, computed everywhere
    total, biggest = sum(mine), torch.stack(mine).amax(0)
    piece = full.chunk(world, 0)[rank].clone().requires_grad_()
    gathered = ops.all_gather(piece, 0)
    torch.testing.assert_close(gathered, full)
    weight = torch.linspace(0, 1, full.numel()).reshape(full.shape)
    (gathered * weight).sum().backward()  # replicated gradient: backward keeps this rank's piece
    torch.testing.assert_close(piece.grad, weight.chunk(world, 0)[rank])
    torch.testing.assert_close(ops.all_reduce(mine[rank]), total)
    torch.testing.assert_close(ops.all_reduce(mine[rank], "max"), biggest)
    torch.testing.assert_close(ops.reduce_scatter(mine[rank], 1), total.chunk(world, 1)[rank])
    # the threaded group has no max reduce_scatter: the lowerer's remap (all_reduce + chunk) runs it
    torch.testing.assert_close(ops.reduce_scatter(mine[rank], 0, "max"), biggest.chunk(world, 0)[rank])
    torch.testing.assert_close(ops.all_to_all(full.chunk(world, 0)[rank], 0, 1), full.chunk(world, 1)[rank])
    dt = distribute_tensor(full, mesh, [Shard(0)])
    assert not isinstance(ops.to_local(dt), DTensor)
    torch.testing.assert_close(ops.all_gather(dt, 0), full)  # a DTensor argument is unwrapped first
    assert ops.to_local(None) is None and ops.to_local(full) is full
    with pytest.raises(TypeError, match="got list"):
        ops.to_local([full])


def test_tp_operators_threaded_world4():
    run_threaded(4, _ops_body)
