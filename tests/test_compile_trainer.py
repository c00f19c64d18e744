"""``prepare_trainer`` with ``TrainingArguments(torch_compile=True)`` at cp=2: no graph break, no recompile.

transformers' ``Trainer`` compiles the model itself (accelerate's ``torch.compile`` of the whole model); under
``context="cp"`` each batch is cut by :func:`tplower.shard_sequence` before the compiled model sees it. Two gloo
ranks train tiny Llama 5 steps of 4 rows on padded rows (left padding, a different amount per row) and on packed
rows (two documents a row, ``position_ids`` restarting, no mask), each at a fixed length and with the length
changing from batch to batch (rows of 20 to 32 tokens, a collator padding each batch to its longest row: the
padded rows' mask and labels, the packed rows' positions going on as one more document). Counted on every rank
with the ``aot_eager`` backend: the graphs compiled after the first step (at most 1; none with these batches),
dynamo's graph-break counter (0) and the recompiles dynamo logs (``TORCH_LOGS=recompiles``'s messages, at most
1); the logged losses and gradient norms are one process's plain (eager) ``Trainer``'s on the same batches
(1e-5 relative). ``TPLOWER_SLOW=1``: compiling takes about 10 s a case on 2 cores (about 90 s in all).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hf_cases import announce, model_of

from tplower.testing import run_processes

slow = pytest.mark.skipif(not os.environ.get("TPLOWER_SLOW"), reason="slow: runs with TPLOWER_SLOW=1")
pytest.importorskip("transformers")

ROWS, STEPS, SEQ = 4, 5, 32
#: ``(data, length, context_mode)``: padded or packed rows, of ``SEQ`` tokens (``fixed``) or 20 to 32 (``varying``)
CASES = [("padded", "fixed", "ulysses"), ("packed", "fixed", "allgather"), ("padded", "varying", "ulysses"),
         ("packed", "varying", "allgather")]


def _rows(data: str, length: str) -> list[dict[str, torch.Tensor]]:
    """``ROWS * STEPS`` rows: row ``i`` has ``SEQ`` tokens, or ``20 + (7 * i) % 13``; ``padded``: left-padded by
    ``i % 5`` (labels ``-100`` there), ``packed``: two documents cut at a third of the row."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(ROWS * STEPS):
        n = SEQ if length == "fixed" else 20 + (7 * i) % 13
        ids = torch.randint(1, 128, (n,), generator=gen)
        labels = ids.clone()
        if data == "packed":
            cut = n // 3
            labels[cut] = -100  # a document's first token: no token of its own document predicts it
            out.append({"input_ids": ids, "labels": labels,
                        "position_ids": torch.cat([torch.arange(cut), torch.arange(n - cut)])})
            continue
        pad = i % 5
        ids[:pad], labels[:pad] = 0, -100
        mask = torch.ones(n, dtype=torch.long)
        mask[:pad] = 0
        out.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return out


def _collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The rows stacked, each padded at its end to the batch's longest row: ids 0, labels ``-100``, the mask 0,
    positions counting on as one more document."""
    longest = max(len(r["input_ids"]) for r in rows)
    fill = {"input_ids": 0, "labels": -100, "attention_mask": 0}
    out = {}
    for key in rows[0]:
        parts = []
        for r in rows:
            extra = longest - len(r[key])
            tail = torch.arange(extra) if key == "position_ids" else torch.full((extra,), fill[key])
            parts.append(torch.cat([r[key], tail.to(r[key].dtype)]))
        out[key] = torch.stack(parts)
    return out


def _trainer(data: str, length: str, folder: str, backend: str | None) -> Any:
    """The tiny Llama ``Trainer`` of a case (compiled with ``backend``; ``None``: eager), not yet prepared."""
    from transformers import Trainer, TrainingArguments

    compiled = {"torch_compile": True, "torch_compile_backend": backend} if backend else {}
    args = TrainingArguments(output_dir=folder, per_device_train_batch_size=ROWS, max_steps=STEPS, learning_rate=1e-3,
                             max_grad_norm=1.0, report_to=[], use_cpu=True, logging_steps=1, seed=0,
                             disable_tqdm=True, save_strategy="no", **compiled)
    return Trainer(model=model_of("llama"), args=args, train_dataset=_rows(data, length), data_collator=_collate)


def _logged(trainer: Any) -> tuple[list[float], list[float]]:
    logs = trainer.state.log_history
    return [e["loss"] for e in logs if "loss" in e], [e["grad_norm"] for e in logs if "grad_norm" in e]


class _Recompiles(logging.Handler):
    """The first line of every recompile dynamo logs (its ``recompiles`` artifact, as ``TORCH_LOGS`` shows it)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Recompiling"):
            self.lines.append(message.splitlines()[0])


