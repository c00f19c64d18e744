"""The ``tplower`` command: :mod:`~tplower.cli.main` parses and dispatches; one module per subcommand."""

from __future__ import annotations

from .main import DEFAULT, SUBCOMMANDS, build_parser, main

__all__ = ["DEFAULT", "SUBCOMMANDS", "build_parser", "main"]
