"""Plan keys against a model's names: which keys name something, and what to say about a key that names nothing.

A key is an exact dotted name or a glob whose ``*`` matches within one
dotted part and ``**`` any number of whole parts (the rule of
:mod:`tplower.plans.entries`). :func:`unmatched_key_message` is the one text
every command and function gives for a key that names nothing: the key, the
closest spelling that does name something (``difflib``), and what the deepest
part of the key that still matches holds, e.g.

    plan key 'model.layers.*.mlp.upp' names no module of LlamaForCausalLM; did you mean
    'model.layers.*.mlp.up_proj'? model.layers.*.mlp has: act_fn, down_proj, gate_proj, up_proj.
    Fix the key (...)
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence

from ..core.support.errors import TPLowerError

__all__ = ["check_plan_keys", "glob_regex", "key_hint", "matching_keys", "unmatched_key_message"]

_FIX = "Fix the key (module names as in model.named_modules(), '*' for one name part such as a layer index)"


def glob_regex(pattern: str) -> re.Pattern[str]:
    """The regular expression of a plan key: ``*`` within one dotted part, ``**`` any number of whole parts."""
    parts = [r"[^.]+(?:\.[^.]+)*" if p == "**" else re.escape(p).replace(r"\*", r"[^.]*") for p in pattern.split(".")]
    return re.compile(r"\.".join(parts))


def _names_key(key: str, names: Sequence[str]) -> bool:
    return key in names or ("*" in key and any(glob_regex(key).fullmatch(n) for n in names))


def matching_keys(keys: Iterable[str], names: Iterable[str]) -> set[str]:
    """The ``keys`` (exact names or globs, as plan keys) that name at least one of ``names``; no warning."""
    names = list(names)
    present = set(names)
    out = set()
    for key in keys:
        if key in present or ("*" in key and any(glob_regex(key).fullmatch(n) for n in names)):
            out.add(key)
    return out


def _children(parent: str, names: Sequence[str]) -> list[str]:
    """The last parts of the ``names`` one part below those ``parent`` (a key, globs allowed) names, sorted."""
    rx = glob_regex(parent)
    return sorted({n.rpartition(".")[2] for n in names if "." in n and rx.fullmatch(n.rpartition(".")[0])})


def _close(part: str, options: Sequence[str]) -> list[str]:
    """``options`` close to ``part``: by ``difflib``'s ratio, then those that begin with it or it with them
    (``q`` and ``q_proj``); at most 3."""
    near = difflib.get_close_matches(part, options, n=3, cutoff=0.5)
    near += [o for o in options if part and (o.startswith(part) or part.startswith(o)) and o not in near]
    return near[:3]


def _anywhere(key: str, names: Sequence[str]) -> list[str]:
    """Names deeper in the model that end as ``key`` does (a missing prefix), else whose last part is the one
    closest to the key's; layer indices written ``*``, at most 3."""
    rx = glob_regex(f"**.{key}")
    found = [n for n in names if rx.fullmatch(n)]
    if not found:
        last = sorted({n.rpartition(".")[2] for n in names if n})
        near = _close(key.rpartition(".")[2], last)[:1]
        found = [n for n in names if n and n.rpartition(".")[2] in near]
    return sorted({re.sub(r"(?<=\.)\d+(?=\.|$)", "*", n) for n in found})[:3]


def key_hint(key: str, names: Sequence[str]) -> str:
    """What ``names`` hold where ``key`` stops naming anything: ``did you mean '...'? P has: a, b, c`` (the
    closest respelling of the first part that fails, where one names something, else names anywhere whose last
    part is close to the key's; the children of the deepest matching parent ``P``, else the top-level names)."""
    parts = key.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        parent = ".".join(parts[:depth])
        kids = _children(parent, names) if depth else sorted({n.split(".")[0] for n in names if n})
        if not kids:
            continue
        fixes = [
            k
            for k in (".".join([*parts[:depth], c, *parts[depth + 1 :]]) for c in _close(parts[depth], kids))
            if _names_key(k, names)
        ] or _anywhere(key, names)
        mean = f"did you mean {' or '.join(map(repr, fixes))}? " if fixes else ""
        where = f"{parent} has" if depth else "top-level names"
        return f"{mean}{where}: {', '.join(kids)}"
    return "the model has no named modules"


def unmatched_key_message(key: str, names: Sequence[str], owner: str) -> str:
    """The message for a plan ``key`` that names none of ``names`` (the modules, and parameters, of ``owner``).

    Args:
        key: the plan key as written.
        names: the qualified names a key may name, in model order.
        owner: the model's class name (``type(model).__name__``), or ``"the model"``.
    """
    return f"plan key {key!r} names no module of {owner}; {key_hint(key, names)}. {_FIX}"


def check_plan_keys(names: Iterable[str], plan: Iterable[str], owner: str) -> dict[str, list[str]]:
    """Match every key of ``plan`` against ``names``, refusing a key that names nothing.

    Args:
        names: the model's module names (``model.named_modules()``), and parameter names where a plan may
            name a parameter.
        plan: the plan's keys (a plan mapping iterates over them).
        owner: what the names belong to, for the message (the model's class name).

    Returns:
        plan key -> the names it matches, in ``names`` order.

    Raises:
        TPLowerError: a key that names nothing, with :func:`unmatched_key_message`'s text.
    """
    known = [n for n in names if n]
    out: dict[str, list[str]] = {}
    for key in plan:
        rx = glob_regex(key)
        hits = [n for n in known if rx.fullmatch(n)]
        if not hits:
            raise TPLowerError(unmatched_key_message(key, known, owner))
        out[key] = hits
    return out
