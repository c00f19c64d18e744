"""Plan keys against a model's names: which modules each key matches, and what the model has where one fails.

Shared by ``tplower run`` (before any process starts), ``tplower codegen``
and ``tplower verify`` (in the parent process) and the benchmarks, so a
misspelled key reads the same everywhere: the key, and the names the model
has at the deepest part of it that matched.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..core.errors import TPLowerError

__all__ = ["check_plan_keys", "near_names"]


def check_plan_keys(names: Iterable[str], plan: Mapping[str, Any], owner: str) -> dict[str, list[str]]:
    """Match every key of ``plan`` against ``names`` (``*`` matches one dotted name part).

    Args:
        names: the model's module names (``model.named_modules()``), and parameter names where a plan may
            name a parameter.
        plan: plan key -> entry; only the keys are read.
        owner: what the names belong to, for the message (the model's class name).

    Returns:
        plan key -> the names it matches, in ``names`` order.

    Raises:
        TPLowerError: a key that matches no name; the message names the key and the closest names the model
            has (:func:`near_names`).
    """
    known = [n for n in names if n]
    out: dict[str, list[str]] = {}
    for key in plan:
        parts = key.split(".")
        hits = [n for n in known if _match(n, parts)]
        if not hits:
            raise TPLowerError(f"plan key {key!r} names no module of {owner}; {near_names(known, key)}. Fix the "
                               "key (module names as in model.named_modules(), '*' for one name part such as a "
                               "layer index)")
        out[key] = hits
    return out


def _match(name: str, parts: Sequence[str]) -> bool:
    got = name.split(".")
    return len(got) == len(parts) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(got, parts, strict=True))


def near_names(names: Sequence[str], key: str) -> str:
    """What the model has where ``key`` fails: the closest name to the key's last part, then the children of the
    deepest parent the key matches (or the top-level modules), e.g. ``did you mean 'intermediate'? encoder.layer.*
    has: attention, intermediate, output``."""
    parts = key.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        parent = parts[:depth]
        kids = sorted({n.split(".")[depth] for n in names
                       if len(n.split(".")) == depth + 1 and _match(n.rsplit(".", 1)[0], parent)})
        if kids:
            return f"{_did_you_mean(parts[depth], kids)}{'.'.join(parent)} has: {', '.join(kids)}"
    tops = sorted({n.split(".")[0] for n in names})
    return f"{_did_you_mean(parts[0], tops)}top-level modules: {', '.join(tops)}"


def _did_you_mean(part: str, choices: Sequence[str]) -> str:
    near = difflib.get_close_matches(part, choices, n=1, cutoff=0.6)
    return f"did you mean {near[0]!r}? " if near else ""
