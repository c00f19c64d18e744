"""Training-stack scenarios against one process's plain ``Trainer``: the runs, the data and what is compared.

A :class:`Scenario` names a mesh, a model, a kind of batch and ``prepare_trainer``'s options. :func:`oracle`
runs one process's plain transformers ``Trainer`` (or TRL's ``SFTTrainer``) on the whole global batches of 4
rows (5 steps, AdamW 1e-3, gradient clipping at 1.0, evaluation on 8 rows); :func:`candidate` runs the same on
the scenario's mesh with :func:`tplower.hf.prepare_trainer`. Both return :class:`Run`: the logged losses and
gradient norms, every parameter's gradient after the first step (a constant factor would hide behind AdamW),
the final parameters, ``eval_loss``, the learning rates, the input tokens counted, the total batch size, TRL's
per-token metrics and, where asked, the predictions. The oracle runs in each rank before the process group is
announced to accelerate (:func:`announce`), so it is one process's run: no DDP, no sharding; with
``checkpoint`` it writes its step-3 checkpoint (``optimizer.pt``, ``scheduler.pt``) for a resume on a mesh.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
from context_cases import tiny
from torch import nn

#: the global batch: rows per optimizer step, as one process reads them
ROWS, SEQ, STEPS = 4, 32, 5


@dataclass(frozen=True)
class Scenario:
    """One comparison: ``mesh`` as ``((axis, size), ...)``; ``data`` ``padded`` (left padding, an
    ``attention_mask``, uneven label counts) or ``packed`` (documents restarting ``position_ids``, no mask), for
    TRL ``words`` (sentences over the whole vocabulary) or ``few`` (over 6 words: a model learns them within
    the run, so its per-token accuracy and entropy vary from token to token); ``trainer`` ``trainer``, ``own``
    (a ``Trainer`` subclass whose ``compute_loss`` only calls ``super()``), ``mean`` (a ``Trainer`` subclass whose
    ``compute_loss`` is a mean over the micro-batch's examples of each example's mean token loss), ``sft``
    (TRL, packing texts to 32 tokens unless ``trainer_args`` say ``packing=False``), ``dpo`` (TRL, pairs of
    texts, the reference model a second copy) or ``grpo`` (TRL, prompts of the first 40 words, each step 2
    prompts of 2 completions, rewarded by :func:`_low_words`, sampled by :func:`_sampled_by_row`); ``stream``:
    the training rows as a torch ``IterableDataset`` (:class:`Stream`); ``model`` a kind of
    :func:`context_cases.tiny` or ``llama_classifier`` (a sequence classifier of 3 labels: a mean over each
    micro-batch's rows); ``examples`` the training rows (one epoch when ``trainer_args`` say
    ``num_train_epochs``)."""

    name: str
    mesh: tuple[tuple[str, int], ...]
    options: tuple[tuple[str, Any], ...] = ()
    model: str = "llama"
    data: str = "padded"
    accumulation: int = 1
    trainer: str = "trainer"
    predict: bool = False
    checkpoint: bool = False
    trainer_args: tuple[tuple[str, Any], ...] = ()
    examples: int = 0
    stream: bool = False

    @property
    def rows(self) -> int:
        return self.examples or ROWS * STEPS

    @property
    def dp(self) -> int:
        return dict(self.mesh).get("dp", 1)


@dataclass
class Run:
    """What one training run gives, as plain data (it crosses processes)."""

    loss: list[float]
    grad_norm: list[float]
    eval_loss: float
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    predictions: torch.Tensor | None = None
    lr: list[float] = field(default_factory=list)
    tokens: float = 0.0
    total_batch: int = 0
    metrics: dict[str, list[float]] = field(default_factory=dict)


#: TRL's per-token metrics, as logged in training and evaluation
METRICS = ("mean_token_accuracy", "entropy", "eval_mean_token_accuracy", "eval_entropy")
#: every logged metric compared: TRL's per-token ones and GRPO's mean reward
COMPARED = (*METRICS, "reward")
#: GRPO's completions per prompt
GENERATIONS = 2


def rows(n: int, kind: str, seed: int, classes: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of ``SEQ`` tokens: ``padded`` (row i left-padded by ``(i * 5) % 11``, labels ``-100`` there and
    on a few more, so the rows' label counts differ) or ``packed`` (two documents a row, cut at ``7 + (i * 5) %
    17``); with ``classes``, each row's label is one class in ``[0, classes)`` (a sequence classifier's)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(1, 128, (SEQ,), generator=gen)
        labels = ids.clone()
        if kind == "packed":
            cut = 7 + (i * 5) % 17
            labels[cut] = -100  # a document's first token is predicted by no token of its own document
            positions = torch.cat([torch.arange(cut), torch.arange(SEQ - cut)])
            out.append({"input_ids": ids, "labels": labels, "position_ids": positions})
            continue
        pad = (i * 5) % 11
        mask = torch.ones(SEQ, dtype=torch.long)
        mask[:pad] = 0
        ids[:pad] = 0
        labels[:pad + i % 3] = -100
        if classes:
            labels = torch.tensor((i * 7 + seed) % classes)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Rows as an iterable dataset (no length: the trainer cannot cut it into batches of indices)."""

    def __init__(self, items: list[dict[str, torch.Tensor]]) -> None:
        self.items = items

    def __iter__(self) -> Any:
        return iter(self.items)


