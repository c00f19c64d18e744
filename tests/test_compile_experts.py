"""torch.compile of what used to break the graph: expert parallelism's dispatch and an uneven vocabulary's gather.

One spawn of 2 gloo ranks (fresh processes: nothing compiled before) runs:

* a one-layer Qwen3-MoE under ``parallelize(..., "auto", experts="ep")``,
  compiled with ``fullgraph=True`` (``aot_eager``: AOT autograd's forward and
  backward graphs; ``TPLOWER_SLOW=1`` adds inductor), three SGD train steps
  whose routing differs, on 9 tokens (5 + 4 a rank): one compile and no graph
  break, and the loss, the logits and every gradient equal to one process's
  and to eager expert parallelism's;
* a one-layer Llama whose vocabulary (257) divides by no tp, ``"auto"``
  plan: the lm_head's gathered logits take their global size from the weight
  (``torch.chunk`` pieces 129 + 128) with no size exchange: no graph break
  compiled, and eager issues the one ``all_gather`` of the logits; and the
  dispatch's exchange operator against the eager variable-split exchange,
  forward and backward, eager and compiled without ``fullgraph`` (one graph:
  its unbacked row count needs no ``capture_dynamic_output_shape_ops``).
"""

from __future__ import annotations

import copy
import os
import types
import warnings
from typing import Any, cast

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import tplower
from tplower import TPLowerError
from tplower.core.lower.redistribute import MeshLowerer
from tplower.runtime.uneven import known_global_shape
from tplower.testing import run_processes

transformers = pytest.importorskip("transformers")
TOL = {"atol": 1e-5, "rtol": 1e-5}
BACKENDS = ("aot_eager", "inductor") if os.environ.get("TPLOWER_SLOW") == "1" else ("aot_eager",)


def _qwen3_moe() -> Any:
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.Qwen3MoeForCausalLM(config).float().train()


