"""``tplower run``: a real model, tensor-parallel on N processes, checked against one process.

:func:`run` checks a :class:`RunConfig`, starts the ranks (or joins
``torchrun``'s), and returns rank 0's report; :func:`format_report` prints it.
"""

from __future__ import annotations

from .config import RunConfig, RunError, check_config, load_plan, texts_from, torchrun_env
from .launch import run
from .report import format_report, verdict, write_json

__all__ = ["RunConfig", "RunError", "check_config", "format_report", "load_plan", "run", "texts_from",
           "torchrun_env", "verdict", "write_json"]
