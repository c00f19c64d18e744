"""Mark the mutants that sit inside type annotations as skipped in a cosmic-ray session.

Every core module starts with ``from __future__ import annotations``, so an
annotation is a string that nothing evaluates at run time: a mutant that
rewrites ``int | None`` into ``int >> None`` cannot change behaviour (an
equivalent mutant by construction). This script finds each mutant whose
source span lies inside a parameter, return or variable annotation and
records it as ``SKIPPED``, so the score counts only mutants that can matter::

    python mutation/skip_annotations.py SESSION.sqlite

Prints how many mutants it skipped per module.
"""

from __future__ import annotations

import argparse
import ast
import collections
from pathlib import Path

from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import WorkerOutcome, WorkResult


def annotation_spans(path: Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """``((row, col), (end_row, end_col))`` of every annotation in the module at ``path`` (rows from 1)."""
    spans = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        found: list[ast.expr | None] = []
        if isinstance(node, ast.arg):
            found.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
        for ann in found:
            if ann is not None and ann.end_lineno is not None and ann.end_col_offset is not None:
                spans.append(((ann.lineno, ann.col_offset), (ann.end_lineno, ann.end_col_offset)))
    return spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("session", help="the cosmic-ray session database")
    args = parser.parse_args()
    spans: dict[Path, list[tuple[tuple[int, int], tuple[int, int]]]] = {}
    skipped: collections.Counter[str] = collections.Counter()
    with use_db(args.session, WorkDB.Mode.open) as db:
        done = {job for job, _ in db.results}
        for item in db.work_items:
            if item.job_id in done:
                continue
            inside = True
            for m in item.mutations:
                path = Path(m.module_path)
                if path not in spans:
                    spans[path] = annotation_spans(path)
                if not any(a <= tuple(m.start_pos) and tuple(m.end_pos) <= b for a, b in spans[path]):
                    inside = False
            if inside:
                db.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.SKIPPED,
                                                      output="inside a type annotation (a string at run time)"))
                skipped[str(item.mutations[0].module_path)] += 1
    for module, count in sorted(skipped.items()):
        print(f"{module}: {count} mutants inside annotations skipped")


if __name__ == "__main__":
    main()
