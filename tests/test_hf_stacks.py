"""``tplower.hf``: transformers' and TRL's trainers and accelerate loops on gloo ranks against one process's own.

One spawn of 2 ranks runs the default scenarios (a process start and transformers' imports are the dearest things
here): ``prepare_trainer`` at tp=2 with the model's own plan (gradient accumulation 2 x 2 rows, checkpoints every
3 steps, then a resume from step 3), at cp=2 in both modes (a packed and a padded batch, predictions made
whole) and at dp=2 (FSDP2, unequal token counts per rank); an accelerate loop through ``prepare_accelerator`` at
tp=2 (``save_state`` after step 3, a fresh loop's ``load_state`` ending where the uninterrupted one ended); the
naive routes a user takes without the call (DDP's constructor and DDP's forward over a parallelized model, the
plain ``Trainer``) and ``prepare_trainer``'s refusals.
Each scenario is compared with :mod:`hf_cases`: 5 steps of 4 rows x 32 tokens, AdamW 1e-3, clipping at 1.0:
losses and gradient norms (1e-4 relative), every first-step gradient, the final parameters, ``eval_loss``, the
``save_model`` folder loaded by ``from_pretrained`` in one process. With ``TPLOWER_SLOW=1``: TRL's ``SFTTrainer``
packing at cp=2 (both modes) and padding-free at tp=2, TRL's ``DPOTrainer`` at tp=2, Qwen3-MoE with expert
parallelism, the naive routes through a ``TrainerCallback`` and ``Accelerator.prepare``, and on 4 ranks dp=2 x tp=2
and dp=2 x cp=2 (FSDP2 over dp), each resumed from its step-3 checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hf_cases import Scenario, announce, build, candidate, differences, loop, mesh_of, oracle, reloaded, whole

from tplower.testing import run_processes

SLOW = os.environ.get("TPLOWER_SLOW") == "1"
TOL = {"loss": 1e-4, "grad_norm": 1e-4, "grads": 1e-4, "params": 5e-5, "eval_loss": 1e-4, "predictions": 1e-4,
       "reloaded": 5e-5}
CP, ULYSSES, ALLGATHER = ("context", "cp"), ("context_mode", "ulysses"), ("context_mode", "allgather")
DEFAULT = [
    Scenario("tp2", (("tp", 2),), accumulation=2, checkpoint=True),
    Scenario("cp2-ulysses-packed", (("cp", 2),), (CP, ULYSSES), data="packed", predict=True),
    Scenario("cp2-allgather-padded", (("cp", 2),), (CP, ALLGATHER), predict=True),
    Scenario("dp2", (("dp", 2),), predict=True),  # FSDP2 alone; the rows' label counts differ between the ranks
]
SLOW_2 = [
    Scenario("sft-cp2-ulysses", (("cp", 2),), (CP, ULYSSES), trainer="sft"),
    Scenario("sft-cp2-allgather", (("cp", 2),), (CP, ALLGATHER), trainer="sft"),
    Scenario("sft-tp2", (("tp", 2),), trainer="sft"),
    Scenario("dpo-tp2", (("tp", 2),), trainer="dpo"),
    Scenario("qwen3moe-ep2", (("ep", 2),), model="qwen3_moe"),
    Scenario("qwen3moe-tp2-experts-ep", (("tp", 2),), (("experts", "ep"),), model="qwen3_moe"),
]
SLOW_4 = [
    Scenario("dp2-tp2", (("dp", 2), ("tp", 2)), predict=True, checkpoint=True),
    Scenario("dp2-cp2", (("dp", 2), ("cp", 2)), (CP,), accumulation=2, predict=True, checkpoint=True),
]
LOOP = Scenario("accelerate-tp2", (("tp", 2),))
#: the naive routes each raise this error's first words (the message names prepare_trainer)
REFUSED = "TPLowerError: tplower: DistributedDataParallel cannot train a model tplower.parallelize placed"


def _refused(run: Any) -> str:
    try:
        run()
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        return text if "\n" not in text else "more than one line: " + text
    return "no error"


def _naive(rank: int, world: int, slow: bool) -> dict[str, str]:
    """A parallelized model where DDP would take it, without prepare_trainer: each route's error line."""
    from torch.nn.parallel import DistributedDataParallel
    from transformers import TrainerCallback

    import tplower

    sc = DEFAULT[0]
    mesh = mesh_of(sc)
    x = {"input_ids": torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))}
    wrapped = DistributedDataParallel(build(sc, tempfile.mkdtemp(), 4, 1, {}).model)
    tplower.parallelize(wrapped.module, mesh, "auto")  # parallelized after DDP (and an optimizer) took it
    out = {"ddp_constructor": _refused(lambda: DistributedDataParallel(tplower.parallelize(
               build(sc, tempfile.mkdtemp(), 4, 1, {}).model, mesh, "auto"))),
           "ddp_forward": _refused(lambda: wrapped(**x))}
    trainer = build(sc, tempfile.mkdtemp(), 4, 1, {})
    tplower.parallelize(trainer.model, mesh, "auto")
    out["trainer"] = _refused(trainer.train)
    if slow:
        class Late(TrainerCallback):  # type: ignore[misc]
            def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
                tplower.parallelize(model, mesh, "auto")

        late = build(sc, tempfile.mkdtemp(), 4, 1, {})
        late.add_callback(Late())
        out["callback"] = _refused(late.train)
        from accelerate import Accelerator

        model = tplower.parallelize(build(sc, tempfile.mkdtemp(), 4, 1, {}).model, mesh, "auto")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out["accelerator_prepare"] = _refused(lambda: Accelerator(cpu=True).prepare(model, opt))
    return out


