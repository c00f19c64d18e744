"""Collectives and bytes per rank in one train step of all-MiniLM-L6-v2 at tp=2: tplower beside parallelize_module.

Feeds README.md ("When to choose it") and docs/parallelize.md ("Siblings share one move"): 24 against
36 ``all_reduce`` calls, 4,718,592 against 7,077,888 bytes per rank; ``tests/test_docs_examples.py`` runs it.

Both copies take MiniLM's plan (``tplower.run.models.MINILM_TP_PLAN``: query, key, value and intermediate
colwise, the two output projections rowwise); one forward and backward of a batch of 4 sentences padded to 32
tokens, counted at the dispatcher (``tplower.core.lower.traffic.CollectiveTraffic``, the same ring conventions for
both libraries). tplower's query, key and value share one move of their input (one all_reduce of the summed
gradient where ``parallelize_module`` sends three).

The collectives are counted as the lowering names them, as NCCL runs them: gloo's small all_reduces run
natively here (``TPLOWER_GLOO_EXCHANGE_BYTES=0``); by default gloo carries each of these as one ``all_to_all``
of the same bytes at tp=2 (docs/design.md, "Which collective carries a step").

Run: python benchmarks/collective_counts.py   (2 local gloo ranks; prints a Markdown table)
"""

from __future__ import annotations

import copy
import os
from typing import Any

from torch.distributed.device_mesh import init_device_mesh

import tplower
from tplower.core.lower.backends import EXCHANGE_ENV
from tplower.core.lower.traffic import CollectiveTraffic
from tplower.run.models import MINILM, MINILM_TP_PLAN, load_model, sentences
from tplower.run.paths import parallelize_dtensor
from tplower.testing import run_processes

BATCH, TOKENS = 4, 32


def _body(rank: int, world: int) -> dict[str, dict[str, Any]]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, tokenizer = load_model(MINILM)
    batch = tokenizer(
        sentences()[:BATCH], padding="max_length", max_length=TOKENS, truncation=True, return_tensors="pt"
    )
    ours = tplower.parallelize(copy.deepcopy(model), mesh, MINILM_TP_PLAN)
    theirs = copy.deepcopy(model)
    parallelize_dtensor(theirs, mesh, MINILM_TP_PLAN)
    out: dict[str, dict[str, Any]] = {}
    for name, m in (("tplower", ours), ("parallelize_module", theirs)):
        m(**batch).last_hidden_state.sum().backward()  # warm-up: first-call exchanges are not part of a step
        with CollectiveTraffic() as traffic:
            m(**batch).last_hidden_state.sum().backward()
        out[name] = {"counts": dict(traffic.counts), "sent": traffic.sent}
    return out


def main() -> None:
    os.environ[EXCHANGE_ENV] = "0"  # the spawned ranks inherit it
    res = run_processes(2, _body)[0]
    print(f"all-MiniLM-L6-v2, tp=2, batch {BATCH}x{TOKENS}, one forward and backward, per rank\n")
    print("| library | collectives | bytes sent |\n|---|---|---|")
    for name, row in res.items():
        calls = ", ".join(f"{k} {v}" for k, v in sorted(row["counts"].items()))
        print(f"| {name} | {calls} | {row['sent']:,} |")


if __name__ == "__main__":
    main()
