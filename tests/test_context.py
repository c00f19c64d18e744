"""Context parallelism on transformers models as shipped, against one process on the whole batch (2 gloo ranks).

One spawn runs every case of this file (a process start is the dearest
thing here); the tests read its results. The slice below runs every model
in each mode, alternating the implementation, the length (64 and 37, which
2·cp does not divide), the balance and the kind of batch (padded, packed);
``test_context_matrix.py`` runs the whole product under ``slow``.
Every case is ``tplower.parallelize(model, mesh, None, context="cp")``, whose parameters get their
gradients summed over ``cp`` (:mod:`context_cases`).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from context_cases import Case, batch, matches, named, run_case, tiny
from torch import nn

from tplower.core.support.errors import TPLowerError
from tplower.testing import run_processes

TOL = 1e-5
CASES = [
    Case("llama", "ulysses", "eager", 64, True, "padded"),
    Case("llama", "allgather", "sdpa", 37, False, "packed"),
    Case("qwen2", "ulysses", "sdpa", 37, True, "packed"),
    Case("qwen2", "allgather", "eager", 64, False, "padded"),
    Case("mistral", "ulysses", "sdpa", 37, False, "padded"),
    Case("mistral", "allgather", "eager", 64, True, "packed"),
    Case("gemma2", "ulysses", "eager", 64, False, "packed"),
    Case("gemma2", "allgather", "eager", 37, True, "padded"),
    Case("qwen3_moe", "ulysses", "eager", 37, True, "padded"),
    Case("qwen3_moe", "allgather", "sdpa", 64, False, "packed"),
    Case("llama_mqa", "ulysses", "sdpa", 37, True, "padded"),  # 1 key/value head, cp=2: repeated
    Case("llama_h3", "allgather", "sdpa", 37, True, "padded"),  # 3 heads: allgather needs no head split
    Case("gpt_oss", "ulysses", "eager", 37, True, "padded"),  # sinks: each rank's kernel reads its heads' slice
    Case("llama", "ulysses", "sdpa", 64, True, "plain"),  # no mask: sdpa's causal kernel, as one process
    Case("llama", "allgather", "eager", 3, True, "plain"),  # pieces of 1, 1, 1 and 0 tokens: ranks hold 1 and 2
    Case("llama", "ulysses", "sdpa", 2, True, "plain"),  # a token a rank
    Case("nemotron", "allgather", "sdpa", 37, False, "packed"),  # the split reaches attention without kwargs
    # the loss in chunks of positions: softcapped logits (Gemma 2), a chunk that does not divide the local length
    Case("gemma2", "ulysses", "eager", 37, True, "padded", loss_chunk=8),
    Case("llama", "allgather", "sdpa", 64, False, "packed", loss_chunk=5),
    # the hybrid at cp=2: Ulysses degree 2 from the heads (one group of 2), and degree 1 (2 groups of one rank)
    Case("llama", "hybrid", "sdpa", 37, True, "padded"),
    Case("llama", "hybrid", "sdpa", 64, False, "packed", ulysses=1),
]
#: a sequence long enough that a whole-sequence mask or score table stands out: with ``sdpa``, no tensor of a
#: causal step has two trailing dims of half the sequence or more, in either mode and for every batch kind (one
#: process's step holds a [B, 1, S, S] mask, and its math path [B, H, S, S] scores, for a padded or packed batch)
LONG = 509
SQUARES = [Case("llama", mode, "sdpa", LONG, True, kind) for mode in ("ulysses", "allgather")
           for kind in ("plain", "padded", "ragged", "packed")] + [
    # a sliding window (sdpa): blocks of the window, each against the keys it sees, no whole-sequence mask
    Case("mistral_w24", mode, "sdpa", LONG, True, kind) for mode in ("ulysses", "allgather")
    for kind in ("plain", "ragged", "packed")]
#: sliding windows under cp=2 (sdpa, blocks of the window with a band mask): a window smaller than a piece (4 of
#: 16 tokens) and one spanning pieces (24), every batch kind, each mode
#: (every model with every mode, each batch kind twice; the whole matrix with TPLOWER_SLOW=1)
KINDS = ("plain", "ragged", "packed")
WINDOWS = [Case(model, mode, "sdpa", 64, True, kind) for m, model in enumerate(("mistral_w4", "mistral_w24"))
           for k, mode in enumerate(("ulysses", "allgather", "hybrid")) for kind in KINDS
           if os.environ.get("TPLOWER_SLOW") or kind == KINDS[(k + m) % 3]] + [
    # the hybrid as 2 groups of one rank (its exchange across groups under the window), and uneven pieces
    Case("mistral_w4", "hybrid", "sdpa", 64, True, "packed", ulysses=1),
    Case("mistral_w24", "hybrid", "sdpa", 64, True, "ragged", ulysses=1),
    Case("mistral_w24", "allgather", "sdpa", 37, False, "plain")]
#: keys (each with its value) a rank sends per layer and step, forward and backward together, in the all-gather
#: mode under a window, by hand. 64 tokens balanced: rank 0 holds [0, 16) and [48, 64), rank 1 [16, 48); a piece
#: [a, b) reaches the keys [a - W + 1, b). W=4: rank 1's [16, 32) needs [13, 16) of rank 0, rank 0's [48, 64) needs
#: [45, 48) of rank 1: 3 keys each way, forward, and their gradients back. W=24: rank 1 needs [0, 16) (16 keys, for
#: [16, 32), and [9, 16) for [32, 48) among them), rank 0 needs [25, 48) (23): 16 + 23 a rank. 37 tokens, one piece
#: a rank ([0, 19) and [19, 37)), W=24: rank 1's piece needs all of rank 0's 19, rank 0 needs none: 19 + 0. The
#: all-gather of every key sends a whole (padded) piece each way: 32 + 32 and 19 + 19.
WINDOW_KEYS = {"mistral_w4-allgather-sdpa-64-bal-ragged": (6, 64), "mistral_w24-allgather-sdpa-64-bal-packed": (39, 64),
               "mistral_w4-hybrid-sdpa-64-bal-packed-u1": (6, 64), "mistral_w24-hybrid-sdpa-64-bal-ragged-u1": (39, 64),
               "mistral_w24-allgather-sdpa-37-even-plain": (19, 38)}
#: the cases whose collectives are counted at the dispatcher and compared with what explain_context computes: a
#: 2-layer model's exchanges (Ulysses moves q, k, v and the output each way; all-gather gathers k and v and
#: reduce-scatters their gradients; the hybrid as 1 x 2 runs Ulysses inside the one group, as 2 x 1 gathers across
#: the 2 groups), the loss made whole, and the gradients summed over cp at the end of backward (one all_reduce
#: for tiny Llama's 21 parameters, whichever modules a rank called)
COUNTED = ("llama-ulysses-eager-64-bal-padded", "llama-allgather-sdpa-37-even-packed",
           "llama-hybrid-sdpa-37-bal-padded", "llama-hybrid-sdpa-64-even-packed-u1")


class _Mixer(nn.Module):
    """A token mixer that does not call the attention interface (a running mean over the sequence)."""

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
        steps = torch.arange(1, hidden_states.shape[1] + 1, device=hidden_states.device).view(1, -1, 1)
        return hidden_states.cumsum(1) / steps, None


def _biased_forward(self: Any, **kwargs: Any) -> Any:
    """A causal LM's forward that adds 1 to the first vocabulary entry's logit after the head."""
    out = super(type(self), self).forward(**kwargs)
    out.logits = out.logits + torch.nn.functional.one_hot(torch.tensor(0), out.logits.shape[-1])
    return out


def _refusal(make: Any, mesh: Any, **kw: Any) -> str:
    from tplower.context import install_context

    try:
        install_context(make(), mesh, **kw)
    except TPLowerError as e:
        return str(e)
    return "no error"


def _refusals(mesh: Any, world: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    from tplower.context import install_context, shard_sequence

    def qwen3_next() -> nn.Module:
        from transformers import AutoModelForCausalLM

        from tplower.run.hf_configs import tiny_config
        return AutoModelForCausalLM.from_config(tiny_config("qwen3_next"))

    def no_interface() -> nn.Module:
        m = tiny("llama", "sdpa")
        m.model.layers[1].self_attn = _Mixer()
        return m

    def router_loss() -> nn.Module:
        m = tiny("qwen3_moe", "sdpa")
        m.config.output_router_logits = True
        return m

    def biased() -> nn.Module:  # a forward that moves the logits after the head in a way of its own
        m = tiny("llama", "sdpa")
        m.__class__ = type("BiasedLlama", (type(m),), {"forward": _biased_forward})
        return m

    out = {
        "loss_chunk": _refusal(lambda: tiny("llama", "sdpa"), mesh, loss_chunk=0),
        "loss_chunk_head": _refusal(lambda: tiny("llama", "sdpa").model, mesh, loss_chunk=4),
        "axis": _refusal(lambda: tiny("llama", "sdpa"), init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))),
        "mode": _refusal(lambda: tiny("llama", "sdpa"), mesh, mode="ring"),
        "heads": _refusal(lambda: tiny("llama_h3", "sdpa"), mesh, mode="ulysses"),
        "recurrent": _refusal(qwen3_next, mesh),
        "no_interface": _refusal(no_interface, mesh),
        "flex": _refusal(lambda: tiny("llama", "flex_attention"), mesh),
        "router_loss": _refusal(router_loss, mesh),
    }
    model = tiny("llama", "sdpa")
    install_context(model, mesh)
    ids = torch.randint(0, 128, (1, 8))
    part = shard_sequence({"input_ids": ids, "labels": ids}, mesh)
    as_tuple = model(**part, return_dict=False)[0]  # the loss comes first in a tuple too, made whole
    out["tuple_loss"] = f"{float((as_tuple - model(**part).loss).abs()):.1e}"
    tiled, odd = tiny("llama", "sdpa"), biased()
    install_context(tiled, mesh, loss_chunk=4)
    install_context(odd, mesh, loss_chunk=4)
    labelled = shard_sequence({"input_ids": ids, "labels": ids}, mesh)
    for name, call in (("loss_chunk_tuple", lambda: tiled(**labelled, return_dict=False)),
                       ("loss_chunk_count", lambda: tiled(**{k: v for k, v in labelled.items()
                                                             if k != "num_items_in_batch"})),
                       ("loss_chunk_logits", lambda: odd(**labelled)),
                       ("twice", lambda: install_context(model, mesh)),
                       ("no_split", lambda: model(input_ids=ids)),
                       ("use_cache", lambda: model(**shard_sequence({"input_ids": ids}, mesh), use_cache=True)),
                       ("generate", lambda: model.generate(input_ids=ids, max_new_tokens=2))):
        try:
            call()
            out[name] = "no error"
        except TPLowerError as e:
            out[name] = str(e)
    return out


def _stack(mesh: Any, world: int, folder: str) -> dict[str, float]:
    """Activation checkpointing against one process; a DCP checkpoint saved at cp=2 read at tp=2."""
    import copy

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import tplower
    from tplower.context import shard_sequence

    ref = tiny("llama", "sdpa").train()
    model = tplower.parallelize(copy.deepcopy(ref), mesh, None, context="cp")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    whole = batch("padded", 37)
    ref(**whole, use_cache=False).loss.backward()
    model(**shard_sequence(whole, mesh)).loss.backward()
    checkpointed = max(float((q.grad.to_local() - p.grad).abs().max())
                       for p, q in zip(ref.parameters(), model.parameters(), strict=True))
    dcp.save(model.state_dict(), checkpoint_id=folder)
    other = tiny("llama", "sdpa")
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other = tplower.parallelize(other, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), "auto")
    state = other.state_dict()
    dcp.load(state, checkpoint_id=folder)
    other.load_state_dict(state)
    read = max(float(((q.full_tensor() if isinstance(q, DTensor) else q) - p).detach().abs().max())
               for p, q in zip(ref.parameters(), other.parameters(), strict=True))
    return {"checkpointed": checkpointed, "dcp": read}


def _body(rank: int, world: int, cases: list[Case], folder: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    results = {c.name: named(run_case, c, mesh, count=c.name in COUNTED or c in WINDOWS) for c in [*cases, *WINDOWS]}
    results.update({c.name: named(run_case, c, mesh, squares=True) for c in SQUARES})
    return {"cases": results, "refusals": _refusals(mesh, world), "stack": _stack(mesh, world, folder)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("cp_checkpoint")
    out: list[dict[str, Any]] = run_processes(2, _body, CASES, str(folder), timeout=600)
    return out


def test_activation_checkpointing_and_a_checkpoint_read_at_another_layout(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        # gradients with activation checkpointing (the recompute exchanges again) as one process's
        assert r["stack"]["checkpointed"] <= TOL, r["stack"]
        # saved from cp=2 (every parameter replicated over cp), read into tp=2 (the shipped plan's shards)
        assert r["stack"]["dcp"] == 0.0, r["stack"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_one_process(ranks: list[dict[str, Any]], case: Case) -> None:
    for got in (r["cases"][case.name] for r in ranks):
        matches(case, got, TOL)


@pytest.mark.parametrize("case", WINDOWS, ids=lambda c: c.name)
def test_sliding_windows_match_one_process(ranks: list[dict[str, Any]], case: Case) -> None:
    for got in (r["cases"][case.name] for r in ranks):
        matches(case, got, TOL)


@pytest.mark.parametrize("case", SQUARES, ids=lambda c: c.name)
def test_no_whole_sequence_mask_for_padded_or_packed_batches(ranks: list[dict[str, Any]], case: Case) -> None:
    for rank, got in enumerate(r["cases"][case.name] for r in ranks):
        matches(case, got, TOL)
        assert got["square"] < LONG // 2, (rank, got["square"])  # tokens x features at most, no [q, k] table


def _predicted(case: Case) -> dict[str, Any]:
    """What explain_context computes for ``case``'s mode: its rows and bytes."""
    from tplower.context.explain import explain_context

    model = tiny(case.model, case.impl)
    c = model.config
    info = explain_context(2, case.seq, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, 2,
                           layers=c.num_hidden_layers, head_dim=c.head_dim, balance=case.balance,
                           params=sum(p.numel() for p in model.parameters()), ulysses=case.ulysses,
                           tensors=len(list(model.parameters())), window=getattr(c, "sliding_window", None))
    return dict(info[case.mode])


