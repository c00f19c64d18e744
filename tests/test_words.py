"""Counted nouns in messages and reports agree with their number."""

from __future__ import annotations

import pytest

from tplower.core.support.words import count


@pytest.mark.parametrize(("n", "one", "many", "expected"), [
    (0, "rank", None, "0 ranks"),
    (1, "rank", None, "1 rank"),
    (2, "rank", None, "2 ranks"),
    (1, "axis", "axes", "1 axis"),
    (2, "axis", "axes", "2 axes"),
    (3, "error", None, "3 errors"),
])
def test_count_agrees_with_its_number(n: int, one: str, many: str | None, expected: str) -> None:
    assert count(n, one, many) == expected


@pytest.mark.parametrize(("layers", "said"), [(1, "1 layer,"), (2, "2 layers,")])
def test_context_table_counts_layers(layers: int, said: str) -> None:
    from tplower.context.explain import context_to_table, explain_context

    first = context_to_table(explain_context(1, 64, 64, 4, 2, 2, layers=layers)).splitlines()[0]
    assert f"heads of 16, {said} cp=2, tp=1" in first, first