def _graphs() -> Any:
    from transformers import TrainerCallback

    class Graphs(TrainerCallback):  # type: ignore[misc]
        """The unique graphs dynamo compiled in this process, read at the end of each step."""

        def __init__(self) -> None:
            self.seen: list[int] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            import torch._dynamo as dynamo

            self.seen.append(int(dynamo.utils.counters["stats"]["unique_graphs"]))

    return Graphs()


def _ranks(rank: int, world: int, folder: str, backend: str) -> dict[tuple[str, str], Any]:
    """Per case: one process's losses and gradient norms (trained here before the process group is announced),
    then the prepared compiled trainer's, the unique graphs compiled by the end of each step, the graph breaks and
    the recompiles."""
    import torch._dynamo as dynamo
    from torch.distributed.device_mesh import init_device_mesh

    import tplower.hf

    tempfile.tempdir = folder
    wants = {}
    for data, length, _ in CASES:
        alone = _trainer(data, length, tempfile.mkdtemp(), None)
        alone.train()
        wants[data, length] = _logged(alone)
    announce(rank, world)
    torch._logging.set_logs(recompiles=True)
    recompiles = _Recompiles()
    log = logging.getLogger("torch._dynamo.guards.__recompiles")
    log.addHandler(recompiles)
    log.propagate = False  # counted here, not printed
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    out: dict[tuple[str, str], Any] = {}
    for data, length, mode in CASES:
        dynamo.reset()
        dynamo.utils.counters.clear()
        recompiles.lines.clear()
        graphs = _graphs()
        trainer = _trainer(data, length, tempfile.mkdtemp(), backend)
        trainer.add_callback(graphs)
        tplower.hf.prepare_trainer(trainer, mesh, context="cp", context_mode=mode)
        trainer.train()
        out[data, length] = {"graphs": graphs.seen, "breaks": sum(dynamo.utils.counters["graph_break"].values()),
                             "recompiles": list(recompiles.lines), "got": _logged(trainer),
                             "want": wants[data, length]}
    return out


@pytest.fixture(scope="module")
def ranks() -> Iterator[list[dict[tuple[str, str], Any]]]:
    folder = tempfile.mkdtemp(prefix="tplower-compile-trainer-")
    try:
        yield run_processes(2, _ranks, folder, "aot_eager", timeout=900)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_compiled_trainer_traces_once_with_one_process_losses(ranks: list[dict[tuple[str, str], Any]],
                                                              case: tuple[str, str, str]) -> None:
    for rank, res in enumerate(ranks):
        got = res[case[0], case[1]]
        steps = got["graphs"]
        assert len(steps) == STEPS and steps[0] > 0, got
        assert steps[-1] - steps[0] <= 1, f"rank {rank}: graphs compiled after the first step: {steps}"
        assert got["breaks"] == 0, f"rank {rank}: {got['breaks']} graph breaks"
        assert len(got["recompiles"]) <= 1, f"rank {rank}: {got['recompiles']}"
        (loss, norm), (want_loss, want_norm) = got["got"], got["want"]
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
        torch.testing.assert_close(norm, want_norm, rtol=1e-5, atol=0)


def test_a_compiled_cp_trainer_asks_inductor_for_bucketed_sums() -> None:
    """``prepare_trainer``'s setting for ``torch_compile`` on a cp mesh (run by it before the trainer compiles):
    inductor's all-reduce bucketing, only under inductor (transformers' default backend) and only where unset."""
    import torch._inductor.config as inductor

    from tplower.hf.model import bucket_compiled_sums

    with inductor.patch(bucket_all_reduces_fx="none"):
        assert not bucket_compiled_sums("aot_eager") and inductor.bucket_all_reduces_fx == "none"
        assert bucket_compiled_sums(None) and inductor.bucket_all_reduces_fx == "all"
    with inductor.patch(bucket_all_reduces_fx="all"):
        assert not bucket_compiled_sums("inductor")  # set already (a user's own choice stays)
    assert inductor.bucket_all_reduces_fx == "none"
