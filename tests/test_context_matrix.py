"""The whole context-parallel matrix against one process (``slow``): every model, mode, implementation, length,
balance and kind of batch, in one spawn of 2 gloo ranks. ``test_context.py`` runs a slice of it on every run."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from context_cases import EAGER_ONLY, Case, matches, named, run_case

from tplower.testing import run_processes

TOL = 1e-5
MODELS = ("llama", "qwen2", "mistral", "gemma2", "qwen3_moe", "llama_mqa", "gpt_oss")
CASES = [Case(model, mode, impl, seq, balance, kind)
         for model, mode, impl, seq, balance, kind in itertools.product(
             MODELS, ("ulysses", "allgather"), ("eager", "sdpa"), (64, 37), (True, False),
             ("padded", "ragged", "packed"))
         if not (impl == "sdpa" and model in EAGER_ONLY) and not (model == "gpt_oss" and kind == "packed")]
# gpt-oss's forward builds its masks without the position ids, so one process attends across packed documents;
# context parallelism gives every packed document its own attention (as transformers does for Llama and most).


def _body(rank: int, world: int, cases: list[Case]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    return {c.name: named(run_case, c, mesh) for c in cases}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = run_processes(2, _body, CASES, timeout=1800)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_one_process(ranks: list[dict[str, Any]], case: Case) -> None:
    for got in (r[case.name] for r in ranks):
        matches(case, got, TOL)
