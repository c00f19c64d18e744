"""Placement strings: a hand table of parses, exact round trips, and the documented errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

from tplower import TPLowerError, format_placement, format_placements, parse_placement, parse_placements
from tplower.core.language.placements import replicate_partials

TABLE = [
    ("R", Replicate()),
    ("S(0)", Shard(0)),
    ("S(3)", Shard(3)),
    ("S(-1)", Shard(-1)),
    ("P(sum)", Partial("sum")),
    ("P(avg)", Partial("avg")),
    ("P(max)", Partial("max")),
    ("P(min)", Partial("min")),
]


@pytest.mark.parametrize(("text", "placement"), TABLE, ids=[t for t, _ in TABLE])
def test_parse_and_format_round_trip(text, placement):
    assert parse_placement(text) == placement
    assert format_placement(placement) == text


@pytest.mark.parametrize("bad", ["", "r", "S", "S()", "S(x)", "S(1", "P", "P()", "P(prod)", "P(SUM)", "Shard(0)",
                                 "S(0),R"])
def test_bad_placement_strings_raise_naming_value(bad):
    with pytest.raises(TPLowerError, match=r"allowed|reduce op"):
        parse_placement(bad)


def test_parse_placement_rejects_other_types():
    with pytest.raises(TypeError, match="str or a Placement"):
        parse_placement(3)  # type: ignore[arg-type]


def test_comma_list_sequence_and_mapping_forms():
    assert parse_placements("S(0),R") == (Shard(0), Replicate())
    assert parse_placements(["P(sum)", Shard(1)]) == (Partial("sum"), Shard(1))
    assert parse_placements({"tp": "S(1)"}, ("dp", "tp")) == (Replicate(), Shard(1))
    assert parse_placements({}, ("dp", "tp")) == (Replicate(), Replicate())


def test_unknown_axis_names_axis_and_mesh_axes():
    with pytest.raises(TPLowerError, match=r"'ep' is not in the mesh.*\('dp', 'tp'\)"):
        parse_placements({"ep": "R"}, ("dp", "tp"))


def test_mapping_needs_names_and_count_must_match_mesh():
    with pytest.raises(TPLowerError, match="mesh_dim_names"):
        parse_placements({"tp": "R"})
    with pytest.raises(TPLowerError, match="2 axes"):
        parse_placements("R", ("dp", "tp"))
    with pytest.raises(TypeError):
        parse_placements(5)  # type: ignore[arg-type]


def test_negative_dims_normalise_and_out_of_range_raises():
    assert parse_placements("S(-1),S(-3)", tensor_ndim=3) == (Shard(2), Shard(0))
    with pytest.raises(TPLowerError, match="out of range for a 2-d tensor"):
        parse_placements("S(2)", tensor_ndim=2)
    with pytest.raises(TPLowerError, match="out of range"):
        parse_placements("S(-3)", tensor_ndim=2)


def test_replicate_partials_reads_partial_as_replicate():
    assert replicate_partials((Partial("avg"), Shard(0), Replicate())) == (Replicate(), Shard(0), Replicate())


placement_text = st.one_of(
    st.just("R"),
    st.integers(-8, 8).map(lambda d: f"S({d})"),
    st.sampled_from(["sum", "avg", "max", "min"]).map(lambda op: f"P({op})"),
)


@given(st.lists(placement_text, min_size=1, max_size=4))
def test_round_trip_property(parts):
    text = ",".join(parts)
    assert format_placements(parse_placements(text)) == text


@given(st.text(max_size=12))
def test_random_text_parses_or_raises_documented_error(text):
    try:
        p = parse_placement(text)
    except TPLowerError:
        return
    assert format_placement(p) == text.strip()
