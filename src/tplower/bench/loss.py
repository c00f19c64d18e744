"""The bench's ``loss`` phase: a train step's loss on gathered logits against the vocabulary-parallel loss.

The model is a Llama of two small layers and a 32000-token vocabulary
(:func:`loss_config`: the logits ``[4, 64, 32000]`` float32, 31.2 MiB, are the
step's largest activation), random weights, on ``tp`` spawned gloo ranks:

* ``gathered``: ``parallelize(model, mesh, "auto")`` (``lm_head``
  ``colwise_gather_output``: every rank holds the whole logits) and
  ``F.cross_entropy`` on them;
* ``vocab_parallel``: the same plan with ``lm_head`` ``colwise`` (each rank
  holds its ``V/tp`` logits) and :func:`tplower.vocab_parallel_cross_entropy`.

Each row has the median train step (forward, backward, SGD; milliseconds,
interleaved, a barrier per call), the loss's difference from one process and
the bytes rank 0 holds for backward after one forward (:func:`saved_bytes`:
every tensor autograd saves, each storage once) and its peak tensor bytes over
a whole step (:func:`tplower.bench.memory.peak_tensor_bytes`: storages the
step creates, alive at once; the parameters not counted).
"""

from __future__ import annotations

import copy
import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..testing import run_processes
from .memory import peak_tensor_bytes
from .timing import barrier_rounds

__all__ = ["LOSS_BATCH", "LOSS_SEQ", "loss_config", "loss_phase", "loss_rank", "saved_bytes"]

#: the input: ``LOSS_BATCH`` sequences of ``LOSS_SEQ`` token ids
LOSS_BATCH, LOSS_SEQ = 4, 64


def loss_config() -> Any:
    """The phase's Llama config: 2 layers, hidden 128, 4 heads, vocabulary 32000 (float32)."""
    import transformers

    return transformers.LlamaConfig(vocab_size=32000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    max_position_embeddings=LOSS_SEQ, tie_word_embeddings=False)


def saved_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """Bytes of the storages autograd saves for backward while ``fn()`` runs (each storage once), and its result.

    Activation memory of a step, measured without a profiler: what forward
    keeps alive until backward frees it (parameters' local views included).
    """
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


def loss_rank(rank: int, world: int, rounds: int, warmup: int = 1) -> list[dict[str, Any]]:
    """Time and measure both variants on this rank; rank 0 returns the rows (see the module docstring)."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from ..core.ops.vocab_loss import vocab_parallel_cross_entropy
    from ..nn.parallelize import parallelize
    from ..plans.hf import model_tp_plan

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ref: nn.Module = transformers.LlamaForCausalLM(loss_config()).float()
    ids = torch.randint(0, 32000, (LOSS_BATCH, LOSS_SEQ), generator=torch.Generator().manual_seed(1))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = {"gathered": parallelize(copy.deepcopy(ref), mesh, "auto"),
                  "vocab_parallel": parallelize(copy.deepcopy(ref), mesh, {**model_tp_plan(ref), "lm_head": "colwise"})}
    losses: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "gathered": lambda logits: F.cross_entropy(logits.flatten(0, 1), labels.flatten()),
        "vocab_parallel": lambda logits: vocab_parallel_cross_entropy(logits, labels, mesh),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    with torch.no_grad():
        want = float(F.cross_entropy(ref(input_ids=inputs).logits.flatten(0, 1), labels.flatten()))

    def step(key: str) -> float:
        opts[key].zero_grad(set_to_none=True)
        loss = losses[key](models[key](input_ids=inputs, use_cache=False).logits)
        loss.backward()
        opts[key].step()
        return float(loss.detach())

    first: dict[str, float] = {}
    saved: dict[str, int] = {}
    peaks: dict[str, int] = {}
    for key in models:
        held, value = saved_bytes(lambda k=key: step(k))  # type: ignore[misc]
        saved[key], first[key] = held, float(value)  # type: ignore[arg-type]
        peaks[key], _ = peak_tensor_bytes(lambda k=key: step(k))  # type: ignore[misc]
    samples = barrier_rounds(list(models), step, rounds, warmup)
    if rank != 0:
        return []
    logits_bytes = LOSS_BATCH * (LOSS_SEQ - 1) * 32000 * 4
    return [{"variant": k, "tp": world, "train_step_ms": statistics.median(v), "step_samples_ms": v,
             "saved_bytes": saved[k], "peak_bytes": peaks[k], "logits_bytes": logits_bytes,
             "loss_diff": abs(first[k] - want)}
            for k, v in samples.items()]


def loss_phase(rounds: int, *, tp: int = 2, timeout: float = 900.0,
               progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """The loss phase's rows (:func:`loss_rank` on ``tp`` spawned gloo ranks).

    Raises:
        tplower.testing.RankFailure: a rank failed (transformers missing included).
    """
    progress(f"loss: vocabulary-parallel cross-entropy vs gathered logits, vocabulary 32000, tp={tp}")
    rows: list[dict[str, Any]] = run_processes(tp, loss_rank, rounds, 1, timeout=timeout)[0]
    return rows
