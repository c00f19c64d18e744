"""Counted nouns in messages and reports: ``1 process``, ``2 processes``."""

from __future__ import annotations

__all__ = ["count"]


def count(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the noun that agrees with it: ``count(1, "rank")`` -> ``"1 rank"``, ``count(2, "process",
    "processes")`` -> ``"2 processes"`` (``many`` defaults to ``one + "s"``)."""
    return f"{n} {one if n == 1 else (many if many is not None else one + 's')}"