def _llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=257,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).float()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _steps(compiled: Any, models: list[Any], vocab: int, tokens: int) -> float:
    """Three SGD steps of each model (the compiled one first) on new ids each; the worst difference from the last
    model (one process) in loss, logits and every gradient, relative to the gradient's largest entry."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    worst = 0.0
    for step in range(3):
        ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(step))
        outs = []
        for i, (model, opt) in enumerate(zip(models, opts, strict=True)):
            opt.zero_grad(set_to_none=True)
            out = (compiled if i == 0 else model)(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            outs.append(out)
        want = outs[-1]
        for out, model in zip(outs[:-1], models[:-1], strict=True):
            torch.testing.assert_close(out.loss, want.loss, **TOL)
            torch.testing.assert_close(out.logits, want.logits, **TOL)
            for (name, p), q in zip(model.named_parameters(), models[-1].parameters(), strict=True):
                assert (p.grad is None) == (q.grad is None), name
                if q.grad is not None:
                    scale = max(float(q.grad.abs().max()), 1e-6)
                    worst = max(worst, float((_full(p.grad) - q.grad).abs().max()) / scale)
        for opt in opts:
            opt.step()
    return worst


def _compiled_steps(ref: Any, mesh: Any, backend: str, experts: str) -> dict[str, Any]:
    import torch._dynamo
    import torch._dynamo.testing
    from torch._dynamo.utils import counters

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = [tplower.parallelize(copy.deepcopy(ref), mesh, "auto", experts=experts) for _ in range(2)]
    torch._dynamo.reset()
    counters.clear()
    cnt = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(models[0], backend=cnt, fullgraph=True)
    tokens = 9 if experts == "ep" else 8
    worst = _steps(compiled, [*models, copy.deepcopy(ref)], ref.config.vocab_size, tokens)
    return {
        "worst": worst,
        "frames": int(cnt.frame_count),
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "model": models[1],
    }


def _exchange_op(rank: int, world: int) -> dict[str, Any]:
    """``tplower::split_exchange`` against ``all_to_all_splits`` (the rows and the input gradient), eager and under
    a plain ``torch.compile`` (no ``fullgraph``, which would allow data-dependent sizes on its own)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tplower.core.lower.traffic import CollectiveTraffic
    from tplower.core.ops.dispatch import all_to_all_splits
    from tplower.core.ops.dispatch_traced import split_exchange

    group = torch.distributed.group.WORLD
    matrix = [[2, 3], [0, 4]]  # rank 1 sends nothing to rank 0

    def exchange(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = split_exchange(x * 1, m, rank, group.group_name)
        return out * 1

    torch._dynamo.reset()
    counters.clear()
    worst = []
    for fn in (exchange, torch.compile(exchange, backend="aot_eager")):
        x = torch.randn(sum(matrix[rank]), 3, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        xe = x.detach().clone().requires_grad_()
        y = fn(x, torch.tensor(matrix))
        ye = all_to_all_splits(xe, group=group, matrix=matrix, rank=rank)
        seed = torch.randn(ye.shape, generator=torch.Generator().manual_seed(9 + rank))
        (y * seed).sum().backward()
        (ye * seed).sum().backward()
        assert x.grad is not None and xe.grad is not None
        worst.append(max(float((y - ye).abs().max()), float((x.grad - xe.grad).abs().max())))
    with CollectiveTraffic() as traffic:  # the operator counts as the all_to_all its kernel issues
        split_exchange(torch.zeros(sum(matrix[rank]), 3), torch.tensor(matrix), rank, group.group_name)
    return {
        "worst": worst,
        "breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
        "traffic": (dict(traffic.counts), traffic.sent),
    }


def _ep(mesh: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for backend in BACKENDS:
        ep = _compiled_steps(_qwen3_moe(), mesh, backend, "ep")
        outs = ep.pop("model").model.layers[0].mlp.experts.forward.outs
        out[backend] = {**ep, "like_input": [mv.like_input for mv in outs]}
    return out


def _vocab(rank: int, world: int, mesh: Any) -> dict[str, Any]:
    from tplower.core.lower.traffic import CollectiveTraffic

    out: dict[str, Any] = {"exchange": _exchange_op(rank, world)}
    for backend in BACKENDS:
        vocab = _compiled_steps(_llama(), mesh, backend, "tp")
        model = vocab.pop("model")
        out[backend] = {**vocab, "param_size": model.lm_head.forward.outs[0].param_size}
    with torch.no_grad(), CollectiveTraffic() as traffic:
        model(input_ids=torch.zeros(1, 8, dtype=torch.long), use_cache=False)
    out["eager_forward"] = dict(traffic.counts)
    return out


def _body(rank: int, world: int) -> dict[str, Any]:
    """Both halves in one spawn (each resets dynamo and its counters before it compiles)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return {"ep": _ep(mesh), "vocab": _vocab(rank, world, mesh)}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    res: list[dict[str, Any]] = run_processes(2, _body, timeout=900)
    return res


@pytest.fixture(scope="module")
def ep_ranks(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["ep"] for r in ranks]


@pytest.fixture(scope="module")
def vocab_ranks(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["vocab"] for r in ranks]


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_parallel_train_step_compiles_once_without_a_break(ep_ranks: list[dict[str, Any]], backend: str) -> None:
    for r in ep_ranks:
        ep = r[backend]
        assert ep["breaks"] == 0 and ep["frames"] == 1 and ep["graphs"] == 1, ep  # three routings, one graph
        assert ep["worst"] <= 1e-5, ep  # compiled and eager expert parallelism against one process
        assert ep["like_input"] == [0], ep  # the experts' output is sized by their tokens, not exchanged


def test_split_exchange_is_the_variable_split_exchange(vocab_ranks: list[dict[str, Any]]) -> None:
    # by hand: rank 0 sends 3 rows of 3 float32 (36 B) to rank 1, rank 1 none to rank 0
    for r, sent in zip(vocab_ranks, (36, 0), strict=True):
        assert r["exchange"] == {"worst": [0.0, 0.0], "breaks": 0, "graphs": 1, "traffic": ({"all_to_all": 1}, sent)}, (
            r["exchange"]
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_uneven_vocabulary_gather_compiles_without_a_break(vocab_ranks: list[dict[str, Any]], backend: str) -> None:
    for rank, r in enumerate(vocab_ranks):
        v = r[backend]
        assert v["breaks"] == 0 and v["frames"] == 1 and v["graphs"] == 1, v
        assert v["worst"] <= 1e-5, v
        assert v["param_size"] == (257, torch.arange(257).chunk(2)[rank].numel()), v  # torch.chunk's pieces
        # forward: the embedding's, o_proj's and down_proj's all_reduce and the logits' all_gather; no size exchange
        assert r["eager_forward"] == {"all_reduce": 3, "all_gather": 1}, r["eager_forward"]


def test_a_rank_whose_size_is_not_its_piece_says_so() -> None:
    lowerer = cast(MeshLowerer, types.SimpleNamespace(coord=(1,), shape=(2,), names=("tp",)))
    logits = torch.zeros(2, 3, 128)
    assert known_global_shape(logits, (Shard(-1),), lowerer, "lm_head", params=(257, 128)) == (2, 3, 257)
    with pytest.raises(
        TPLowerError,
        match=r"lm_head: dim 2 is 129 on this rank \(coordinate 1 of mesh axis 'tp'\), "
        r"not its torch.chunk piece 128 of the 257",
    ):
        known_global_shape(torch.zeros(2, 3, 129), (Shard(-1),), lowerer, "lm_head", params=(257, 128))
    tokens = torch.zeros(9, 4)
    assert known_global_shape(torch.zeros(4, 4), (Shard(0),), lowerer, "experts", cut_from=tokens) == (9, 4)
    with pytest.raises(TPLowerError, match=r"experts: dim 0 is 5 on this rank .* piece 4 of the 9 it was cut from"):
        known_global_shape(torch.zeros(5, 4), (Shard(0),), lowerer, "experts", cut_from=tokens)
    with pytest.raises(TPLowerError, match="input it was cut from, which was not given as a tensor of 2 dims"):
        known_global_shape(torch.zeros(4, 4), (Shard(0),), lowerer, "experts", cut_from=None)


@pytest.fixture(scope="module", autouse=True)
def _native_all_reduce(native_all_reduce: None) -> None:
    """This module counts collectives by the names the lowering gives them: gloo's small all_reduces run natively."""
