"""Property: any boundary entry classifies to a valid form or raises the documented error, never another."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tplower.core.support.errors import TPLowerError
from tplower.plans.forms import BoundaryForm, classify_boundary_form

AXES = ("dp", "tp", "ep", "sp")
TEXT = st.one_of(st.sampled_from(["R", "S(0)", "S(1)", "S(-1)", "P(sum)", "P(avg)", "P(max)", "S(9)"]),
                 st.text(max_size=6))
SPEC = st.one_of(TEXT, st.dictionaries(st.sampled_from(AXES + ("xx",)), TEXT, max_size=3))
SIDE = st.dictionaries(st.sampled_from(["x", "out", "0", "1", "hidden"]), SPEC, max_size=2)
ENTRY = st.one_of(
    st.sampled_from(["colwise", "rowwise", "colwise_rep", "rowwise_rep", "sequence_parallel", "replicate",
                     "local_colwise", "local_rowwise", "packed_colwise", "nonsense"]),
    st.fixed_dictionaries({}, optional={"in_src": SIDE, "in_dst": SIDE, "out_src": SIDE, "out_dst": SIDE,
                                        "in_grad": SIDE, "out_names": st.lists(st.sampled_from(["a", "b"])),
                                        "bogus_field": st.integers()}),
)


@settings(max_examples=300, deadline=None)
@given(entry=ENTRY, names=st.lists(st.sampled_from(AXES), unique=True, max_size=3),
       injection=st.sampled_from([None, "local", "wrapper", "bogus"]))
def test_classify_gives_a_form_or_the_documented_error(entry, names, injection):
    try:
        form = classify_boundary_form(entry, names, injection)
    except (TPLowerError, ValueError):
        return  # TPLowerError for bad entries; ValueError names a bad injection
    assert isinstance(form, BoundaryForm)
    assert form.form in ("identity", "tp_collective", "generic", "region")
    assert all(isinstance(a, str) and "==>" in a for a in form.annotations)
    if injection == "wrapper":
        assert form.form == "generic"
