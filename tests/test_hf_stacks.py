"""``tplower.hf``: transformers' and TRL's trainers and accelerate loops on gloo ranks against one process's own.

One spawn of 2 ranks runs the default scenarios (a process start and transformers' imports are the dearest things
here): ``prepare_trainer`` at tp=2 with the model's own plan (gradient accumulation 2 x 2 rows, checkpoints every
3 steps, then a resume from step 3 of its own checkpoint and one from one process's checkpoint), at cp=2 in both
modes (a packed and a padded batch, predictions made whole; the padded one through a ``Trainer`` subclass with
``token_loss=True``) and at dp=2 (FSDP2, unequal token counts per rank); an accelerate loop through
``prepare_accelerator`` at tp=2 (``save_state`` after step 3, a fresh loop's ``load_state`` ending where the
uninterrupted one ended) and its refusals (an optimizer built before the call, the call after
``accelerator.prepare``); the naive routes a user takes without the call (DDP's constructor and DDP's forward over
a parallelized model, the plain ``Trainer``) and ``prepare_trainer``'s refusals.
Each scenario is compared with :mod:`hf_cases`: 5 steps of 4 rows x 32 tokens, AdamW 1e-3, clipping at 1.0:
losses and gradient norms (1e-4 relative), every first-step gradient, the final parameters, ``eval_loss``, the
learning rates, ``num_input_tokens_seen``, the total batch size, the ``save_model`` folder loaded by
``from_pretrained`` in one process. With ``TPLOWER_SLOW=1``: TRL's ``SFTTrainer`` at cp=2 packed (Ulysses, with
gradient accumulation) and padded (all-gather) and packed at tp=2, each with its ``mean_token_accuracy`` and
``entropy`` in training and evaluation, TRL's ``DPOTrainer`` at tp=2, Qwen3-MoE with expert parallelism, the
naive routes through a ``TrainerCallback`` and ``Accelerator.prepare``, and on 4 ranks dp=2 x tp=2 and dp=2 x cp=2
(FSDP2 over dp), each resumed from its own and from one process's step-3 checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hf_cases import (
    METRICS,
    Scenario,
    announce,
    build,
    candidate,
    differences,
    loop,
    mesh_of,
    oracle,
    reloaded,
    resumed,
    resumed_alone,
    rows,
    whole,
)

from tplower.testing import run_processes

SLOW = os.environ.get("TPLOWER_SLOW") == "1"
TOL = {"loss": 1e-4, "grad_norm": 1e-4, "grads": 1e-4, "params": 5e-5, "eval_loss": 1e-4, "predictions": 1e-4,
       "reloaded": 5e-5, "lr": 1e-6, "tokens": 0.0, "total_batch": 0.0, **dict.fromkeys(METRICS, 1e-5)}
CP, ULYSSES, ALLGATHER = ("context", "cp"), ("context_mode", "ulysses"), ("context_mode", "allgather")
DEFAULT = [
    Scenario("tp2", (("tp", 2),), accumulation=2, checkpoint=True),
    Scenario("cp2-ulysses-packed", (("cp", 2),), (CP, ULYSSES), data="packed", predict=True),
    Scenario("cp2-allgather-padded-own-loss", (("cp", 2),), (CP, ALLGATHER, ("token_loss", True)), predict=True,
             trainer="own"),
    Scenario("dp2", (("dp", 2),), predict=True),  # FSDP2 alone; the rows' label counts differ between the ranks
]
FEW = ("learning_rate", 1e-2)  # with data="few": a model that learns within 5 steps, so its metrics vary
SLOW_2 = [
    Scenario("sft-cp2-ulysses", (("cp", 2),), (CP, ULYSSES), trainer="sft", data="few", accumulation=2,
             trainer_args=(FEW,)),
    Scenario("sft-cp2-allgather-padded", (("cp", 2),), (CP, ALLGATHER), trainer="sft", data="few",
             trainer_args=(FEW, ("packing", False))),
    Scenario("sft-tp2", (("tp", 2),), trainer="sft", data="few"),
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

    def fresh() -> Any:
        return build(sc, tempfile.mkdtemp(), 4, 1, {})

    with_optimizer = fresh()
    with_optimizer.create_optimizer()
    loss_func = build(sc, tempfile.mkdtemp(), 4, 1, {})
    loss_func.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs["loss"]
    own = build(sc, tempfile.mkdtemp(), 4, 1, {})
    own = PerSequence(model=own.model, args=own.args, train_dataset=own.train_dataset)
    twice = build(sc, tempfile.mkdtemp(), 4, 1, {})
    tplower.parallelize(twice.model, tp, "auto")
    return {"optimizer exists": refused(with_optimizer, tp),
            "compute_loss_func under cp": refused(loss_func, cp, context="cp"),
            "own compute_loss under cp": refused(own, cp, context="cp"),
            "tp and ep axes": refused(build(sc, tempfile.mkdtemp(), 4, 1, {}),
                                      init_device_mesh("cpu", (1, 2), mesh_dim_names=("tp", "ep"))),
            "unknown axis": refused(build(sc, tempfile.mkdtemp(), 4, 1, {}),
                                    init_device_mesh("cpu", (2,), mesh_dim_names=("model",))),
            "parallelized already": (_refused(lambda: tplower.hf.prepare_trainer(twice, tp)), True),
            "cp axis without context": refused(fresh(), cp),
            "context misspelled": refused(fresh(), cp, context="cpp"),
            "tp axis without a plan": refused(fresh(), tp, plan=None),
            "plan misspelled": refused(fresh(), tp, plan="atuo")}


def _loop_refusals() -> dict[str, str]:
    """prepare_accelerator's order: an optimizer built before it, and the call after accelerator.prepare."""
    from accelerate import Accelerator
    from context_cases import tiny
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    import tplower
    import tplower.hf

    mesh = mesh_of(LOOP)
    loader = DataLoader(rows(4, "padded", 1), batch_size=2, collate_fn=default_data_collator)
    accelerator, model = Accelerator(cpu=True), tiny("llama", "sdpa")
    early = torch.optim.AdamW(model.parameters(), lr=1e-3)  # on the parameters before the call
    tplower.hf.prepare_accelerator(accelerator, model, mesh, "auto")
    out = {"optimizer before the call": _refused(lambda: accelerator.prepare(model, early, loader))}
    accelerator, model = Accelerator(cpu=True), tiny("llama", "sdpa")
    wrapped, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))  # DDP on MULTI_CPU
    out["after prepare, the wrapper"] = _refused(lambda: tplower.hf.prepare_accelerator(accelerator, wrapped, mesh))
    out["after prepare, the model"] = _refused(lambda: tplower.hf.prepare_accelerator(accelerator, model, mesh))
    placed = tplower.parallelize(tiny("llama", "sdpa"), mesh, "auto")
    out["parallelized already"] = _refused(lambda: tplower.hf.prepare_accelerator(Accelerator(cpu=True), placed,
                                                                                 mesh))
    return out


