"""Training stacks as people run them: tplower.hf.prepare_trainer against the stack's own parallelism, on CPU.

Feeds README.md ("When to choose it") and docs/training-stacks.md: Trainer and SFTTrainer at tp=2 and
cp=2 against one process, and accelerate's ParallelismConfig on CPU.

    python benchmarks/training_stacks.py        # 2 gloo ranks, about a minute on 2 cores

Each rank runs one process's plain trainer first (the oracle: transformers' ``Trainer`` or TRL's ``SFTTrainer``,
tiny Llama, 5 steps of 4 rows x 32 tokens, AdamW 1e-3, clipping at 1.0), then, as rank ``r`` of 2, the same run
three ways: with ``tplower.hf.prepare_trainer`` on a ``tp`` or ``cp`` mesh; with the stack's own
``accelerate.ParallelismConfig`` (transformers' tensor parallelism, PyTorch's context parallelism, DeepSpeed's
Ulysses); and with a model ``tplower.parallelize`` placed but no ``prepare_trainer`` call. The scenarios and the
comparison are those of ``tests/hf_cases.py`` (imported from there). Printed: a markdown table, the largest
differences from one process (losses and gradient norms relative, parameters absolute) or the first line of the
error each route ends with.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hf_cases import Scenario, announce, build, candidate, differences, oracle

from tplower.testing import run_processes

ROWS = [  # (what the user runs, tplower's scenario, the stack's own ParallelismConfig)
    ("Trainer, tp=2, the model's plan", Scenario("tp2", (("tp", 2),)), {"tp_size": 2}),
    ("Trainer, cp=2 (Ulysses), packed batch", Scenario("cp2", (("cp", 2),), (("context", "cp"),), data="packed"),
     {"cp_size": 2}),
    ("TRL SFTTrainer packing, cp=2", Scenario("sft", (("cp", 2),), (("context", "cp"),), trainer="sft"),
     {"sp_size": 2, "sp_backend": "deepspeed"}),
]


def _first_line(run: Any) -> str:
    try:
        run()
    except Exception as e:
        return f"`{type(e).__name__}: {str(e).splitlines()[0][:110]}...`"
    return "trains"


def _body(rank: int, world: int, folder: str) -> list[tuple[str, str, str]]:
    from accelerate import ParallelismConfig

    tempfile.tempdir = folder  # every trainer's output folder goes where main() removes it
    import tplower

    wants = {sc.name: oracle(sc) for _, sc, _ in ROWS}
    announce(rank, world)
    out = []
    for label, sc, own in ROWS:
        got, _ = candidate(sc, tempfile.mkdtemp())
        d = differences(got, wants[sc.name])
        ours = f"losses {d['loss']:.1e}, grad norms {d['grad_norm']:.1e}, parameters {d['params']:.1e}"

        def theirs(sc: Scenario = sc, own: dict[str, Any] = own) -> None:
            build(sc, tempfile.mkdtemp(), 4, 1, {}, parallelism_config=ParallelismConfig(**own)).train()

        pc = ", ".join(f"{k}={v!r}" for k, v in own.items())
        out.append((label, ours, f"`ParallelismConfig({pc})`: {_first_line(theirs)}"))
    sc = ROWS[0][1]
    naive = build(sc, tempfile.mkdtemp(), 4, 1, {})
    from torch.distributed.device_mesh import init_device_mesh

    tplower.parallelize(naive.model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), "auto")
    out.append(("`parallelize`, then `Trainer(model).train()` without `prepare_trainer`", _first_line(naive.train),
                "-"))
    return out


def main() -> None:
    folder = tempfile.mkdtemp(prefix="tplower-stacks-")
    try:
        rows = run_processes(2, _body, folder, timeout=900)[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print("| what the user runs (2 gloo ranks, CPU) | tplower.hf.prepare_trainer: largest difference from one "
          "process | the stack's own parallelism |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
