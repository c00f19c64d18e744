"""How every ``tplower`` command ends bad input: one line ``tplower <cmd>: error: <what is wrong and the fix>``, exit 2.

The subcommands raise :class:`~tplower.core.support.errors.TPLowerError` (or argparse
reports a value it cannot take); :func:`run_command` turns either into that
one line on standard error, in the parent process, before any rank starts.
This module imports no torch: the parser and ``--help`` stay fast.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from ..core.support.errors import TPLowerError
from ..core.support.words import closest

__all__ = ["Parser", "Terminated", "axis_name", "closest", "error_line", "fail", "non_negative_float", "plan_keyword",
           "positive_float", "positive_int", "run_command", "run_interruptible", "signals_raise"]

#: exit code of every refusal of bad input
USAGE = 2
#: exit codes of a command ended by Ctrl-C (SIGINT) and by SIGTERM: 128 + the signal's number, as a shell reports
INTERRUPTED, TERMINATED = 128 + signal.SIGINT, 128 + signal.SIGTERM
#: exit code when standard output was closed by its reader (128 + SIGPIPE, as a shell reports such a writer)
BROKEN_PIPE = 141
#: the words ``--plan`` takes besides a file (any letter case)
PLAN_KEYWORDS: tuple[str, ...] = ("auto", "derive")


def error_line(command: str, message: object) -> str:
    """``tplower <command>: error: <message>`` on one line (the message's line breaks become spaces)."""
    text = " ".join(str(message).split())
    return f"tplower {command}: error: {text}" if command else f"tplower: error: {text}"


def fail(command: str, message: object) -> int:
    """Print :func:`error_line` to standard error; return the exit code 2."""
    print(error_line(command, message), file=sys.stderr, flush=True)
    return USAGE


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block) pointing at ``--help``."""

    _words: list[str] | None = None  # the words being parsed, for the hint of :meth:`error`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: the subcommands' parsers by name (filled by the caller that adds them): each names its own errors
        self.subcommands: dict[str, argparse.ArgumentParser] = {}

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """As argparse's, keeping the words for :meth:`error` (a subcommand's parser is called with its own)."""
        self._words = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        """Print ``<prog>: error: <message> (see <prog> --help)`` and exit 2.

        An option whose value starts with ``-`` (``--shape -1,4``) reads to argparse as an option without its
        value; the message then says to write it ``--shape=-1,4``.
        """
        self.exit(USAGE, f"{self.prog}: error: {message}{self._dash_hint(message)} (see {self.prog} --help)\n")

    def _dash_hint(self, message: str) -> str:
        """For ``argument OPT: expected one argument`` where the next word starts with ``-``: how to write that
        value; else ``""``."""
        head, _, tail = message.partition(": ")
        if not head.startswith("argument -") or tail != "expected one argument":
            return ""
        names = head.removeprefix("argument ").split("/")
        option = next((n for n in names if n.startswith("--")), names[-1])
        words = self._words or []
        at = next((i for i, w in enumerate(words) if w in names), None)
        if at is None or at + 1 >= len(words) or not words[at + 1].startswith("-"):
            return ""  # the value is missing, not mistaken for an option
        return f"; a value that starts with '-' is written with '=': {option}={words[at + 1]}"


def positive_int(text: str) -> int:
    """An argparse ``type``: a whole number of at least 1.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse names the option).
    """
    t = text.strip()
    if not t.lstrip("+-").isdigit() or int(t) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1 (e.g. 2)")
    return int(t)


def axis_name(text: str) -> str:
    """An argparse ``type``: a mesh axis name, a letter or ``_`` then letters, digits or ``_`` (``tp``, ``tp_0``).

    Raises:
        argparse.ArgumentTypeError: anything else (an empty name, a space, ``=`` or ``,``, which ``--mesh`` uses).
    """
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a mesh axis name: a letter or '_' then letters, digits "
                                         "or '_' (e.g. tp)")
    return text


def _number(text: str) -> float:
    """``float(text)``, or NaN for text that is no number (the callers refuse both alike)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def non_negative_float(text: str) -> float:
    """An argparse ``type``: a finite number of at least 0 (a tolerance).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    value = _number(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of at least 0 (e.g. 1e-5)")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number above 0 (seconds).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    value = _number(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number above 0 (e.g. 600)")
    return value


def plan_keyword(value: str | None) -> str | None:
    """``--plan`` as given, with ``auto``/``derive`` in any letter case written in lower case."""
    if value is not None and value.strip().lower() in PLAN_KEYWORDS:
        return value.strip().lower()
    return value


def run_command(command: str, main: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``main(args)``; a :class:`TPLowerError` (or a failed rank) becomes one error line and exit 2.

    With ``--verbose`` a failed rank's whole report (its traceback) is printed
    first; without, only the one line that names the cause.
    """
    try:
        return int(main(args))
    except TPLowerError as exc:
        return fail(command, exc)
    except Exception as exc:
        testing: Any = sys.modules.get("tplower.testing")  # only a command that started ranks can meet a RankFailure
        if testing is None or not isinstance(exc, testing.RankFailure):
            raise
        from ..run.launch import explain_failure

        if getattr(args, "verbose", False):
            print(str(exc), file=sys.stderr)
        return fail(command, explain_failure(exc, float(getattr(args, "timeout", None) or 0.0)))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's ``KeyboardInterrupt`` so that every ``finally`` runs."""


def _raise_for(signum: int, frame: object) -> None:
    """The handler of :func:`signals_raise`: ignore further signals (the clean-up runs once), then raise."""
    del frame
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Inside, SIGINT raises ``KeyboardInterrupt`` and SIGTERM :class:`Terminated`; the old handlers come back after.

    Without it SIGTERM ends Python at once: no ``finally`` runs, so spawned ranks run on, their temporary folder
    stays, and the resource tracker warns of leaked semaphores. Outside the main thread (where handlers cannot be
    set) it changes nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _raise_for) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def run_interruptible(command: str, main: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """:func:`run_command`, ended by Ctrl-C or SIGTERM with one line and exit 130 or 143 (no traceback).

    A closed standard output (the command piped into ``head``) ends it silently with exit 141, the shell's
    code for a writer killed by SIGPIPE.

    The ranks a command started are ended, and their temporary folder removed, by the ``finally`` of the code
    that started them, while the signal's exception passes through it.
    """
    try:
        with signals_raise():
            return run_command(command, main, args)
    except Terminated:
        print(f"tplower {command}: terminated (SIGTERM); any processes it started were ended", file=sys.stderr,
              flush=True)
        return TERMINATED
    except KeyboardInterrupt:
        print(f"tplower {command}: interrupted; any processes it started were ended", file=sys.stderr, flush=True)
        return INTERRUPTED
    except BrokenPipeError:  # the reader of standard output left (``tplower explain ... | head``): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's final flush goes nowhere
        return BROKEN_PIPE
