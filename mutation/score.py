"""The mutation score of a cosmic-ray session, per module: killed / (killed + survived).

Skipped mutants (inside type annotations, see ``skip_annotations.py``) and
pending ones (a run stopped early) are counted apart. cosmic-ray runs pending
mutants in random order, so a stopped run's score is that of a random sample::

    python mutation/score.py SESSION.sqlite [--survivors]
"""

from __future__ import annotations

import argparse
import collections

from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("session", help="the cosmic-ray session database")
    parser.add_argument("--survivors", action="store_true", help="list each survivor: module, line, operator")
    parser.add_argument("--diffs", action="store_true", help="with --survivors: each survivor's diff too")
    args = parser.parse_args()
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    survivors = []
    with use_db(args.session, WorkDB.Mode.open) as db:
        items = {item.job_id: item for item in db.work_items}
        results = dict(db.results)
        for job, item in items.items():
            m = item.mutations[0]
            module = str(m.module_path).rsplit("/", 1)[-1]
            r = results.get(job)
            if r is None:
                kind = "pending"
            elif r.worker_outcome == WorkerOutcome.SKIPPED:
                kind = "skipped"
            elif r.worker_outcome == WorkerOutcome.NORMAL and r.test_outcome == TestOutcome.SURVIVED:
                kind = "survived"
                survivors.append((module, m.start_pos[0], m.operator_name, m.occurrence, r.diff or ""))
            else:
                kind = "killed"  # tests failed, or the mutant crashed or timed out (abnormal)
            counts[module][kind] += 1
    print(f"{'module':18s} {'killed':>7s} {'survived':>9s} {'score':>6s} {'skipped':>8s} {'pending':>8s}")
    total: collections.Counter[str] = collections.Counter()
    for module, c in sorted(counts.items()) + [("all", total)]:
        if module != "all":
            total.update(c)
        run = c["killed"] + c["survived"]
        score = f"{c['killed'] / run:.1%}" if run else "-"
        print(f"{module:18s} {c['killed']:7d} {c['survived']:9d} {score:>6s} {c['skipped']:8d} {c['pending']:8d}")
    if args.survivors:
        for module, row, op, occurrence, diff in sorted(survivors):
            print(f"  {module}:{row} {op} (occurrence {occurrence})")
            if args.diffs:
                print("\n".join(f"      {ln}" for ln in diff.splitlines() if ln[:1] in "+-" and ln[:3] not in "+++---"))


if __name__ == "__main__":
    main()
