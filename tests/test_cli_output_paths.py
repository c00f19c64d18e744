"""Every option of ``tplower`` that writes a file or a folder refuses a path it cannot write, in the parent, before
any work: one line naming the option and the path, exit 2, no traceback; a write that fails at the end is one line.

The commands run in this process with the work that would follow the check (rank launchers, the bench, emitting,
deriving) replaced by functions that fail the test, so a refusal that came only after the work cannot pass.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_refusals import one_line, refused_before_torch

from tplower.run.checks import RunError, check_writable, check_writable_folder, writing

ROOT = Path(__file__).parent.parent
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _proc_takes_no_files() -> bool:
    """Whether ``/proc`` exists and refuses a new file (on Linux it does, even to root): a path no one can write."""
    probe = Path("/proc/tplower-test-probe")
    try:
        probe.touch()
    except OSError:
        return Path("/proc").is_dir()
    probe.unlink()
    return False


PROC_READ_ONLY = _proc_takes_no_files()

# (argv before the path, the option, "file" or "folder": what the option writes)
OPTIONS = [
    pytest.param(["run", "--json"], "--json", "file", id="run-json"),
    pytest.param(["run", "--checkpoint"], "--checkpoint", "folder", id="run-checkpoint"),
    pytest.param(["run", "--codegen"], "--codegen", "file", id="run-codegen"),
    pytest.param(["plan", "--model", "all-minilm-l6-v2", "-o"], "-o", "file", id="plan-o"),
    pytest.param(["codegen", "--model", "all-minilm-l6-v2", "-o"], "-o", "file", id="codegen-o"),
    pytest.param(["bench", "--quick", "--phases", "fake", "--no-plots", "--out"], "--out", "folder", id="bench-out"),
]
SUFFIX = {"--json": ".json", "--codegen": ".py", "-o": ".yaml"}


@pytest.fixture
def no_work(no_spawn: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a rank, the bench, emitting or deriving fails the test: each refusal here must come before."""

    def worked(*args: object, **kwargs: object) -> None:
        raise AssertionError("the command started its work before refusing the output path")

    import tplower.bench.phases
    import tplower.cli.codegen
    import tplower.cli.plan

    monkeypatch.setattr(tplower.bench.phases, "run_bench", worked)
    monkeypatch.setattr(tplower.cli.codegen, "emit_file", worked)
    monkeypatch.setattr(tplower.cli.plan, "skeleton_for", worked)


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[Path]:
    """A folder that takes no new files (mode 0o500), made writable again afterwards so it can be removed."""
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o500)
    yield folder
    folder.chmod(0o700)


def _name(option: str, kind: str, command: str) -> str:
    if kind == "folder":
        return "out"
    return "out.py" if command == "codegen" else "out" + SUFFIX.get(option, ".py")  # codegen -o writes Python


