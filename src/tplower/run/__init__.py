"""``tplower run``: a real model, tensor-parallel on N processes, checked against one process.

:func:`run` checks a :class:`RunConfig`, starts the ranks (or joins
``torchrun``'s), and returns rank 0's report; :func:`format_report` prints it.
The names are imported on first use (:mod:`tplower._lazy`): ``tplower.run.models``'
names and plans load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .config import RunConfig, RunError, check_config, load_plan, texts_from, torchrun_env
    from .launch import run
    from .report import format_report, verdict, write_json

__all__ = ["RunConfig", "RunError", "check_config", "format_report", "load_plan", "run", "texts_from",
           "torchrun_env", "verdict", "write_json"]

_HOMES = {"RunConfig": ".config", "RunError": ".config", "check_config": ".config", "load_plan": ".config",
          "texts_from": ".config", "torchrun_env": ".config", "run": ".launch", "format_report": ".report",
          "verdict": ".report", "write_json": ".report"}

__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