def _refusals(rank: int, world: int) -> dict[str, tuple[str, bool]]:
    """prepare_trainer's refusals: each one's error line, and whether the model was left as it was."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import Trainer

    import tplower
    import tplower.hf

    class PerSequence(Trainer):  # type: ignore[misc]
        """A user's own loss (here the same one, but tplower cannot know it is a sum over tokens)."""

        def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
            return super().compute_loss(*args, **kwargs)

    sc = DEFAULT[0]
    tp, cp = mesh_of(sc), mesh_of(DEFAULT[1])

    def refused(trainer: Any, mesh: Any, **kw: Any) -> tuple[str, bool]:
        line = _refused(lambda: tplower.hf.prepare_trainer(trainer, mesh, **kw))
        untouched = not any(isinstance(p, DTensor) for p in trainer.model.parameters()) or kw.get("already")
        return line, bool(untouched)

    with_optimizer = build(sc, tempfile.mkdtemp(), 4, 1, {})
    with_optimizer.create_optimizer()
    smoothing = build(sc, tempfile.mkdtemp(), 4, 1, {}, label_smoothing_factor=0.1)
    own = build(sc, tempfile.mkdtemp(), 4, 1, {})
    own = PerSequence(model=own.model, args=own.args, train_dataset=own.train_dataset)
    twice = build(sc, tempfile.mkdtemp(), 4, 1, {})
    tplower.parallelize(twice.model, tp, "auto")
    return {"optimizer exists": refused(with_optimizer, tp),
            "label smoothing under cp": refused(smoothing, cp, context="cp"),
            "own compute_loss under cp": refused(own, cp, context="cp"),
            "tp and ep axes": refused(build(sc, tempfile.mkdtemp(), 4, 1, {}),
                                      init_device_mesh("cpu", (1, 2), mesh_dim_names=("tp", "ep"))),
            "unknown axis": refused(build(sc, tempfile.mkdtemp(), 4, 1, {}),
                                    init_device_mesh("cpu", (2,), mesh_dim_names=("model",))),
            "parallelized already": (_refused(lambda: tplower.hf.prepare_trainer(twice, tp)), True)}


def _body(rank: int, world: int, scenarios: list[Scenario], folder: str, naive: bool,
          slow: bool) -> dict[str, Any]:
    tempfile.tempdir = folder  # every trainer's output folder in this rank goes where the fixture removes it
    wants = {sc.name: oracle(sc) for sc in scenarios}
    loop_want = loop(LOOP, prepare=False) if naive else None
    announce(rank, world)
    out: dict[str, Any] = {}
    for sc in scenarios:
        here = os.path.join(folder, sc.name)
        got, trainer = candidate(sc, here)
        out[sc.name] = differences(got, wants[sc.name])
        trainer.save_model(os.path.join(here, "final"))
        if rank == 0:
            out[sc.name]["reloaded"] = reloaded(os.path.join(here, "final"), wants[sc.name].params)
        if sc.checkpoint:  # a fresh trainer resumes from step 3 and ends where the uninterrupted run ended
            import tplower.hf

            again = build(sc, os.path.join(here, "resumed"), trainer.args.per_device_train_batch_size,
                          sc.accumulation, {})
            tplower.hf.prepare_trainer(again, mesh_of(sc), **dict(sc.options))
            again.train(resume_from_checkpoint=os.path.join(here, "checkpoint-3"))
            out[sc.name + "/resumed"] = max(float((whole(p) - got.params[n]).abs().max())
                                            for n, p in again.model.named_parameters())
    if naive:
        out[LOOP.name] = _loop(folder, loop_want)
        out["naive"] = _naive(rank, world, slow)
        out["refusals"] = _refusals(rank, world)
    return out


