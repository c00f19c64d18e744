"""Command-line refusals that name the fix: the closest option or model name, an option that needs another, and
the defaults of ``tplower codegen`` and ``tplower run`` taking each other's files."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_refusals import one_line, refused_before_torch

from tplower.cli.main import build_parser, main


def test_a_misspelled_option_gets_the_closest(capsys: pytest.CaptureFixture[str], no_spawn: None) -> None:
    line = one_line(["run", "--nprocs", "2"], capsys)  # argparse's refusal: before any import of torch
    assert "unrecognized arguments: --nprocs 2 (did you mean '--nproc'?)" in line, line


def test_an_option_of_another_command_is_named_not_mistaken(capsys: pytest.CaptureFixture[str],
                                                           no_spawn: None) -> None:
    # --tp is tplower run's, spelt exactly: named as that, though plan's --top is spelt near it (it said: did you
    # mean '--output'?, then '--top'?)
    line = one_line(["plan", "--model", "llama-tiny", "--tp", "two"], capsys)
    assert line.startswith("tplower plan: error: unrecognized arguments: --tp two: tplower plan has no --tp option "
                           "(--tp is an option of tplower run); its options: --model, --output, --embeddings, "
                           "--axis, --verify, --nproc, --timeout, --ranks, "), line
    assert line.endswith("(see tplower plan --help)"), line
    line = one_line(["plan", "--model", "llama-tiny", "--embedings"], capsys)  # one of its own, misspelt
    assert "unrecognized arguments: --embedings (did you mean '--embeddings'?)" in line, line


def test_every_context_mode_is_a_choice_of_verify() -> None:
    """``tplower verify --context-mode`` takes each mode ``parallelize`` takes (the parser's copy, kept free of
    torch, is the list itself); hybrid's check runs as the others' (tests/test_context_tp.py verifies it)."""
    from tplower.cli import verify
    from tplower.context.attention import MODES

    assert verify._MODES == MODES
    args = build_parser().parse_args(["verify", "--model", "llama-tiny", "--context", "4", "--context-mode",
                                      "hybrid"])
    assert args.context_mode == "hybrid"


def test_a_context_mode_without_context_is_refused_before_torch() -> None:
    # without --context the plan would be verified with tensor parallelism alone, the mode ignored
    [line] = refused_before_torch([["verify", "--model", "llama-tiny", "--context-mode", "allgather"]])
    assert "--context-mode allgather" in line and "add --context CP" in line, line


def test_a_model_name_in_another_letter_case_gets_the_closest(capsys: pytest.CaptureFixture[str],
                                                              no_spawn: None) -> None:
    line = one_line(["plan", "--model", "Llama-tiny"], capsys)
    assert "(did you mean 'llama-tiny'?)" in line, line


def test_codegen_default_mesh_is_the_one_run_takes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   no_spawn: None) -> None:
    from tplower.cli.run import _check_arguments

    path = str(tmp_path / "llama.py")
    assert main(["codegen", "--model", "llama-tiny", "-o", path]) == 0, capsys.readouterr().err
    # tplower run's defaults (dp=1, tp=2) take the file: its check refuses a file emitted for another mesh
    _check_arguments(build_parser().parse_args(["run", "--model", "llama-tiny", "--codegen", path]))
