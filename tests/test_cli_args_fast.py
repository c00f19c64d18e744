"""Argument checks of every ``tplower`` command: one line ``tplower <cmd>: error: ...``, exit 2, before a rank starts.

A count of local processes has an upper bound (2 per CPU core, at least 8), the same for ``run``, ``demo``,
``verify``, ``plan --verify`` and ``bench --worlds``; ``run`` names ``--nproc`` when ``--tp`` was not given;
``verify --input-placement`` keys are checked against the model's inputs in the parent; the checks that need
no torch come before torch is imported; an option value that starts with ``-`` gets a hint to write it with ``=``.
"""

from __future__ import annotations

import os

import pytest
from cli_refusals import one_line, refused_before_torch


@pytest.fixture
def sixteen_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine reports 16 CPU cores: the bound on local processes is 2 x 16 = 32."""
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # not under torchrun: the counts are spawned here
        monkeypatch.delenv(key, raising=False)


# (argv, words the one line must hold) on a machine of 16 cores: at most 32 local processes
TOO_MANY = [
    pytest.param(["demo", "--nproc", "100000"], ["--nproc 100000", "1..32", "--nproc N"], id="demo"),
    pytest.param(["demo", "--nproc", "33"], ["--nproc 33", "1..32"], id="demo-one-over"),
    pytest.param(["run", "--nproc", "100000"], ["--nproc 100000", "1..32", "torchrun"], id="run-nproc"),
    pytest.param(["run", "--tp", "40"], ["--tp 40 x --dp 1", "40 local processes", "1..32"], id="run-tp-alone"),
    pytest.param(
        ["verify", "--model", "llama-tiny", "--nproc", "100000"], ["--nproc 100000", "1..32"], id="verify-nproc"
    ),
    pytest.param(
        ["verify", "--model", "llama-tiny", "--nproc", "8", "--context", "8"],
        ["--nproc 8 x --context 8", "64 local processes", "1..32"],
        id="verify-context",
    ),
    pytest.param(
        ["plan", "--model", "gpt2", "--verify", "--nproc", "100000"], ["--nproc 100000", "1..32"], id="plan-verify"
    ),
    pytest.param(
        ["bench", "--worlds", "2,100000"], ["--worlds 2,100000", "100000 local processes", "2..32"], id="bench-worlds"
    ),
]


@pytest.mark.parametrize(("argv", "words"), TOO_MANY)
def test_a_count_above_the_machine_is_refused(
    argv: list[str], words: list[str], no_spawn: None, sixteen_cores: None, capsys: pytest.CaptureFixture[str]
) -> None:
    line = one_line(argv, capsys)
    assert all(w in line for w in words), line


def test_the_bound_is_at_least_8_on_a_small_machine(
    monkeypatch: pytest.MonkeyPatch, no_spawn: None, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # 2 per core would be 2: the floor of 8 holds
    line = one_line(["demo", "--nproc", "9"], capsys)
    assert "--nproc 9" in line and "1..8" in line, line


# MiniLM has 12 attention heads: the rank counts that split them are its divisors
MINILM_DIVISORS = "[1, 2, 3, 4, 6, 12]"


def test_run_names_nproc_when_tp_was_not_given(
    no_spawn: None, sixteen_cores: None, capsys: pytest.CaptureFixture[str]
) -> None:
    line = one_line(["run", "--nproc", "5"], capsys)
    assert "--nproc 5 does not divide num_attention_heads=12" in line and MINILM_DIVISORS in line, line
    assert "--tp" not in line, line
    line = one_line(["run", "--nproc", "5", "--tp", "5"], capsys)  # given: --tp is named
    assert "--tp 5 does not divide num_attention_heads=12" in line, line
    line = one_line(["run", "--nproc", "10", "--dp", "2"], capsys)  # tp = 10 / 2 = 5
    assert "--nproc 10 / --dp 2 gives tp=5" in line and "does not divide num_attention_heads=12" in line, line
    line = one_line(["run", "--nproc", "5", "--dp", "2"], capsys)
    assert "--nproc 5 is not a multiple of --dp 2" in line, line


def test_verify_input_placement_keys_are_the_models_inputs(no_spawn: None, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    line = one_line(["verify", "--model", "all-minilm-l6-v2", "--input-placement", "0=S(1)"], capsys)
    # a BERT tokenizer's output: the three keyword inputs the ranks pass to the model
    assert "--input-placement names 0, which is not an input of all-minilm-l6-v2" in line, line
    assert "input_ids, token_type_ids, attention_mask (by keyword)" in line, line
    line = one_line(["verify", "--model", "llama-tiny", "--input-placement", "mask=S(1)"], capsys)
    assert "names 'mask'" in line and "its inputs are input_ids (by keyword)" in line, line
    assert line.endswith("e.g. --input-placement input_ids=R"), line


def test_a_value_starting_with_a_dash_gets_the_equals_hint(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line(["explain", "S(0)", "R", "--shape", "-1,4"], capsys)
    assert "argument --shape: expected one argument" in line and "written with '=': --shape=-1,4" in line, line
    line = one_line(["demo", "--shape", "-3,2"], capsys)
    assert "--shape=-3,2" in line, line
    line = one_line(["explain", "S(0)", "R", "--shape"], capsys)  # a missing value: no hint about '-'
    assert "expected one argument" in line and "=" not in line.partition("expected one argument")[2], line
    line = one_line(["explain", "S(0)", "R", "--shape=-1,4"], capsys)
    assert "--shape '-1,4': '-1' is not a non-negative integer" in line, line


PLACEMENT_TEXTS = [
    "R",
    " R ",
    "S(0)",
    "S(-1)",
    "S(007)",
    "P(sum)",
    "P(avg)",
    "P(max)",
    "P(min)",
    "P(foo)",
    "Q",
    "S(x)",
    "s(0)",
    "P(Sum)",
    "S(0",
    "",
    "RR",
]


@pytest.mark.parametrize("text", PLACEMENT_TEXTS)
def test_torch_free_placement_check_agrees_with_the_torch_parse(text: str) -> None:
    from tplower.core.language.placement_text import check_placement_text
    from tplower.core.language.placements import format_placement, parse_placement
    from tplower.core.support.errors import TPLowerError

    try:
        want: str = format_placement(parse_placement(text, arg="SRC"))
    except TPLowerError as exc:
        with pytest.raises(TPLowerError) as got:
            check_placement_text(text, arg="SRC")
        assert str(got.value) == str(exc)
        return
    assert check_placement_text(text, arg="SRC") == want


# each refused by a check of the arguments alone; (argv, words of its one line)
BEFORE_TORCH = [
    (["explain", "Q", "R"], "SRC='Q' is not a valid placement"),
    (["explain"], "explain needs SRC and DST placements"),
    (["explain", "S(0),R", "R"], "has 2 placements but the mesh has 1 axis"),
    (["explain", "S(5)", "R"], "dim 5 is out of range"),
    (["demo", "--shape", "x"], "--shape 'x': 'x' is not a non-negative integer"),
    (["demo", "--nproc", "100000"], "--nproc 100000 would spawn 100000 local processes"),
    (["bench", "--phases", "fakee"], "--phases: 'fakee' is unknown (did you mean 'fake'?)"),
    (["bench", "--worlds", "2,100000"], "--worlds 2,100000 would spawn"),
    (["codegen", "--model", "all-minilm-l6-v2", "--mesh", "tp=0"], "--mesh 'tp=0': axis 'tp' has size '0'"),
    (["verify", "--model", "all-minilm-l6-v2", "--input-placement", "foo"], "--input-placement 'foo': write it as"),
    (["verify", "--model", "all-minilm-l6-v2", "--input-placement", "0=Q"], "'Q' is not a placement"),
    (["verify", "--model", "all-minilm-l6-v2", "--nproc", "100000"], "--nproc 100000 would spawn"),
    (["plan", "--model", "gpt2", "--verify", "--nproc", "100000"], "--nproc 100000 would spawn"),
    (["run", "--tp", "3", "--dp", "1", "--nproc", "2"], "--tp 3 x --dp 1 = 3 ranks, but the run has 2"),
    (["run", "--nproc", "100000"], "--nproc 100000 would spawn"),
    (["run", "--nproc", "5"], "--nproc 5 does not divide num_attention_heads=12"),
    (["explain", "--plan", "no-such-plan.yaml"], "--plan 'no-such-plan.yaml': no such file"),
    (["codegen", "--model", "all-minilm-l6-v2", "--plan", "no-such-plan.json"], "--plan 'no-such-plan.json': no such"),
    (["plan", "--model", "bert", "-o", "plan.txt"], "the suffix '.txt' says no plan format"),
]


def test_argument_checks_come_before_torch_is_imported() -> None:
    lines = refused_before_torch([argv for argv, _ in BEFORE_TORCH])
    for (argv, words), line in zip(BEFORE_TORCH, lines, strict=True):
        assert words in line, (argv, line)
