"""A compiled context-parallel train step traces once: no graph break, no recompile as the batches' layouts change.

``torch.compile(model, backend=...)`` of tiny Llama under ``parallelize(model, mesh, None, context="cp")`` at cp=2
(2 gloo ranks), five steps per kind of batch at a fixed length: plain rows, padded rows (left, right or both
sides, a different amount per row and step) and packed rows (one to five documents, the cuts moving). A counting
backend (``aot_eager`` underneath) counts the graphs each step compiles: after the first step at most one more
(none today), dynamo's graph-break counter stays at 0, and each step's loss is one process's on the whole batch.
A compiled step takes the padded and packed batches' attention through the dense mask transformers builds from
the batch's tensors (the same graph for every layout), and plain batches through their one causal run
(:mod:`tplower.context.runs`); ``num_items_in_batch`` is a ``DynamicInt``.

All with ``TPLOWER_SLOW=1`` (compiling takes about 10 s a case on 2 cores): a short case (a one-layer model
through three packed layouts in the all-gather mode, about 20 s alone), every kind in Ulysses, padded and packed in
the all-gather and hybrid modes, and on a ``(cp=2, tp=2)`` mesh (4 ranks, the model's own tensor-parallel plan)
packed rows in the all-gather mode and padded rows in Ulysses. Then the sequence length changing every step
(48, 64, 50, 40, 37 tokens, the ranks' pieces even and uneven; one layer): plain, padded and packed rows in
Ulysses and all-gather and packed rows in the hybrid compile no graph after the first step (``shard_sequence``
marks the sequence dim dynamic and the compiled forward reads the lengths as ``DynamicInt``; about 2 minutes).
And inductor with ``bucket_all_reduces_fx="all"`` (what ``prepare_trainer`` sets under ``torch_compile``): the
backward's per-parameter gradient sums over cp become one ``all_reduce``, the gradients one process's (1 minute).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import tplower
from tplower.testing import run_processes

pytest.importorskip("transformers")
slow = pytest.mark.skipif(not os.environ.get("TPLOWER_SLOW"), reason="slow: runs with TPLOWER_SLOW=1")

SEQ = 48
STEPS = 5
#: per step, each row's (left, right) padding
PADDING = [((3, 0), (0, 0)), ((5, 0), (2, 4)), ((0, 6), (0, 0)), ((4, 3), (7, 0)), ((0, 0), (9, 2))]
#: per step, where the documents of every row start (after the first)
CUTS = [(10,), (13, 30), (5, 9, 20), (30,), (3, 6, 9, 12)]


def _batch(kind: str, step: int, lengths: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Step ``step``'s batch of ``kind`` (``plain``, ``padded``, ``packed``): 2 rows of ``SEQ`` tokens, or of
    ``lengths[step]`` where ``lengths`` are given."""
    seq = lengths[step] if lengths else SEQ
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(step))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if kind == "padded":
        mask = torch.ones(2, seq, dtype=torch.long)
        for row, (left, right) in enumerate(PADDING[step]):
            mask[row, :left] = 0
            mask[row, seq - right:] = 0
        batch["attention_mask"] = mask
        batch["labels"][mask == 0] = -100
    if kind == "packed":
        bounds = (0, *CUTS[step], seq)
        positions = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(bounds)])
        batch["position_ids"] = positions.unsqueeze(0).expand(2, seq)
    return batch