#: the sequence classifier's classes
CLASSES = 3


def model_of(kind: str) -> nn.Module:
    """A fresh tiny model (the same weights on every rank): :func:`context_cases.tiny`, ``llama_classifier``, or
    ``llama_lora`` (PEFT's LoRA of rank 4 on tiny Llama's query and value projections; the adapters' ``A`` drawn
    from the generator seeded for the model, the same on every rank)."""
    if kind == "llama_lora":
        from peft import LoraConfig, get_peft_model

        return get_peft_model(tiny("llama", "sdpa"), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                target_modules=["q_proj", "v_proj"]))
    if kind != "llama_classifier":
        return tiny(kind, "sdpa")
    from transformers import LlamaForSequenceClassification

    from tplower.run.hf_configs import tiny_config

    config = tiny_config("llama")
    config.num_hidden_layers, config.num_labels, config.pad_token_id = 2, CLASSES, 0
    torch.manual_seed(0)
    return LlamaForSequenceClassification(config).float()


def texts(n: int = 40, seed: int = 5, words: int = 125) -> list[str]:
    """Sentences of 4 to 19 words among the first ``words`` of ``w3 .. w127`` (the word-level vocabulary of
    :func:`tokenizer`)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(4, 20, (1,), generator=gen))
        out.append(" ".join(f"w{int(t)}" for t in torch.randint(3, 3 + words, (k,), generator=gen)))
    return out


def tokenizer() -> Any:
    """A word-level tokenizer of 128 ids (``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, ``w3`` .. ``w127``), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 128)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def announce(rank: int, world: int) -> None:
    """Tell accelerate (and so transformers' ``Trainer``) that this process is rank ``rank`` of ``world``, as
    ``torchrun`` would; its cached one-process state is dropped (a private reset: test set-up only)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)


def _args(sc: Scenario, out: str, batch: int, accumulation: int, **extra: Any) -> Any:
    common: dict[str, Any] = dict(
        output_dir=out, per_device_train_batch_size=batch, per_device_eval_batch_size=batch * accumulation,
        gradient_accumulation_steps=accumulation, max_steps=STEPS, learning_rate=1e-3, max_grad_norm=1.0,
        report_to=[], use_cpu=True, logging_steps=1, seed=0, disable_tqdm=True, save_strategy="no",
        include_num_input_tokens_seen="all")
    if sc.trainer == "sft":  # packed texts; bf16 autocast rounds differently per layout: not one answer
        common.update(packing=True, max_length=SEQ, bf16=False)
    common.update(dict(sc.trainer_args), **extra)
    if sc.trainer == "sft":
        from trl import SFTConfig

        return SFTConfig(**common)
    if sc.trainer == "dpo":
        from trl import DPOConfig

        return DPOConfig(**common, max_length=SEQ, bf16=False)
    if sc.trainer == "grpo":  # a learning rate that moves the rewards within the run; its batches are prompt lists
        from trl import GRPOConfig

        common.update(learning_rate=5e-3, include_num_input_tokens_seen="no", per_device_eval_batch_size=batch)
        return GRPOConfig(**common, num_generations=GENERATIONS, max_completion_length=8, bf16=False)
    from transformers import TrainingArguments

    return TrainingArguments(**common)


def whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _low_words(completions: list[str], **kwargs: Any) -> list[float]:
    """GRPO's reward: the share of a completion's words among ``w3 .. w42``."""
    low = {f"w{i}" for i in range(3, 43)}
    return [sum(w in low for w in c.split()) / max(len(c.split()), 1) for c in completions]


def _sampled_by_row(generate: Any) -> Any:
    """``generate`` sampling each row's next token by the Gumbel-max trick with noise seeded by the row's tokens
    (its padding aside) and its place in its group of ``GENERATIONS`` completions: the same draw for the same row
    whatever else is in the batch, so one process's batch and the ``dp`` ranks' parts of it sample the same
    completions (torch's generator would draw a batch's rows in sequence)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class ByRow(LogitsProcessor):  # type: ignore[misc]
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            noise = [torch.empty(scores.shape[-1]).exponential_(generator=torch.Generator().manual_seed(
                hash((tuple(row[row != 0].tolist()), i % GENERATIONS)) & 0x7FFFFFFF))  # padding (0) aside
                for i, row in enumerate(input_ids)]
            return scores - torch.stack(noise).log().to(scores)

    def run(*args: Any, **kwargs: Any) -> Any:
        import copy

        config = copy.deepcopy(kwargs.pop("generation_config"))
        config.do_sample, config.temperature, config.top_k, config.top_p = False, None, None, None
        return generate(*args, generation_config=config, logits_processor=LogitsProcessorList([ByRow()]), **kwargs)

    return run


