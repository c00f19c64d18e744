"""The bench's ``moe`` phase: one mixture-of-experts layer's train step, four ways, in the same processes.

The model is a one-layer Qwen3-MoE causal LM (:func:`moe_config`: 8 experts,
top-2, hidden 256, random weights, float32), the input ``MOE_BATCH`` x
``MOE_SEQ`` token ids, the step ``logits.square().mean()``, backward and SGD.
On ``tp`` spawned gloo ranks, interleaved in rounds after a warm-up:

* ``one_process``: the model unparallelized (every rank runs it whole);
* ``tplower_tp``: ``parallelize(model, mesh, "auto")``, tensor parallelism
  inside the experts;
* ``tplower_ep``: ``parallelize(model, mesh, "auto", experts="ep")``, experts
  sharded by index and tokens dispatched;
* ``transformers_tp`` / ``transformers_ep``: transformers' own
  ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=tp,
  tp_plan="auto"[, ep_size=tp]))`` on the same weights (needs ``accelerate``;
  a variant that fails to build is a row with its error);
* with a ``compile_backend`` (``tplower bench --compile``),
  ``tplower_ep_compiled`` and ``transformers_ep_compiled``: ``torch.compile``
  of fresh copies of the two expert-parallel models (a variant that fails to
  compile or run is a row with its error).

Each row has the median train step (milliseconds, the slower rank's view
through a barrier per call), the loss's difference from one process, and,
from one extra untimed step under :class:`tplower.core.lower.traffic.CollectiveTraffic`,
the collectives issued and the bytes each rank sent (forward and backward). A
compiled row adds its first step's seconds (the compile), the graphs dynamo
made over all its steps and the graph breaks of its first step.
"""

from __future__ import annotations

import copy
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..core.lower.traffic import CollectiveTraffic
from ..run.quiet import quiet_transformers
from ..testing import run_processes
from .timing import barrier_rounds

__all__ = ["MOE_BATCH", "MOE_SEQ", "VARIANTS", "moe_config", "moe_phase", "moe_rank"]

#: the input: ``MOE_BATCH`` sequences of ``MOE_SEQ`` token ids
MOE_BATCH, MOE_SEQ = 4, 64
#: the variants, in row order (the compiled ones with a compile backend)
VARIANTS = ("one_process", "tplower_tp", "tplower_ep", "transformers_tp", "transformers_ep", "tplower_ep_compiled",
            "transformers_ep_compiled")


def moe_config() -> Any:
    """The bench's Qwen3-MoE config: one decoder layer whose MLP is an 8-expert top-2 MoE block, float32."""
    import transformers

    config = transformers.Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256, tie_word_embeddings=False)
    config.dtype = torch.float32
    return config


def _model() -> nn.Module:
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model: nn.Module = transformers.Qwen3MoeForCausalLM(moe_config())
    return model.to(torch.float32).train()


def _ids() -> torch.Tensor:
    return torch.randint(0, 512, (MOE_BATCH, MOE_SEQ), generator=torch.Generator().manual_seed(1))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    logits = model(input_ids=ids, use_cache=False).logits
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    loss: torch.Tensor = logits.float().square().mean()
    return loss


def _build(rank: int, world: int, folder: str, compile_backend: str | None = None
           ) -> tuple[dict[str, nn.Module], dict[str, str], dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh

    from ..nn.parallelize import parallelize

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ref = _model()
    models: dict[str, nn.Module] = {"one_process": ref}
    errors: dict[str, str] = {}
    builders: dict[str, Callable[[], nn.Module]] = {
        "tplower_tp": lambda: parallelize(copy.deepcopy(ref), mesh, "auto"),
        "tplower_ep": lambda: parallelize(copy.deepcopy(ref), mesh, "auto", experts="ep"),
        "transformers_tp": lambda: _transformers(folder, world, ep=False),
        "transformers_ep": lambda: _transformers(folder, world, ep=True),
    }
    graphs: dict[str, Any] = {}  # compiled variant -> the backend that counts its graphs
    if compile_backend is not None:  # fresh copies, so each compiled step starts from the same weights
        from torch._dynamo.testing import CompileCounterWithBackend

        for base in ("tplower_ep", "transformers_ep"):
            graphs[f"{base}_compiled"] = counter = CompileCounterWithBackend(compile_backend)
            builders[f"{base}_compiled"] = functools.partial(_compiled, builders[base], counter)
    for name, build in builders.items():
        try:
            models[name] = build().train()
        except Exception as exc:  # a peer that cannot run this model is a row saying why, not the phase's end
            errors[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc) else ''}"
    return models, errors, graphs