@pytest.mark.parametrize("case", [c for c in CASES if c.name in COUNTED], ids=lambda c: c.name)
def test_collectives_per_step_are_what_explain_predicts(ranks: list[dict[str, Any]], case: Case) -> None:
    want: dict[str, int] = {}
    for row in _predicted(case)["rows"]:
        want[row["collective"]] = want.get(row["collective"], 0) + row["count"]
    assert want["all_reduce"] == 2  # the loss, and every gradient's sum (tiny Llama is far below 25 MiB)
    for r in ranks:
        assert r["cases"][case.name]["counts"] == want


@pytest.mark.parametrize("case", [c for c in CASES if c.name in COUNTED], ids=lambda c: c.name)
def test_bytes_counted_at_the_dispatcher_are_what_explain_predicts(ranks: list[dict[str, Any]], case: Case) -> None:
    for r in ranks:
        assert r["cases"][case.name]["sent"] == _predicted(case)["step_bytes_per_rank"]


@pytest.mark.parametrize("case", [c for c in WINDOWS if c.name in WINDOW_KEYS], ids=lambda c: c.name)
def test_windowed_all_gather_sends_only_the_keys_the_windows_reach(ranks: list[dict[str, Any]], case: Case) -> None:
    c = tiny(case.model, case.impl).config
    key = 2 * 2 * c.num_key_value_heads * c.head_dim * 4  # a key and its value, 2 rows, float32
    keys, every = WINDOW_KEYS[case.name]
    assert keys < every
    for r in ranks:
        got = r["cases"][case.name]
        # one all_to_all of keys and values a layer each way; no key gathered whole, no gradient reduce-scattered
        assert got["counts"] == {"all_to_all": 2 * c.num_hidden_layers, "all_reduce": 2}, got["counts"]
        assert got["sent_by_kind"]["all_to_all"] == keys * c.num_hidden_layers * key
        assert got["sent"] == _predicted(case)["step_bytes_per_rank"]  # explain --context says the same


