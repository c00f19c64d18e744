"""Recipes people run through ``tplower.hf.prepare_trainer`` beside the documented path, each against the same
script's plain trainer in one process with ``dp`` times the per-device batch (:mod:`hf_cases`).

By default (one spawn of 2 ranks): label smoothing over ``dp`` (FSDP2 renames the model's class, which made
transformers smooth unshifted labels) and under ``cp`` (each rank's labels are shifted already); a sequence
classifier (its loss a mean over each micro-batch's rows) and a user's ``compute_loss`` returning a mean over the
micro-batch's examples, both with gradient accumulation over ``dp`` (each rank's mean is its part of one
process's micro-batch mean, not a mean summed over ``dp``); one epoch over 10 rows at ``dp=2``, batch 2 (the last
step's 2 rows cut over the ranks, none repeated). With ``TPLOWER_SLOW=1``, on 4 ranks: label smoothing at
``dp=2 x tp=2`` with gradient accumulation, and an epoch of 9 rows at ``dp=4`` (the last round leaves three
ranks a stand-in that counts for nothing).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from hf_cases import (
    COMPARED,
    Scenario,
    announce,
    build,
    candidate,
    differences,
    mesh_of,
    oracle,
    reloaded,
    resumed,
    whole,
)

from tplower.testing import run_processes

SLOW = os.environ.get("TPLOWER_SLOW") == "1"
TOL = {"loss": 1e-4, "grad_norm": 1e-4, "grads": 1e-4, "params": 1e-4, "eval_loss": 1e-4, "predictions": 1e-4,
       "reloaded": 1e-4, "lr": 1e-6, "tokens": 0.0, "total_batch": 0.0, "resumed": 1e-6,
       **dict.fromkeys(COMPARED, 1e-5)}
SMOOTH = ("label_smoothing_factor", 0.1)
EPOCH = (("num_train_epochs", 1), ("max_steps", -1))
SYNC = (("sync_ref_model", True), ("ref_model_sync_steps", 2), ("ref_model_mixup_alpha", 0.5))
DEFAULT = [
    Scenario("smoothing-dp2", (("dp", 2),), accumulation=2, trainer_args=(SMOOTH,)),
    Scenario("smoothing-cp2", (("cp", 2),), (("context", "cp"),), trainer_args=(SMOOTH,)),
    Scenario("classifier-dp2", (("dp", 2),), model="llama_classifier", accumulation=2, predict=True),
    Scenario("example-mean-dp2", (("dp", 2),), trainer="mean", accumulation=2),
    Scenario("epoch-of-10-dp2", (("dp", 2),), trainer_args=EPOCH, examples=10),
    Scenario("rebalance-tp2", (("tp", 2),), trainer_args=(("train_sampling_strategy", "batch_rebalance"),)),
    # one process groups 24 rows by length in mega-batches sized by its batch of 4, not each rank's 2
    Scenario("group-by-length-dp2", (("dp", 2),), trainer_args=(("train_sampling_strategy", "group_by_length"),),
             examples=24),
    Scenario("stream-of-10-dp2", (("dp", 2),), trainer_args=(("max_steps", 3),), examples=10, stream=True),
    Scenario("resume-dp2", (("dp", 2),), checkpoint=True),  # FSDP2 alone: whole tensors load into its shards
    Scenario("lora-tp2", (("tp", 2),), model="llama_lora", checkpoint=True),
    Scenario("own-loss-dp2", (("dp", 2),), trainer="own", accumulation=2),  # super().compute_loss's, returned
    Scenario("grpo-tp2", (("tp", 2),), trainer="grpo"),
    Scenario("grpo-dp2", (("dp", 2),), trainer="grpo"),
    Scenario("dpo-sync-tp2", (("tp", 2),), trainer="dpo", trainer_args=SYNC),
    # FSDP2 over the reference too; DPO pads each batch to its longest row, so tokens counted with the padding differ
    Scenario("dpo-sync-dp2", (("dp", 2),), trainer="dpo",
             trainer_args=(*SYNC, ("include_num_input_tokens_seen", "no"))),
]
SLOW_4 = [
    Scenario("smoothing-dp2-tp2", (("dp", 2), ("tp", 2)), accumulation=2, trainer_args=(SMOOTH,)),
    # 9 rows, 4 a step: the last step's one row goes to dp rank 0; ranks 1-3 read a stand-in
    Scenario("epoch-of-9-dp4", (("dp", 4),), trainer_args=EPOCH, examples=9),
    Scenario("lora-dp2-tp2", (("dp", 2), ("tp", 2)), model="llama_lora", checkpoint=True),
    Scenario("grpo-dp2-tp2", (("dp", 2), ("tp", 2)), trainer="grpo"),
]


def _body(rank: int, world: int, scenarios: list[Scenario], folder: str, refusals: bool) -> dict[str, Any]:
    tempfile.tempdir = folder  # every trainer's output folder in this rank goes where the fixture removes it
    wants = {sc.name: oracle(sc) for sc in scenarios}  # one process's runs, before the ranks are announced
    announce(rank, world)
    out: dict[str, Any] = {}
    for sc in scenarios:
        here = os.path.join(folder, sc.name)
        got, trainer = candidate(sc, here)
        out[sc.name] = differences(got, wants[sc.name])
        out[sc.name]["steps"] = (len(got.loss), len(wants[sc.name].loss))
        trainer.save_model(os.path.join(here, "final"))
        if trainer.eval_dataset is not None:  # collectives after the save: every rank still in step
            out[sc.name]["eval_loss"] = max(out[sc.name]["eval_loss"],
                                            abs(trainer.evaluate()["eval_loss"] - wants[sc.name].eval_loss))
        if rank == 0:
            out[sc.name]["reloaded"] = reloaded(os.path.join(here, "final"), wants[sc.name].params, sc.model)
        if sc.checkpoint:  # written every 3 steps while training: resumed, the run ends where it ended
            again = resumed(sc, here, "resumed", os.path.join(here, "checkpoint-3"),
                            trainer.args.per_device_train_batch_size)
            out[sc.name]["resumed"] = max(float((whole(p) - got.params[n]).abs().max())
                                          for n, p in again.model.named_parameters())
    if refusals:
        out["mixing callback"] = _mixing_callback(folder)
        out["refusals"] = _refusals(folder)
    return out


def _refusals(folder: str) -> dict[str, str]:
    """TRL's trainers where a mesh would train them otherwise than one process: each refusal's line."""
    import tplower.hf

    def refused(sc: Scenario, **options: Any) -> str:
        trainer = build(sc, os.path.join(folder, sc.name), 4, 1, {})
        try:
            tplower.hf.prepare_trainer(trainer, mesh_of(sc), **options)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    return {"batch std at tp=2": refused(Scenario("grpo-batch-std", (("tp", 2),), trainer="grpo",
                                                  trainer_args=(("scale_rewards", "batch"),))),
            "under cp": refused(Scenario("grpo-cp", (("cp", 2),), trainer="grpo"), context="cp"),
            "KTO's KL term at dp=2": _kto_at_dp2(folder)}


def _kto_at_dp2(folder: str) -> str:
    """TRL's KTOTrainer (its KL pairs made within each per-device batch) at dp=2: its error line."""
    from datasets import Dataset
    from hf_cases import model_of, texts, tokenizer
    from trl import KTOConfig, KTOTrainer

    import tplower.hf

    t = texts(16, seed=3)
    data = Dataset.from_dict({"prompt": t[0::2], "completion": t[1::2], "label": [i % 2 == 0 for i in range(8)]})
    args = KTOConfig(output_dir=os.path.join(folder, "kto"), per_device_train_batch_size=2, max_steps=1,
                     use_cpu=True, report_to=[], bf16=False, max_length=32, disable_tqdm=True)
    trainer = KTOTrainer(model=model_of("llama"), ref_model=model_of("llama"), args=args, train_dataset=data,
                         processing_class=tokenizer())
    try:
        tplower.hf.prepare_trainer(trainer, mesh_of(Scenario("kto", (("dp", 2),))))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _mixing_callback(folder: str) -> str:
    """A user's EMA callback over a copy made before ``prepare_trainer`` (whole tensors): its error line."""
    import copy

    from transformers import TrainerCallback

    import tplower.hf

    sc = Scenario("ema-tp2", (("tp", 2),))
    trainer = build(sc, os.path.join(folder, "ema"), 4, 1, {})
    ema = copy.deepcopy(trainer.model)

    class Ema(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            for mine, theirs in zip(ema.parameters(), model.parameters(), strict=True):
                mine.data.mul_(0.9).add_(theirs.data, alpha=0.1)

    trainer.add_callback(Ema())
    tplower.hf.prepare_trainer(trainer, mesh_of(sc))
    try:
        trainer.train()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.fixture(scope="module")
def folder() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tplower-hf-recipes-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def ranks(folder: str) -> list[dict[str, Any]]:
    return run_processes(2, _body, DEFAULT, folder, True, timeout=600)


@pytest.fixture(scope="module")
def ranks4(folder: str) -> list[dict[str, Any]]:
    return run_processes(4, _body, SLOW_4, folder, False, timeout=900)


def _check(results: list[dict[str, Any]], name: str) -> None:
    for rank, res in enumerate(results):
        got = dict(res[name])
        steps, want_steps = got.pop("steps")
        assert steps == want_steps, f"{name} rank {rank}: {steps} optimizer steps, one process {want_steps}"
        for key, value in got.items():
            assert value <= TOL[key], f"{name} rank {rank}: {key} differs from one process's by {value:.3g}"
    assert "reloaded" in results[0][name]


@pytest.mark.parametrize("name", [sc.name for sc in DEFAULT])
def test_recipe_matches_one_process(ranks: list[dict[str, Any]], name: str) -> None:
    _check(ranks, name)


def test_the_short_epoch_takes_one_process_s_three_steps(ranks: list[dict[str, Any]]) -> None:
    """10 rows at 4 a step: 4, 4 and 2 rows, as one process reads them."""
    assert ranks[0]["epoch-of-10-dp2"]["steps"] == (3, 3)


def test_a_callback_mixing_a_whole_copy_is_refused_in_one_line_naming_it(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        line = res["mixing callback"]
        assert line.startswith("TPLowerError: prepare_trainer: the callback Ema mixed a whole tensor with the "
                               "trained model's DTensor parameters in on_step_end"), line
        assert "p.detach().clone() for n, p in trainer.model.named_parameters()" in line and "\n" not in line, line


#: the refusals: what would differ from one process, and the fix
REFUSALS = {"batch std at tp=2": "TPLowerError: prepare_trainer: scale_rewards='batch' and "
                                      "multi_objective_aggregation='normalize_then_sum' take a standard deviation over "
                                      "the rewards TRL gathers from every process",
                 "under cp": "TPLowerError: prepare_trainer: context parallelism gives each rank a piece of every "
                             "sequence; GRPOTrainer.compute_loss is not a loss tplower knows to be a sum over tokens",
                 "KTO's KL term at dp=2": "TPLowerError: prepare_trainer: KTOTrainer pairs each completion with "
                                          "another of its per-device batch for its KL term"}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_where_a_mesh_would_differ_it_is_refused(ranks: list[dict[str, Any]], name: str) -> None:
    for res in ranks:
        assert res["refusals"][name].startswith(REFUSALS[name]), res["refusals"][name]


@pytest.mark.slow
@pytest.mark.parametrize("name", [sc.name for sc in SLOW_4])
def test_recipe_on_4_ranks_matches_one_process(ranks4: list[dict[str, Any]], name: str) -> None:
    _check(ranks4, name)