def _compiled(build: Callable[[], nn.Module], backend: Any) -> nn.Module:
    model: Any = torch.compile(build(), backend=backend)  # an OptimizedModule: an nn.Module
    return model  # type: ignore[no-any-return]


def _transformers(folder: str, world: int, *, ep: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig

    config = (DistributedConfig(tp_size=world, tp_plan="auto", ep_size=world) if ep
              else DistributedConfig(tp_size=world, tp_plan="auto"))
    model: nn.Module = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, distributed_config=config)
    return model


def moe_rank(rank: int, world: int, folder: str, rounds: int, warmup: int = 1,
             compile_backend: str | None = None) -> list[dict[str, Any]]:
    """Time every variant's train step on this rank; rank 0 returns the rows (see the module docstring).

    Args:
        folder: the one-process model saved with ``save_pretrained`` (transformers' variants load it).
        rounds: timed rounds; ``warmup`` untimed ones first.
        compile_backend: also the compiled expert-parallel variants, with this ``torch.compile`` backend.

    Rows: ``variant``, ``train_step_ms`` (median), ``step_samples_ms``,
    ``loss_diff`` (absolute, from one process, first step), ``collectives``
    (kind -> count per step), ``sent_bytes`` (per rank per step), ``error``;
    compiled rows also ``compile_s`` (the first step), ``graphs``, ``breaks`` and ``break_reasons``.
    """
    with quiet_transformers():
        models, errors, graphs = _build(rank, world, folder, compile_backend)
    ids = _ids()
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    first: dict[str, float] = {}
    traffic: dict[str, CollectiveTraffic] = {}

    def step(key: str) -> float:
        opts[key].zero_grad(set_to_none=True)
        loss = _loss(models[key], ids)
        loss.backward()
        opts[key].step()
        return float(loss.detach())

    compiled: dict[str, dict[str, Any]] = {}
    for key in list(models):  # the first step: the loss before any update, and the traffic of one step
        try:
            if key.endswith("_compiled"):
                compiled[key], first[key] = _first_compiled_step(step, key)
            traffic[key] = CollectiveTraffic()
            with traffic[key]:
                loss = step(key)
            first.setdefault(key, loss)
        except Exception as exc:  # a compiled peer that fails is a row saying why (every rank fails alike)
            if not key.endswith("_compiled"):
                raise
            errors[key] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160] if str(exc) else ''}"
            del models[key]
    samples = barrier_rounds(list(models), step, rounds, warmup)
    if rank != 0:
        return []
    rows: list[dict[str, Any]] = []
    for key in VARIANTS:
        if key in errors:
            rows.append({"variant": key, "error": errors[key]})
            continue
        if key not in models:
            continue
        rows.append({"variant": key, "tp": world, "train_step_ms": statistics.median(samples[key]),
                     "step_samples_ms": samples[key], "loss_diff": abs(first[key] - first["one_process"]),
                     "collectives": dict(traffic[key].counts), "sent_bytes": traffic[key].sent, "error": "",
                     **compiled.get(key, {}), **({"graphs": graphs[key].frame_count} if key in compiled else {})})
    return rows


def _first_compiled_step(step: Callable[[str], float], key: str) -> tuple[dict[str, Any], float]:
    """The compiled variant's first step (its compile): seconds, graph breaks (and their reasons), loss."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    before = dict(counters["graph_break"])
    dist.barrier()
    t0 = time.perf_counter()
    loss = step(key)
    dist.barrier()
    seconds = time.perf_counter() - t0
    new = {reason: n - before.get(reason, 0) for reason, n in counters["graph_break"].items()}
    reasons = [reason.strip().splitlines()[0][:120] for reason, n in new.items() if n > 0]
    return {"compile_s": seconds, "breaks": sum(new.values()), "break_reasons": reasons}, loss


def moe_phase(rounds: int, *, tp: int = 2, timeout: float = 900.0, compile_backend: str | None = None,
              progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """The MoE phase's rows (:func:`moe_rank` on ``tp`` spawned gloo ranks; compiled EP rows with ``compile_backend``).

    Raises:
        ImportError: transformers is missing.
        tplower.testing.RankFailure: a rank failed.
    """
    compiled = f", compiled EP ({compile_backend})" if compile_backend is not None else ""
    progress(f"moe: one Qwen3-MoE layer's train step, tplower TP/EP vs transformers TP/EP{compiled}, tp={tp}")
    with tempfile.TemporaryDirectory(prefix="tplower-moe-") as folder, quiet_transformers():
        model: Any = _model()
        model.save_pretrained(folder)
        rows: list[dict[str, Any]] = run_processes(tp, moe_rank, folder, rounds, 1, compile_backend,
                                                         timeout=timeout)[0]
    return rows