def _first_grads(store: dict[str, torch.Tensor]) -> Any:
    from transformers import TrainerCallback

    class FirstGrads(TrainerCallback):  # type: ignore[misc]
        """Every parameter's gradient (clipped) before the first optimizer step."""

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                                  **kwargs: Any) -> None:
            if state.global_step == 0 and model is not None and not store:
                store.update({n: whole(p.grad) for n, p in model.named_parameters() if p.grad is not None})

    return FirstGrads()


def build(sc: Scenario, out: str, batch: int, accumulation: int, grads: dict[str, torch.Tensor],
          **extra: Any) -> Any:
    """The scenario's trainer over a fresh model (the same weights on every rank), not yet prepared."""
    model = model_of(sc.model)
    args = _args(sc, out, batch, accumulation, **extra)
    if sc.trainer == "sft":
        from datasets import Dataset
        from trl import SFTTrainer

        words = 6 if sc.data == "few" else 125
        return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts(words=words)}),
                          eval_dataset=Dataset.from_dict({"text": texts(8, seed=9, words=words)}),
                          processing_class=tokenizer(), callbacks=[_first_grads(grads)])
    if sc.trainer == "dpo":
        from datasets import Dataset
        from trl import DPOTrainer

        every = texts(3 * ROWS * STEPS, seed=7)
        pairs = {"prompt": every[0::3], "chosen": every[1::3], "rejected": every[2::3]}
        return DPOTrainer(model=model, ref_model=tiny(sc.model, "sdpa"), args=args,
                          train_dataset=Dataset.from_dict(pairs), processing_class=tokenizer(),
                          callbacks=[_first_grads(grads)])
    if sc.trainer == "grpo":
        from datasets import Dataset
        from trl import GRPOTrainer

        model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id = 0, 1, None
        model.generate = _sampled_by_row(model.generate)
        return GRPOTrainer(model=model, reward_funcs=_low_words, args=args,
                           train_dataset=Dataset.from_dict({"prompt": texts(4 * ROWS * STEPS, seed=11, words=40)}),
                           processing_class=tokenizer(), callbacks=[_first_grads(grads)])
    from transformers import Trainer

    class OwnLoss(Trainer):  # type: ignore[misc]
        """A user's own loss that is Trainer's (tplower cannot tell; ``token_loss=True`` vouches for it)."""

        def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
            return super().compute_loss(*args, **kwargs)

    class PerExampleMean(Trainer):  # type: ignore[misc]
        """A user's own loss: each example's mean token loss, averaged over the micro-batch's examples."""

        def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            labels = inputs.pop("labels")
            out = model(**inputs)
            target = labels[:, 1:]
            token = nn.functional.cross_entropy(out.logits[:, :-1].transpose(1, 2), target.clamp(min=0),
                                                reduction="none")
            mask = target.ne(-100)
            loss = ((token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
            return (loss, out) if return_outputs else loss

    kind = {"own": OwnLoss, "mean": PerExampleMean}.get(sc.trainer, Trainer)
    classes = CLASSES if sc.model == "llama_classifier" else 0
    train = rows(sc.rows, sc.data, 1, classes)
    return kind(model=model, args=args, train_dataset=Stream(train) if sc.stream else train,
                eval_dataset=rows(8, sc.data, 2, classes), callbacks=[_first_grads(grads)])


def finish(sc: Scenario, trainer: Any, grads: dict[str, torch.Tensor]) -> Run:
    """Train, evaluate (and predict): the :class:`Run` of ``trainer``."""
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"] if trainer.eval_dataset is not None else float("nan")
    logs = trainer.state.log_history
    run = Run([e["loss"] for e in logs if "loss" in e], [e["grad_norm"] for e in logs if "grad_norm" in e],
              eval_loss, grads, {n: whole(p) for n, p in trainer.model.named_parameters()},
              lr=[e["learning_rate"] for e in logs if "learning_rate" in e],
              tokens=float(trainer.state.num_input_tokens_seen),
              total_batch=int(trainer.get_total_train_batch_size(trainer.args)),
              metrics={k: [e[k] for e in logs if k in e] for k in COMPARED if any(k in e for e in logs)})
    if sc.predict:
        classes = CLASSES if sc.model == "llama_classifier" else 0
        run.predictions = torch.as_tensor(trainer.predict(rows(8, sc.data, 2, classes)).predictions)
    return run


def oracle(sc: Scenario, out: str | None = None) -> Run:
    """One process's plain trainer on the whole global batches (``ROWS`` a step, in the scenario's gradient
    accumulation steps: TRL averages its metrics over the micro-batches); before :func:`announce`. With
    ``sc.checkpoint`` it saves every 3 steps into ``out`` (``out/checkpoint-3``: one process's checkpoint)."""
    grads: dict[str, torch.Tensor] = {}
    extra = {"save_strategy": "steps", "save_steps": 3} if sc.checkpoint else {}
    trainer = build(sc, out or tempfile.mkdtemp(prefix="tplower-hf-"), ROWS // sc.accumulation, sc.accumulation,
                    grads, **extra)
    return finish(sc, trainer, grads)


def mesh_of(sc: Scenario) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(n for _, n in sc.mesh), mesh_dim_names=tuple(a for a, _ in sc.mesh))


def candidate(sc: Scenario, out: str) -> tuple[Run, Any]:
    """The scenario on its mesh with ``prepare_trainer`` (after :func:`announce`); the run and the trainer."""
    import tplower.hf

    grads: dict[str, torch.Tensor] = {}
    extra = {"save_strategy": "steps", "save_steps": 3} if sc.checkpoint else {}
    trainer = build(sc, out, ROWS // sc.dp // sc.accumulation, sc.accumulation, grads, **extra)
    tplower.hf.prepare_trainer(trainer, mesh_of(sc), **dict(sc.options))
    return finish(sc, trainer, grads), trainer


def differences(got: Run, want: Run) -> dict[str, float]:
    """Largest relative differences of the losses and gradient norms, the largest absolute ones of the gradients
    (over the largest gradient), the parameters, ``eval_loss`` and the predictions."""

    def rel(a: list[float], b: list[float]) -> float:
        assert len(a) == len(b) > 0, (a, b)
        return max(abs(x - y) / max(abs(y), 1e-3) for x, y in zip(a, b, strict=True))  # GRPO's loss starts at 0

    def most(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
        return max(float((a[k] - b[k]).abs().max()) for k in b)

    def near(a: list[float], b: list[float]) -> float:  # metrics between 0 and ~5: relative to 1 at least
        assert len(a) == len(b), (a, b)
        return max((abs(x - y) / max(abs(y), 1.0) for x, y in zip(a, b, strict=True)), default=0.0)

    scale = max(float(g.abs().max()) for g in want.grads.values())
    out = {"loss": rel(got.loss, want.loss), "grad_norm": rel(got.grad_norm, want.grad_norm),
           "grads": most(got.grads, want.grads) / scale, "params": most(got.params, want.params),
           "eval_loss": abs(got.eval_loss - want.eval_loss) if want.eval_loss == want.eval_loss else 0.0,
           "lr": rel(got.lr, want.lr) if any(want.lr) else 0.0, "tokens": abs(got.tokens - want.tokens),
           "total_batch": float(abs(got.total_batch - want.total_batch))}
    assert sorted(got.metrics) == sorted(want.metrics), (sorted(got.metrics), sorted(want.metrics))
    out.update({k: near(got.metrics[k], want.metrics[k]) for k in want.metrics})
    if want.predictions is not None:
        assert got.predictions is not None and got.predictions.shape == want.predictions.shape
        out["predictions"] = float((got.predictions - want.predictions).abs().max())
    return out


def reloaded(folder: str, want: dict[str, torch.Tensor], kind: str = "llama") -> float:
    """The largest difference of a ``save_model`` folder, loaded by ``from_pretrained`` in this process, from
    ``want`` (one process's final parameters); ``kind`` as :attr:`Scenario.model`."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if kind == "llama_lora":  # the adapters alone: on a fresh base model, as one process loads them
        from peft import PeftModel

        model = PeftModel.from_pretrained(tiny("llama", "sdpa"), folder)
    else:
        auto = AutoModelForSequenceClassification if kind == "llama_classifier" else AutoModelForCausalLM
        model = auto.from_pretrained(folder)
    got = dict(model.named_parameters())
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    return max(float((got[k].detach() - want[k]).abs().max()) for k in want)


def loop(sc: Scenario, *, prepare: bool, save: str | None = None, resume: str | None = None) -> Run:
    """A plain accelerate loop: ``STEPS`` AdamW steps (a linear schedule, clipping at 1.0) over the rows in order,
    the state saved after step 3 into ``save``, or the run resumed from ``resume`` (its last 2 steps);
    predictions of 8 rows gathered with ``gather_for_metrics``. ``prepare``: through ``prepare_accelerator`` on
    the scenario's mesh (after :func:`announce`); else one process's loop."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    import tplower.hf

    accelerator = Accelerator(cpu=True)
    model = tiny(sc.model, "sdpa")
    if prepare:
        tplower.hf.prepare_accelerator(accelerator, model, mesh_of(sc), **dict(sc.options))
    batch = ROWS // sc.dp if prepare else ROWS
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.2, total_iters=STEPS)
    loader = DataLoader(rows(ROWS * STEPS, sc.data, 1), batch_size=batch, collate_fn=default_data_collator)
    evals = DataLoader(rows(8, sc.data, 2), batch_size=batch, collate_fn=default_data_collator)
    model, opt, loader, evals, sched = accelerator.prepare(model, opt, loader, evals, sched)
    start = 0
    if resume is not None:
        accelerator.load_state(resume)
        loader, start = accelerator.skip_first_batches(loader, 3), 3
    run = Run([], [], float("nan"))
    for step, inputs in enumerate(loader, start):
        loss = model(**inputs).loss
        accelerator.backward(loss)
        run.grad_norm.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        if step == 0:
            run.grads = {n: whole(p.grad) for n, p in model.named_parameters()}
        opt.step()
        sched.step()
        opt.zero_grad()
        run.loss.append(float(accelerator.reduce(loss.detach(), "mean")))
        if step == 2 and save is not None:
            accelerator.save_state(save)
    model.eval()
    with torch.no_grad():
        run.predictions = torch.cat([accelerator.gather_for_metrics(model(**b).logits) for b in evals])
    run.params = {n: whole(p) for n, p in model.named_parameters()}
    return run


def resumed_alone(sc: Scenario, checkpoint: str, out: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """docs/training-stacks.md's way to resume a tplower checkpoint in one process (no process group): a copy of
    ``checkpoint`` in ``out`` gets an ``optimizer.pt`` (its ``optimizer_dcp/`` read by ``dcp_to_torch_save``, set
    into a plain trainer's own optimizer and saved from there), and that trainer resumes from it to the end of the
    run. Its final parameters and the learning rates it logged."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    copy, whole_file = os.path.join(out, "checkpoint-3"), os.path.join(out, "optimizer-whole.pt")
    shutil.copytree(checkpoint, copy)
    dcp_to_torch_save(os.path.join(copy, "optimizer_dcp"), whole_file)
    trainer = build(sc, os.path.join(out, "run"), ROWS // sc.accumulation, sc.accumulation, {})
    trainer.create_optimizer()
    set_optimizer_state_dict(trainer.model, trainer.optimizer, torch.load(whole_file, weights_only=True)["optimizer"])
    torch.save(trainer.optimizer.state_dict(), os.path.join(copy, "optimizer.pt"))
    trainer.train(resume_from_checkpoint=copy)
    return ({n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e])


def resumed(sc: Scenario, here: str, name: str, checkpoint: str, batch: int) -> Any:
    """A fresh trainer prepared on the scenario's mesh, resumed from ``checkpoint`` to the end of the run."""
    import tplower.hf

    again = build(sc, os.path.join(here, name), batch, sc.accumulation, {})
    tplower.hf.prepare_trainer(again, mesh_of(sc), **dict(sc.options))
    again.train(resume_from_checkpoint=checkpoint)
    return again