REFUSED = {
    "loss_chunk": ("loss_chunk=0", ">= 1"),
    "loss_chunk_head": ("LlamaModel", "causal LM", "head is none", "drop loss_chunk"),
    "loss_chunk_tuple": ("return_dict=False",),
    "loss_chunk_count": ("num_items_in_batch", "shard_sequence"),
    "loss_chunk_logits": ("BiasedLlama", "after the output head", "drop loss_chunk"),
    "axis": ("axis='cp'", "('dp',)"),
    "mode": ("'ring'", "ulysses", "allgather"),
    "heads": ("3 query heads", "context_mode='allgather'"),
    "recurrent": ("model.layers.0 (Qwen3NextDecoderLayer)", "'linear_attention'", "without context="),
    "no_interface": ("model.layers.1 (LlamaDecoderLayer)", "ALL_ATTENTION_FUNCTIONS", "without context="),
    "flex": ("flex_attention", "'sdpa'"),
    "router_loss": ("output_router_logits",),
    "twice": ("already installed",),
    "no_split": ("shard_sequence",),
    "use_cache": ("KV cache", "without context="),
    "generate": ("generate()", "without context="),
}


def test_tuple_output_loss_is_whole(ranks: list[dict[str, Any]]) -> None:
    assert [r["refusals"]["tuple_loss"] for r in ranks] == ["0.0e+00", "0.0e+00"]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refusals_name_the_fix(ranks: list[dict[str, Any]], name: str) -> None:
    for r in ranks:
        message = r["refusals"][name]
        for part in REFUSED[name]:
            assert part in message, (name, message)


@pytest.fixture(scope="module", autouse=True)
def _native_all_reduce(native_all_reduce: None) -> None:
    """This module counts collectives by the names the lowering gives them: gloo's small all_reduces run natively."""