def _body(rank: int, world: int, scenarios: list[Scenario], folder: str, naive: bool,
          slow: bool) -> dict[str, Any]:
    tempfile.tempdir = folder  # every trainer's output folder in this rank goes where the fixture removes it
    alone = {sc.name: os.path.join(folder, f"{sc.name}-one-process-rank{rank}") for sc in scenarios}
    wants = {sc.name: oracle(sc, alone[sc.name]) for sc in scenarios}
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
            batch = trainer.args.per_device_train_batch_size
            if rank == 0:  # one process's end, for the tplower checkpoint resumed in one process (in the test)
                torch.save({"params": wants[sc.name].params, "lr": wants[sc.name].lr},
                           os.path.join(folder, f"{sc.name}-one-process-end.pt"))
            again = resumed(sc, here, "resumed", os.path.join(here, "checkpoint-3"), batch)
            out[sc.name + "/resumed"] = max(float((whole(p) - got.params[n]).abs().max())
                                            for n, p in again.model.named_parameters())
            # one process's checkpoint-3 (optimizer.pt, scheduler.pt; rank 0's oracle writes it, as the main
            # process), resumed on the mesh: one process's end
            written = os.path.join(folder, f"{sc.name}-one-process-rank0", "checkpoint-3")
            again = resumed(sc, here, "resumed-one-process", written, batch)
            want = wants[sc.name]
            lr = [e["learning_rate"] for e in again.state.log_history if "learning_rate" in e]
            moved = {n: whole(p) for n, p in again.model.named_parameters()}
            out[sc.name + "/resumed-one-process"] = {
                "params": max(float((p - want.params[n]).abs().max()) for n, p in moved.items()),
                "lr": max(abs(a - b) / b for a, b in zip(lr[3:], want.lr[3:], strict=True))}
    if naive:
        out[LOOP.name] = _loop(folder, loop_want)
        out["naive"] = _naive(rank, world, slow)
        out["refusals"] = _refusals(rank, world)
        out["loop refusals"] = _loop_refusals()
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


def _check_one_process_resume(results: list[dict[str, Any]], name: str) -> None:
    for rank, res in enumerate(results):
        got = res[name + "/resumed-one-process"]
        assert got["lr"] <= 1e-6, f"{name} rank {rank}: steps 4-5 learning rates differ by {got['lr']:.3g} (rel)"
        assert got["params"] <= TOL["params"], f"{name} rank {rank}: parameters differ by {got['params']:.3g}"


def test_resume_from_a_one_process_checkpoint_ends_where_one_process_ended(ranks: list[dict[str, Any]]) -> None:
    """One process's checkpoint-3 (optimizer.pt, scheduler.pt) resumed at tp=2 continues its optimizer and schedule."""
    _check_one_process_resume(ranks, "tp2")


