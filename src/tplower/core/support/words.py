"""Words in messages and reports: counted nouns (``1 process``, ``2 processes``), the closest valid choice."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest", "count"]


def count(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the noun that agrees with it: ``count(1, "rank")`` -> ``"1 rank"``, ``count(2, "process",
    "processes")`` -> ``"2 processes"`` (``many`` defaults to ``one + "s"``)."""
    return f"{n} {one if n == 1 else (many if many is not None else one + 's')}"


def closest(word: str, choices: Iterable[str], n: int = 1, *, fallback: str | None = None) -> str:
    """``" (did you mean 'x'?)"`` for the (up to ``n``) choices nearest ``word``, or ``""`` when none is near.

    Nearness is ``difflib``'s ratio (at least 0.6) with letter case ignored (``'CP'`` -> ``'cp'``,
    ``'Llama-tiny'`` -> ``'llama-tiny'``). ``fallback``: the choice to name when none is near by spelling
    but it is among ``choices`` (the default a misnamed argument most likely meant: ``'seq'`` -> ``'cp'``).
    """
    options = list(choices)
    folded: dict[str, str] = {}
    for option in options:
        folded.setdefault(option.lower(), option)
    near = [folded[f] for f in difflib.get_close_matches(word.lower(), list(folded), n=n, cutoff=0.6)]
    if not near and fallback is not None and fallback in options and fallback != word:
        near = [fallback]
    return f" (did you mean {' or '.join(repr(c) for c in near)}?)" if near else ""