@pytest.mark.skipif(IS_ROOT, reason="root writes into a folder of mode 0o500")
@pytest.mark.parametrize(("argv", "option", "kind"), OPTIONS)
def test_a_folder_without_write_permission_is_refused(
    argv: list[str], option: str, kind: str, locked: Path, no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(locked / _name(option, kind, argv[0]))
    line = one_line([*argv, path], capsys)
    assert f"{option} {path!r} cannot be written" in line and "elsewhere" in line, line
    assert os.listdir(locked) == []  # the probe left nothing behind


@pytest.mark.skipif(not PROC_READ_ONLY, reason="needs a /proc that takes no new files")
@pytest.mark.parametrize(("argv", "option", "kind"), OPTIONS)
def test_a_path_in_proc_is_refused(
    argv: list[str], option: str, kind: str, no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = "/proc/" + _name(option, kind, argv[0])
    line = one_line([*argv, path], capsys)
    assert f"{option} {path!r} cannot be written" in line and "'/proc'" in line and "elsewhere" in line, line


@pytest.mark.parametrize(("argv", "option", "kind"), [p for p in OPTIONS if p.values[2] == "file"])
def test_a_folder_given_for_a_file_is_refused(
    argv: list[str], option: str, kind: str, tmp_path: Path, no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    if option == "-o" and argv[0] == "plan":  # plan checks the suffix first: a folder whose name has one
        (tmp_path := tmp_path / "plans.yaml").mkdir()
    line = one_line([*argv, str(tmp_path)], capsys)
    assert f"{option} {str(tmp_path)!r} is a folder" in line and "give a file name" in line, line


@pytest.mark.parametrize(("argv", "option", "kind"), [p for p in OPTIONS if p.values[2] == "folder"])
@pytest.mark.parametrize("below", [False, True], ids=["the-file", "below-the-file"])
def test_a_file_given_for_a_folder_is_refused(
    argv: list[str],
    option: str,
    kind: str,
    below: bool,
    tmp_path: Path,
    no_work: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    file = tmp_path / "notes.md"
    file.write_text("kept\n")
    path = str(file / "sub" if below else file)
    line = one_line([*argv, path], capsys)
    what = f"{str(file)!r} is a file, so the folder cannot be created" if below else f"{path!r} is a file"
    assert f"{option} {path!r}" in line and what in line, line
    assert file.read_text() == "kept\n" and not (tmp_path / "notes.md-out").exists()


@pytest.mark.parametrize(("argv", "option", "kind"), [p for p in OPTIONS if p.values[2] == "file"])
def test_a_missing_folder_for_a_file_is_refused(
    argv: list[str], option: str, kind: str, tmp_path: Path, no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "missing" / _name(option, kind, argv[0]))
    line = one_line([*argv, path], capsys)
    assert f"the folder {str(tmp_path / 'missing')!r} does not exist" in line and option in line, line
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize(("argv", "option", "kind"), [p for p in OPTIONS if p.values[2] == "file"])
def test_a_file_name_with_a_trailing_slash_is_refused(
    argv: list[str], option: str, kind: str, tmp_path: Path, no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    # Path("plans.yaml/") is Path("plans.yaml"): the slash would be dropped and a file written under the name
    path = str(tmp_path / _name(option, kind, argv[0])) + "/"
    line = one_line([*argv, path], capsys)
    assert f"{option} {path!r} ends with '/', which names a folder" in line and path[:-1] in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_missing_folder_for_a_folder_is_accepted_and_not_yet_made(tmp_path: Path) -> None:
    check_writable_folder("--out", str(tmp_path / "a" / "b"))
    check_writable_folder("--out", str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_an_existing_file_is_checked_unchanged(tmp_path: Path) -> None:
    file = tmp_path / "r.json"
    file.write_text("{}")
    before = file.stat().st_mtime_ns
    check_writable("--json", str(file))
    assert file.read_text() == "{}" and file.stat().st_mtime_ns == before and os.listdir(tmp_path) == ["r.json"]


def test_a_failed_final_write_is_one_error_naming_the_option() -> None:
    with pytest.raises(RunError) as info, writing("--out", "bench-out"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "bench-out/bench.json")
    text = str(info.value)
    assert text.startswith("--out 'bench-out' could not be written: " + os.strerror(errno.ENOSPC)), text
    assert "bench-out/bench.json" in text and "write elsewhere" in text


def test_codegen_whose_folder_goes_away_before_the_write_ends_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tplower.cli.codegen

    folder = tmp_path / "gen"
    folder.mkdir()

    def emitted(args: object) -> str:
        shutil.rmtree(folder)  # the folder is removed while the file is emitted: the checked path is gone
        return "MESH = []\n"

    monkeypatch.setattr(tplower.cli.codegen, "emit_file", emitted)
    path = str(folder / "x.py")
    line = one_line(["codegen", "--model", "all-minilm-l6-v2", "-o", path], capsys)
    assert f"-o {path!r} could not be written: {os.strerror(errno.ENOENT)}" in line, line



def test_output_paths_are_refused_before_torch_is_imported(tmp_path: Path) -> None:
    file = tmp_path / "notes.md"
    file.write_text("kept\n")
    argvs = [
        ["run", "--json", str(tmp_path)],
        ["run", "--checkpoint", str(file)],
        ["run", "--codegen", str(tmp_path)],
        ["bench", "--out", str(file)],
        ["codegen", "--model", "all-minilm-l6-v2", "-o", str(tmp_path)],
    ]
    refused_before_torch(argvs)
