"""The ``tplower`` command.

Each subcommand lives in its own module exposing ``add_arguments(parser)``
and ``main(args) -> int``; :data:`SUBCOMMANDS` lists them, so a new one is
one line here. ``tplower`` with no subcommand (only options) runs
:data:`DEFAULT`. Building the parser imports no torch: each module imports
what it needs inside ``main``, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import sys
from collections.abc import Mapping, Sequence

from .errors import Parser, closest, fail, run_interruptible

#: name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("tplower.cli.demo", "lower a few transitions on local gloo processes and check them against DTensor"),
    "explain": ("tplower.cli.explain", "print the collectives a transition lowers to, with bytes per rank"),
    "run": ("tplower.cli.run", "parallelize a real model on N processes and check it matches one process"),
    "bench": ("tplower.cli.bench", "time tplower against the raw collective and DTensor; table, JSON and plots"),
    "codegen": ("tplower.cli.codegen", "write a model's parallelized forwards out as straight-line Python"),
    "plan": ("tplower.cli.plan", "derive a tensor-parallel plan (YAML for editing); with --ranks: find the layout"),
    "verify": ("tplower.cli.verify", "check a plan on a model against one process; name the first wrong boundary"),
}
#: the subcommand ``tplower`` runs without one
DEFAULT = "run"
#: ``tplower --help``'s first line (plain text: help is read in a terminal)
DESCRIPTION = ("tplower: placement transitions lowered to direct collectives, checked against DTensor and one "
               "process, on real models")
_VERBOSE = ("-v", "--verbose")
#: options of ``tplower`` itself, never read as options of :data:`DEFAULT`
_OWN = ("-h", "--help", "-V", "--version")


def package_version() -> str:
    """The installed distribution's version (``importlib.metadata``), else the source tree's ``tplower.__version__``."""
    from importlib import metadata

    try:
        return metadata.version("tplower")
    except metadata.PackageNotFoundError:
        from .._version import __version__

        return __version__


def build_parser() -> Parser:
    """The argument parser with every subcommand (errors are one line, exit 2; each subcommand's parser in
    :attr:`Parser.subcommands`)."""
    parser = Parser(prog="tplower", description=DESCRIPTION, epilog=f"without a command: tplower {DEFAULT} (its "
                    f"options work alone, e.g. tplower --model llama-tiny); tplower COMMAND --help for each")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log tplower's decisions (debug level); a failed rank's whole report")
    parser.add_argument("-V", "--version", action="version", version=f"tplower {package_version()}",
                        help="print tplower's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        parser.subcommands[name] = p
    return parser


def _with_command(args: list[str]) -> list[str] | str:
    """``args`` with :data:`DEFAULT` put in when they start with an option; an error message for a word that is
    not a command (a misspelled one is never read as options of the default)."""
    first = next((a for a in args if a not in _VERBOSE), None)
    if first is None or (first.startswith("-") and first not in _OWN):
        return [a for a in args if a in _VERBOSE] + [DEFAULT] + [a for a in args if a not in _VERBOSE]
    if first.startswith("-") or first in SUBCOMMANDS:
        return args
    return (f"invalid choice: {first!r} is not a command{closest(first, SUBCOMMANDS)}; the commands are "
            f"{', '.join(SUBCOMMANDS)} (tplower --help)")


def _long_options(parser: argparse.ArgumentParser) -> list[str]:
    """``parser``'s ``--options``, ``--help`` aside."""
    return [o for action in parser._actions for o in action.option_strings if o.startswith("--") and o != "--help"]


def _unrecognized(extra: list[str], command: str, parsers: Mapping[str, argparse.ArgumentParser]) -> str:
    """argparse's ``unrecognized arguments: ...``, with the option of ``command`` the first unknown ``--option``
    most likely means by spelling, its dashes aside (``--nprocs`` -> ``--nproc``); none near, or the exact option of
    another command: the command has no
    such option, the commands that do, and the command's options (``tplower plan --tp 2``: ``--tp`` is an option
    of ``tplower run``, and no option of ``plan`` is meant by it)."""
    options = _long_options(parsers[command])
    said = f"unrecognized arguments: {' '.join(extra)}"
    first = next((w.split("=", 1)[0] for w in extra if w.startswith("--")), None)
    if first is None:
        return said
    bare = {o[2:].lower(): o for o in options}
    near = difflib.get_close_matches(first[2:].lower(), list(bare), n=1, cutoff=0.6)
    owners = [f"tplower {name}" for name, p in parsers.items() if name != command and first in _long_options(p)]
    if near and not owners:  # another command's option, spelt exactly, is meant as that (--tp is not --top)
        return f"{said} (did you mean {bare[near[0]]!r}?)"
    elsewhere = f" ({first} is an option of {' and '.join(owners)})" if owners else ""
    return f"{said}: tplower {command} has no {first} option{elsewhere}; its options: {', '.join(options)}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code.

    Bad input ends in one line ``tplower <command>: error: ...`` on standard error and exit code 2
    (argparse's own errors exit through ``SystemExit(2)`` with the same one line); Ctrl-C and SIGTERM end it with
    one line and exit 130 and 143, after the processes it started were ended.
    """
    args_list = _with_command(list(sys.argv[1:] if argv is None else argv))
    if isinstance(args_list, str):
        return fail("", args_list)
    parser = build_parser()
    args, extra = parser.parse_known_args(args_list)
    if extra:  # named by the subcommand, as its other errors are
        parser.subcommands[args.command].error(_unrecognized(extra, args.command, parser.subcommands))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    for noisy in ("torch.distributed.tensor", "torch.distributed.tensor._redistribute"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return run_interruptible(args.command, module.main, args)


if __name__ == "__main__":
    raise SystemExit(main())
