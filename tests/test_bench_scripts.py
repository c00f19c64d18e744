"""``benchmarks/`` keeps only scripts a doc page cites, each opening with what it measures and the page it feeds.

A doc page is ``README.md`` or one under ``docs/``; ``benchmarks/README.md`` (the phases and their history) does
not count, so a script only it cites is a one-off investigation: its numbers go into a page and the script goes.
A script that another cited script runs (``device_check.sh`` runs ``nccl_conformance.py``) counts as cited.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
BENCH = ROOT / "benchmarks"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
SCRIPTS = sorted(BENCH.glob("*.py"))
PAGE_NAME = re.compile(r"(?:benchmarks/README\.md|docs/[\w/.-]+\.md|README\.md)")


def _cited_by_pages(name: str) -> bool:
    return any(f"benchmarks/{name}" in p.read_text() for p in PAGES)


def _cited(name: str) -> bool:
    """A doc page names the script, or names another script in ``benchmarks/`` that runs it."""
    if _cited_by_pages(name):
        return True
    runners = [f for f in BENCH.iterdir() if f.is_file() and f.name != name and f.suffix in (".py", ".sh")]
    return any(name in f.read_text() and _cited_by_pages(f.name) for f in runners)


def test_there_are_scripts() -> None:
    assert SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_script_opens_with_what_it_measures_and_the_page_it_feeds(script: Path) -> None:
    doc = ast.get_docstring(ast.parse(script.read_text()))
    assert doc, f"{script.name}: no module docstring"
    paragraphs = doc.split("\n\n")
    assert paragraphs[0].strip(), f"{script.name}: the first line should say what it measures"
    feeds = paragraphs[1] if len(paragraphs) > 1 else ""
    assert feeds.startswith("Feeds "), f"{script.name}: the second paragraph should say 'Feeds <page> ...'"
    named = PAGE_NAME.findall(feeds)
    assert named, f"{script.name}: 'Feeds' names no page"
    assert [n for n in named if not (ROOT / n).is_file()] == [], f"{script.name}: a page it names is missing"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_doc_page_cites_every_script(script: Path) -> None:
    assert _cited(script.name), (
        f"benchmarks/{script.name}: no page of README.md or docs/ cites it; write its findings into a page and "
        "remove it, or cite it where its numbers are"
    )


def test_the_index_of_numbers_points_at_doc_pages() -> None:
    """docs/benchmarks.md's index names the page each number is on; ``benchmarks/README.md`` is not one of them.

    A row there pointing at ``benchmarks/README.md`` would count its script as cited while no page uses its numbers.
    """
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and " | " in line]
    assert rows, "docs/benchmarks.md: no index table"
    pointing = [cells[0] for cells in rows if len(cells) > 2 and "benchmarks/README.md" in cells[1]]
    assert pointing == [], f"docs/benchmarks.md: rows whose page is benchmarks/README.md: {pointing}"
