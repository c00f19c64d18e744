"""``tplower run``, ``tplower plan --verify`` and ``tplower`` itself: bad options end in one line and exit 2
before any rank starts (those that need no torch, before torch is imported); Ctrl-C and SIGTERM end a run with
one line, exit 130 or 143, its ranks ended and its temporary folder removed; ``tplower --version``.

The refusals run the command line in this process with the rank launchers replaced by ones that fail the
test, so a refusal that came only after spawning cannot pass.
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from cli_refusals import ENV, one_line, refused_before_torch


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A folder, and a Python file whose second line does not parse."""
    d = tmp_path_factory.mktemp("run_errors")
    bad = d / "gen_bad.py"
    bad.write_text("MESH = [['dp', 1], ['tp', 2]]\ndef forward(x:\n    return x\n")
    return {"dir": str(d), "bad": str(bad)}


# (argv with {name} for a file of the fixture, words the one line must hold, words it must not hold)
REFUSALS = [
    pytest.param(["run", "--json", "/nonexistent-dir/r.json"], ["--json", "'/nonexistent-dir' does not exist"], [],
                 id="json-folder-missing"),
    pytest.param(["run", "--json", "{dir}"], ["--json", "is a folder"], [], id="json-is-a-folder"),
    pytest.param(["run", "--codegen", "/nonexistent-dir/gen.py"], ["--codegen", "'/nonexistent-dir' does not exist"],
                 [], id="codegen-folder-missing"),
    pytest.param(["run", "--codegen", "{bad}"], ["gen_bad.py", "line 2"], [], id="codegen-syntax-error"),
    pytest.param(["run", "--dp", "0"], ["--dp 0", "at least 1"], ["--nproc"], id="dp-0"),
    pytest.param(["run", "--nproc", "2", "--kill-rank", "5"], ["--kill-rank 5", "0..1"], [], id="kill-rank-5-of-2"),
    pytest.param(["run", "--nproc", "2", "--kill-rank", "-2"], ["--kill-rank -2", "0..1"], [], id="kill-rank-neg"),
    pytest.param(["run", "--plan", "/nonexistent-dir/plan.yaml"], ["--plan", "no such file"], [],
                 id="plan-file-missing"),
    pytest.param(["run", "--model", "llama-tiny", "--compile", "bad"], ["--compile 'bad'", "inductor", "eager"],
                 ["_TESTING_ONLY"], id="compile-unknown"),
]


@pytest.mark.parametrize(("argv", "words", "absent"), REFUSALS)
def test_bad_run_option_is_one_line_before_spawning(argv: list[str], words: list[str], absent: list[str],
                                                   files: dict[str, str], no_spawn: None,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line([a.format(**files) for a in argv], capsys)
    assert all(w in line for w in words), (words, line)
    assert not any(w in line for w in absent), (absent, line)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_nccl_without_a_gpu_is_refused_in_the_parent(no_spawn: None, capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line(["run", "--model", "llama-tiny", "--backend", "nccl"], capsys)
    assert "--backend nccl" in line and "use --backend gloo" in line


def test_plan_verify_on_ranks_the_heads_refuse(no_spawn: None, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from tplower.run.derive_table import tiny_family

    heads = tiny_family("gpt2")[0].config.n_head
    nproc = next(n for n in range(2, heads + 1) if heads % n)  # the first rank count the heads do not divide
    line = one_line(["plan", "--model", "gpt2", "--verify", "--nproc", str(nproc)], capsys)
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    assert f"--nproc {nproc}" in line and str(divisors) in line, line



def test_option_checks_that_need_no_torch_come_before_it(files: dict[str, str]) -> None:
    argvs = [["run", "--dp", "0"], ["run", "--kill-rank", "5"], ["run", "--json", "/nonexistent-dir/r.json"],
             ["run", "--codegen", files["bad"]], ["run", "--steps", "0"], ["run", "--plan", "/nonexistent/p.yaml"]]
    refused_before_torch(argvs)


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_is_the_installed_one_and_needs_no_torch(flag: str) -> None:
    script = ("import contextlib, sys\nfrom tplower.cli.main import main\nwith contextlib.suppress(SystemExit):\n"
              f"    main([{flag!r}])\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=ENV)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"tplower {importlib.metadata.version('tplower')}", "False"]


# A command whose main holds a temporary folder and a child process, released only by its ``finally``.
_HOLDS = textwrap.dedent("""
    import argparse, subprocess, sys, tempfile, time
    from tplower.cli.errors import run_interruptible

    def hold(args):
        with tempfile.TemporaryDirectory(prefix="tplower-") as folder:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            try:
                print(folder, child.pid, flush=True)
                time.sleep(60)
            finally:
                child.kill()
                child.wait()
        return 0

    sys.exit(run_interruptible("run", hold, argparse.Namespace()))
""")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize(("sig", "code", "word"), [(signal.SIGTERM, 143, "terminated"),
                                                   (signal.SIGINT, 130, "interrupted")], ids=["sigterm", "sigint"])
def test_a_signal_ends_the_command_in_one_line_after_its_clean_up(sig: signal.Signals, code: int, word: str) -> None:
    p = subprocess.Popen([sys.executable, "-c", _HOLDS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=ENV, start_new_session=True)
    try:
        folder, pid = p.stdout.readline().split() if p.stdout else ("", "0")
        os.killpg(p.pid, sig) if sig == signal.SIGINT else p.send_signal(sig)  # Ctrl-C signals the whole group
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == code, err
    assert err.startswith(f"tplower run: {word}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not Path(folder).exists() and _gone(int(pid))


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["sigterm", "sigint"])
def test_a_signalled_run_ends_its_ranks_and_leaves_no_folder(sig: signal.Signals, code: int, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    env = {**ENV, "TMPDIR": str(tmp_path)}  # the run's rendezvous folder lands here, apart from other runs
    p = subprocess.Popen([sys.executable, "-m", "tplower", "run", "--model", "llama-tiny"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        assert p.stderr is not None and "starting 2 processes" in p.stderr.readline()
        time.sleep(1.0)  # the ranks are started
        assert [f.name for f in tmp_path.glob("tplower-*")], "no rendezvous folder while the ranks run"
        os.killpg(p.pid, sig) if sig == signal.SIGINT else p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == code, err
    assert "Traceback" not in err and "leaked semaphore" not in err
    assert err.rstrip().splitlines()[-1].startswith("tplower run: "), err
    assert not list(tmp_path.glob("tplower-*"))
    time.sleep(0.5)
    listed = subprocess.run(["ps", "-o", "stat=,args=", "-g", str(p.pid)], capture_output=True, text=True).stdout
    ranks = [ln for ln in listed.splitlines() if not ln.startswith("Z")]  # a zombie has ended (only not reaped)
    assert not ranks, f"processes of the run still running: {ranks}"
