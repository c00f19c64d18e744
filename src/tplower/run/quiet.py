"""Keep known noise of C++ libraries off the terminal, without hiding anything else they write.

The torch profiler's kineto library prints ``profiler_start`` and
``profiler_stop`` lines (and ``Completed Stage`` ones) to file descriptor 2
on every profiling window, at a level its ``KINETO_LOG_LEVEL`` variable can
only silence together with its errors, and only before the first profile
of the process. :func:`filtered_stderr` instead captures descriptor 2 for
the duration of a block and writes back every line except the noise, so
warnings and errors from any thread still reach the terminal (after the
block, in their order).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator

__all__ = ["KINETO_NOISE", "filtered_stderr", "quiet_transformers"]

#: kineto's per-window status lines, e.g.
#: ``USDT:2026-11-30 07:51:55 8992:8992 SyncActivityProfilerHandler.cpp:52] profiler_start``.
KINETO_NOISE = re.compile(r"^(USDT|STAGE):.*\.cpp:\d+\] (profiler_start|profiler_stop|Completed Stage: .*)$")


@contextlib.contextmanager
def filtered_stderr(drop: re.Pattern[str] = KINETO_NOISE) -> Iterator[None]:
    """Capture file descriptor 2 inside the block; afterwards write back every line that ``drop`` does not match.

    Args:
        drop: lines (without their newline) to leave out.

    Python's ``sys.stderr`` is flushed before and after, so its text takes
    the same path. Lines are written back even when the block raises.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                tmp.seek(0)
                lines = tmp.read().decode("utf-8", errors="replace").splitlines(keepends=True)
                kept = "".join(ln for ln in lines if not drop.match(ln.rstrip("\r\n")))
                if kept:
                    os.write(2, kept.encode("utf-8"))
    finally:
        os.close(saved)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' logging at error level, its progress bars off and Python warnings ignored in the block
    (building and loading many tiny models, where each would print the same notices)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
