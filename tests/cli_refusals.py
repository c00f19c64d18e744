"""How the CLI refusal tests run ``tplower``: in this process for the one line, in a fresh one to see that the
refusal came before torch was imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tplower.cli import main

ROOT = Path(__file__).parent.parent
#: a fresh interpreter's environment: this checkout's sources, one thread, not under torchrun
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")} | {
    "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}

_SCRIPT = """
import contextlib, sys
from tplower.cli.main import main
codes = []
for argv in {argvs!r}:
    with contextlib.suppress(SystemExit):
        codes.append(main(argv))
print(codes, sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``tplower argv`` here; assert exit 2, exactly one line ``tplower <cmd>: error: ...``, no traceback;
    return the line."""
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own refusals exit through SystemExit
        rc = int(exc.code or 0)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err)
    assert lines[0].startswith(f"tplower {argv[0]}: error: "), err
    return lines[0]


def refused_before_torch(argvs: list[list[str]]) -> list[str]:
    """Run each ``tplower argv`` in one fresh interpreter; assert each exits 2 with no torch module imported and
    no traceback; return the error lines, in order."""
    done = subprocess.run([sys.executable, "-c", _SCRIPT.format(argvs=argvs)], capture_output=True, text=True,
                          timeout=120, env=ENV)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{[2] * len(argvs)} []", (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == len(argvs), done.stderr
    for argv, line in zip(argvs, lines, strict=True):
        assert line.startswith(f"tplower {argv[0]}: error: "), (argv, line)
    return lines