def test_a_tplower_checkpoint_resumes_in_one_process(ranks: list[dict[str, Any]], folder: str) -> None:
    """tp=2's checkpoint-3 (optimizer_dcp/), made optimizer.pt as the docs say, resumes a plain one-process
    Trainer; it ends where one process's uninterrupted run ended."""
    want = torch.load(os.path.join(folder, "tp2-one-process-end.pt"), weights_only=True)
    params, lr = resumed_alone(DEFAULT[0], os.path.join(folder, "tp2", "checkpoint-3"), tempfile.mkdtemp(dir=folder))
    assert max(abs(a - b) / b for a, b in zip(lr[3:], want["lr"][3:], strict=True)) <= TOL["lr"], (lr, want["lr"])
    assert max(float((p - want["params"][n]).abs().max()) for n, p in params.items()) <= TOL["params"]


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
REFUSALS = {"optimizer exists": "holds an optimizer or scheduler already, built on the parameters before "
                                 "parallelization (they would never change); pass no optimizers=(...) "
                                 "(optimizer_cls_and_kwargs is fine: train() builds it after the call), and build "
                                 "the trainer with the model as loaded, then call prepare_trainer(trainer, mesh, "
                                 "plan), then train()",
            "compute_loss_func under cp": "a compute_loss_func may shift them again or reduce over the whole "
                                          "sequence: drop it (label_smoothing_factor works), or pass context=None",
            "own compute_loss under cp": "PerSequence.compute_loss is not a loss tplower knows to be a sum over "
                                         "tokens (Trainer's, TRL's SFTTrainer's), and one built from per-sequence "
                                         "sums (DPO, KTO, GRPO) would be silently wrong on pieces: pass "
                                         "token_loss=True",
            "tp and ep axes": "have both 'tp' and 'ep'",
            "unknown axis": "must be named among ['dp', 'cp', 'tp', 'ep']",
            "parallelized already": "the model is parallelized already",
            "cp axis without context": "has a 'cp' axis but context=None, so nothing would be cut over it (each "
                                       "of its ranks would train on the whole batch); pass context='cp'",
            "context misspelled": "context='cpp' (did you mean 'cp'?)",
            "tp axis without a plan": "plan=None on a mesh with a 'tp' axis ('tp',): nothing would be sharded "
                                      "over it",
            "plan misspelled": "(did you mean 'auto'?)"}
#: where the message is not prepare_trainer's own: the plan's reader speaks for every caller
PREFIX = {"plan misspelled": "TPLowerError: plan file 'atuo' cannot be read: "}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusals_name_the_fix_and_change_nothing(ranks: list[dict[str, Any]], name: str) -> None:
    for res in ranks:
        line, untouched = res["refusals"][name]
        assert line.startswith(PREFIX.get(name, "TPLowerError: prepare_trainer: ")) and REFUSALS[name] in line, line
        assert untouched, f"{name}: the model was parallelized before the refusal"


#: prepare_accelerator's refusals of the wrong order: what is wrong, and the order that works
ORDER = ("call prepare_accelerator(accelerator, model, mesh, plan) on the model as loaded, then build the optimizer "
         "on model.parameters(), then accelerator.prepare(model, optimizer, ...)")
LOOP_REFUSALS = {
    "optimizer before the call": "TPLowerError: accelerator.prepare: the optimizer holds 21 parameters of the model "
                                 "as it was before prepare_accelerator replaced them",
    "after prepare, the wrapper": "TPLowerError: prepare_accelerator: the model is wrapped in "
                                  "DistributedDataParallel already",
    "after prepare, the model": "TPLowerError: prepare_accelerator: accelerator.prepare took this model already",
    "parallelized already": "TPLowerError: prepare_accelerator: the model is parallelized already; pass the model "
                            "as loaded"}


@pytest.mark.parametrize("name", sorted(LOOP_REFUSALS))
def test_accelerate_loop_in_the_wrong_order_is_refused_naming_the_order(ranks: list[dict[str, Any]],
                                                                        name: str) -> None:
    for res in ranks:
        line = res["loop refusals"][name]
        assert line.startswith(LOOP_REFUSALS[name]) and line.endswith(ORDER), line


@pytest.mark.slow
@pytest.mark.parametrize("name", [sc.name for sc in SLOW_2])
def test_trl_and_experts_match_one_process(ranks: list[dict[str, Any]], name: str) -> None:
    _check(ranks, name)
    if name.startswith("sft"):  # TRL's per-token metrics, in training and evaluation, are among those compared
        assert set(METRICS) <= set(ranks[0][name]), sorted(ranks[0][name])


@pytest.mark.slow
@pytest.mark.parametrize("name", [sc.name for sc in SLOW_4])
def test_data_parallel_with_fsdp2_matches_one_process_and_resumes(ranks4: list[dict[str, Any]], name: str) -> None:
    _check(ranks4, name)
    for rank, res in enumerate(ranks4):
        assert res[name + "/resumed"] <= 1e-6, f"{name} rank {rank}: resumed parameters differ"
    _check_one_process_resume(ranks4, name)
