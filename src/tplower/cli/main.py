"""The ``tplower`` command.

Each subcommand lives in its own module exposing ``add_arguments(parser)``
and ``main(args) -> int``; :data:`SUBCOMMANDS` lists them, so a new one is
one line here. ``tplower`` with no subcommand runs :data:`DEFAULT`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

#: name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("tplower.cli.demo", "lower a few transitions on local gloo processes and check them against DTensor"),
    "explain": ("tplower.cli.explain", "print the collectives a transition lowers to, with bytes per rank"),
    "run": ("tplower.cli.run", "parallelize a real model on N processes and check it matches one process"),
    "bench": ("tplower.cli.bench", "time tplower against the raw collective and DTensor; table, JSON and plots"),
    "codegen": ("tplower.cli.codegen", "write a model's parallelized forwards out as straight-line Python"),
    "plan": ("tplower.cli.plan", "derive a tensor-parallel plan from a model's module structure (YAML for editing)"),
    "verify": ("tplower.cli.verify", "check a plan on a model against one process; name the first wrong boundary"),
}
#: the subcommand ``tplower`` runs without one
DEFAULT = "run"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="tplower", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-v", "--verbose", action="store_true", help="log tplower's decisions (debug level)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    known = set(SUBCOMMANDS) | {"-h", "--help"}
    if not any(a in known for a in args_list):
        args_list = [a for a in args_list if a in ("-v", "--verbose")] + [DEFAULT] + \
            [a for a in args_list if a not in ("-v", "--verbose")]
    args = parser.parse_args(args_list)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    for noisy in ("torch.distributed.tensor", "torch.distributed.tensor._redistribute"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.main(args))


if __name__ == "__main__":
    raise SystemExit(main())