def _model(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def _ranks(rank: int, world: int, cases: tuple[tuple[str, str, int, int], ...],
           tp: bool = False, lengths: tuple[int, ...] = ()) -> dict[tuple[str, str], Any]:
    """Per ``(kind, mode, layers, steps)`` case: the graphs each step compiled, the graph breaks, the losses; on a
    ``(cp=2, tp=2)`` mesh with the model's own tensor-parallel plan where ``tp``; step ``i`` of ``lengths[i]``
    tokens where given."""
    import torch._dynamo as dynamo
    from torch._dynamo.backends.debugging import aot_eager

    os.environ["OMP_NUM_THREADS"] = "1"
    mesh = init_device_mesh("cpu", (2, 2) if tp else (world,), mesh_dim_names=("cp", "tp") if tp else ("cp",))
    out: dict[tuple[str, str], Any] = {}
    graphs: list[int] = []  # every graph compiled (its node count), in order

    def counting(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        graphs.append(len(gm.graph.nodes))
        return aot_eager(gm, inputs)

    for kind, mode, layers, steps in cases:
        dynamo.reset()
        dynamo.utils.counters.clear()
        model = tplower.parallelize(_model(layers), mesh, "auto" if tp else None, context="cp", context_mode=mode)
        compiled = torch.compile(model, backend=counting)
        losses, per_step = [], []
        for step in range(steps):
            before = len(graphs)
            loss = compiled(**tplower.shard_sequence(_batch(kind, step, lengths), mesh, "cp")).loss
            loss.backward()
            losses.append(float(loss.detach()))
            per_step.append(len(graphs) - before)
        out[kind, mode] = {"breaks": sum(dynamo.utils.counters["graph_break"].values()), "losses": losses,
                           "graphs": per_step}
    return out


def _check(ranks: list[dict[tuple[str, str], Any]], kind: str, mode: str, layers: int, steps: int,
           lengths: tuple[int, ...] = ()) -> None:
    model = _model(layers)
    want = [float(model(**_batch(kind, step, lengths)).loss) for step in range(steps)]
    for rank in ranks:
        got = rank[kind, mode]
        assert got["breaks"] == 0, got
        assert got["graphs"][0] > 0 and sum(got["graphs"][1:]) <= 1, got  # at most one recompile after step 1
        torch.testing.assert_close(got["losses"], want, atol=1e-5, rtol=1e-5)


FAST = ("packed", "allgather", 1, 3)


@slow
def test_fast_packed_allgather_traces_once() -> None:
    _check(run_processes(2, _ranks, (FAST,), timeout=300), *FAST)


SLOW = [(kind, "ulysses", 2, STEPS) for kind in ("plain", "padded", "packed")] + \
       [(kind, mode, 2, STEPS) for mode in ("allgather", "hybrid") for kind in ("padded", "packed")]


@pytest.fixture(scope="module")
def ranks() -> list[dict[tuple[str, str], Any]]:
    return run_processes(2, _ranks, tuple(SLOW), timeout=900)


@slow
@pytest.mark.parametrize("case", SLOW, ids=lambda c: f"{c[0]}-{c[1]}")
def test_no_graph_break_no_recompile_one_process_loss(ranks: list[dict[tuple[str, str], Any]],
                                                       case: tuple[str, str, int, int]) -> None:
    _check(ranks, *case)


#: cp2 x tp2 (4 gloo ranks, about 45 s a case): the model's tensor-parallel plan on tp beside the sequence split
CP_TP = [("packed", "allgather", 1, 3), ("padded", "ulysses", 1, 3)]


@slow
def test_cp_beside_tp_traces_once() -> None:
    ranks = run_processes(4, _ranks, tuple(CP_TP), True, timeout=900)
    for case in CP_TP:
        _check(ranks, *case)


#: per step, the sequence length: shorter and longer than the first, dividing into the 4 pieces or not (50, 37:
#: the ranks' pieces uneven, padded for the exchanges)
LENGTHS = (48, 64, 50, 40, 37)
#: the length changing every step: plain rows in both modes (the one causal run, its end a symbol), padded and
#: packed rows (the dense mask, made in the graph) in Ulysses, all-gather and the hybrid
LENGTH_CASES = [(kind, mode, 1, len(LENGTHS)) for mode in ("ulysses", "allgather") for kind in ("plain", "padded",
                                                                                               "packed")] + \
               [("packed", "hybrid", 1, len(LENGTHS))]


@pytest.fixture(scope="module")
def lengths_ranks() -> list[dict[tuple[str, str], Any]]:
    return run_processes(2, _ranks, tuple(LENGTH_CASES), False, LENGTHS, timeout=900)


@slow
@pytest.mark.parametrize("case", LENGTH_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_length_changes_compile_nothing(lengths_ranks: list[dict[tuple[str, str], Any]],
                                        case: tuple[str, str, int, int]) -> None:
    """48, 64, 50, 40, 37 tokens: the sequence dim is dynamic from the first trace (``shard_sequence`` marks it and
    a compiled forward reads the lengths as ``DynamicInt``; uneven pieces are padded with no branch on whether
    they are), so no step after the first compiles a graph."""
    _check(lengths_ranks, *case, lengths=LENGTHS)
    for rank in lengths_ranks:
        assert sum(rank[case[0], case[1]]["graphs"][1:]) == 0, rank[case[0], case[1]]


def _bucketed(rank: int, world: int) -> dict[str, Any]:
    """Inductor's compiled step of a one-layer model at cp=2 with ``bucket_all_reduces_fx`` off and on: the
    ``all_reduce`` calls in each piece of code it generated, and the gradients (whole)."""
    import torch._inductor.config as inductor
    from torch._inductor.utils import run_and_get_code

    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TPLOWER_GLOO_EXCHANGE_BYTES"] = "0"  # unbucketed, each sum its own all_reduce (not an exchange)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    out: dict[str, Any] = {}
    for bucket in ("none", "all"):
        torch._dynamo.reset()
        model = tplower.parallelize(_model(1), mesh, None, context="cp")
        inductor.bucket_all_reduces_fx = bucket  # the global setting, as prepare_trainer makes it
        compiled = torch.compile(model)

        def step(fn: Any) -> None:
            fn(**tplower.shard_sequence(_batch("plain", 0), mesh, "cp")).loss.backward()

        _, code = run_and_get_code(step, compiled)
        out[bucket] = {"all_reduces": [c.count("_c10d_functional.all_reduce_.default(") for c in code],
                       "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}}
    return out


@slow
def test_inductor_buckets_the_gradient_sums_and_keeps_one_process_gradients() -> None:
    """``bucket_all_reduces_fx="all"`` (what ``prepare_trainer`` sets under ``torch_compile``): the compiled
    backward's per-parameter sums over cp become one ``all_reduce``; the gradients stay one process's."""
    model = _model(1)
    model(**_batch("plain", 0)).loss.backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    for rank in run_processes(2, _bucketed, timeout=900):
        off, on = rank["none"]["all_reduces"], rank["all"]["all_reduces"]
        moved = [i for i, (a, b) in enumerate(zip(off, on, strict=True)) if a != b]
        # one piece of code changed (the backward: one a parameter -> one); the others' (the loss's sums) as they were
        assert len(moved) == 1 and off[moved[0]] >= len(want) - 1 and on[moved[0]] == 1, (off, on)
        for bucket in ("none", "all"):
            for name, grad in rank[bucket]["grads"].items():
                torch.testing.assert_close(grad, want[name], atol=1e-5, rtol=1e-5, msg=f"{bucket} {name}")


def _two_models(rank: int, world: int) -> list[int]:
    """Two models compiled in one process, one a mode (the same hook code, other numbers): graph breaks each."""
    import torch._dynamo as dynamo

    os.environ["OMP_NUM_THREADS"] = "1"
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    dynamo.reset()
    breaks = []
    for mode in ("ulysses", "allgather"):
        dynamo.utils.counters.clear()
        model = torch.compile(tplower.parallelize(_model(1), mesh, None, context="cp", context_mode=mode),
                              backend="aot_eager")
        model(**tplower.shard_sequence(_batch("plain", 0), mesh, "cp")).loss.backward()
        breaks.append(sum(dynamo.utils.counters["graph_break"].values()))
    return breaks


@slow
def test_a_second_model_compiles_without_a_graph_break() -> None:
    """A hook's number for :func:`tplower.runtime.interned.traced` is a string: an int attribute that a second
    value reaches through the same code becomes dynamic, and the second model's hooks broke the graph (2 breaks)."""
    assert run_processes(2, _two_models, timeout=600) == [[0, 0], [0, 0]]