def _loop(folder: str, want: Any) -> dict[str, float]:
    """The accelerate loop at tp=2 against one process's (``want``), then resumed from its step-3 state."""
    state = os.path.join(folder, "loop-state")
    got = loop(LOOP, prepare=True, save=state)
    resumed = loop(LOOP, prepare=True, resume=state)
    out = differences(got, want)
    assert resumed.loss == got.loss[3:] and resumed.grad_norm == got.grad_norm[3:], (resumed.loss, got.loss)
    out["resumed"] = max(float((resumed.params[n] - p).abs().max()) for n, p in got.params.items())
    return out


@pytest.fixture(scope="module")
def folder() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tplower-hf-trainer-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def ranks(folder: str) -> list[dict[str, Any]]:
    """The default scenarios (and the slow 2-rank ones with ``TPLOWER_SLOW=1``) in one spawn of 2 ranks."""
    return run_processes(2, _body, DEFAULT + (SLOW_2 if SLOW else []), folder, True, SLOW, timeout=600)


@pytest.fixture(scope="module")
def ranks4(folder: str) -> list[dict[str, Any]]:
    return run_processes(4, _body, SLOW_4, folder, False, False, timeout=900)


def _check(results: list[dict[str, Any]], name: str) -> None:
    for rank, res in enumerate(results):
        for key, value in res[name].items():
            assert value <= TOL[key], f"{name} rank {rank}: {key} differs from one process's by {value:.3g}"
    assert "reloaded" in results[0][name]


@pytest.mark.parametrize("name", [sc.name for sc in DEFAULT])
def test_matches_one_process(ranks: list[dict[str, Any]], name: str) -> None:
    _check(ranks, name)


def test_resume_from_step_3_ends_where_the_uninterrupted_run_ended(ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(ranks):
        assert res["tp2/resumed"] <= 1e-6, f"rank {rank}: resumed parameters differ by {res['tp2/resumed']:.3g}"


def test_accelerate_loop_matches_one_process_and_resumes(ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(ranks):
        got = dict(res[LOOP.name])
        assert got.pop("resumed") <= 1e-6, f"rank {rank}: the resumed loop's parameters differ"
        for key, value in got.items():
            assert value <= TOL[key], f"{LOOP.name} rank {rank}: {key} differs from one process's by {value:.3g}"


@pytest.mark.parametrize("route", ["ddp_constructor", "ddp_forward", "trainer"]
                         + (["callback", "accelerator_prepare"] if SLOW else []))
def test_naive_routes_raise_one_line_naming_prepare_trainer(ranks: list[dict[str, Any]], route: str) -> None:
    for res in ranks:
        got = res["naive"][route]
        assert got.startswith(REFUSED), got
        assert "tplower.hf.prepare_trainer(trainer, mesh, plan)" in got


#: each refusal's words: what is wrong and the fix
REFUSALS = {"optimizer exists": "holds an optimizer or scheduler already",
            "label smoothing under cp": "label_smoothing_factor and compute_loss_func",
            "own compute_loss under cp": "PerSequence.compute_loss is not a loss tplower knows",
            "tp and ep axes": "have both 'tp' and 'ep'",
            "unknown axis": "must be named among ['dp', 'cp', 'tp', 'ep']",
            "parallelized already": "the model is parallelized already"}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusals_name_the_fix_and_change_nothing(ranks: list[dict[str, Any]], name: str) -> None:
    for res in ranks:
        line, untouched = res["refusals"][name]
        assert line.startswith("TPLowerError: prepare_trainer: ") and REFUSALS[name] in line, line
        assert untouched, f"{name}: the model was parallelized before the refusal"


@pytest.mark.slow
@pytest.mark.parametrize("name", [sc.name for sc in SLOW_2])
def test_trl_and_experts_match_one_process(ranks: list[dict[str, Any]], name: str) -> None:
    _check(ranks, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [sc.name for sc in SLOW_4])
def test_data_parallel_with_fsdp2_matches_one_process_and_resumes(ranks4: list[dict[str, Any]], name: str) -> None:
    _check(ranks4, name)
    for rank, res in enumerate(ranks4):
        assert res[name + "/resumed"] <= 1e-6, f"{name} rank {rank}: resumed parameters differ"
