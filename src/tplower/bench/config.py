"""What one ``tplower bench`` run measures: :class:`BenchConfig` and the phases it can run.

Its own module so that the phases (:mod:`tplower.bench.phases`) and the modules they call
(:mod:`tplower.bench.memory`, ...) both read it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from .catalog import CASES, SIZES, Case

__all__ = ["CONTEXT_BATCHES", "DEFAULT_PHASES", "PHASES", "BenchConfig"]

#: Phases ``tplower bench`` can run.
PHASES: tuple[str, ...] = ("micro", "fake", "memory", "model", "moe", "loss", "context", "plan")
#: Phases it runs when none are named (``context``, minutes at 8192 tokens, and ``plan``, which calibrates and
#: runs a dozen layouts, run when asked for)
DEFAULT_PHASES: tuple[str, ...] = tuple(p for p in PHASES if p not in ("context", "plan"))
#: Kinds of batch the ``context`` phase runs (here, so that the command line names them without importing torch)
CONTEXT_BATCHES: tuple[str, ...] = ("plain", "padded", "packed")


@dataclass(frozen=True)
class BenchConfig:
    """What one bench run measures.

    Attributes:
        worlds: world sizes of the micro phase (spawned gloo processes; under
            ``torchrun`` the launcher's world is used instead).
        sizes: global tensor sizes in bytes (float32).
        cases: transition names (``S(0)->R``, ``S(0),S(1)->R,R@2x2``).
        impls: implementations of the micro phase.
        modes: ``fwd`` and/or ``fwd_bwd``.
        reps: timed rounds at sizes up to 64 KiB (fewer above).
        warmup: untimed rounds first.
        fake_world: ranks the ``fake`` backend pretends to have.
        fake_calls: calls per fake-backend sample.
        fake_reps: fake-backend samples per implementation.
        memory_size: bytes of the tensor the memory phase uses.
        phases: subset of :data:`PHASES` (default :data:`DEFAULT_PHASES`).
        device: ``cpu`` or ``cuda``.
        model_steps: timed rounds of the model phase (and of the ``moe``, ``loss`` and ``context`` phases).
        compiled_steps: timed rounds of the model phase when it has compiled
            rows (``compile_backend``): those compare two graphs that differ
            by a few percent, which 7 rounds on a shared CPU cannot resolve
            (single runs of the MiniLM compiled forward spread 0.89-1.10).
        compile_backend: also time ``torch.compile`` of tplower's and
            ``parallelize_module``'s model with this backend (``None``: eager only);
            the ``moe`` phase's expert parallelism and the ``context`` phase's
            modes too.
        multi_axis_only_at: worlds whose micro phase runs only the
            multi-axis cases (the quick preset covers the 1-D ones at world 2).
        timeout: seconds for each spawned group of ranks.
        context_seqs: sequence lengths of the ``context`` phase (:class:`tplower.bench.context.ContextSweep`).
        context_cps: its cp sizes (a spawn of that many ranks each).
        context_budget: bytes per rank of its longest-sequence search (0: none).
        context_window: the sliding window of its window rows, in keys (0: none).
        context_batches: its kinds of batch (``plain``, ``padded``, ``packed``).
    """

    worlds: tuple[int, ...] = (2, 4)
    sizes: tuple[int, ...] = SIZES
    cases: tuple[str, ...] = tuple(c.name for c in CASES)
    impls: tuple[str, ...] = ("raw", "raw_packed", "tplower", "seed_op", "dtensor")
    modes: tuple[str, ...] = ("fwd", "fwd_bwd")
    reps: int = 30
    warmup: int = 3
    fake_world: int = 4
    fake_calls: int = 300
    fake_reps: int = 15
    memory_size: int = 4 << 20
    phases: tuple[str, ...] = DEFAULT_PHASES
    device: str = "cpu"
    model_steps: int = 10
    compiled_steps: int = 20
    compile_backend: str | None = None
    multi_axis_only_at: tuple[int, ...] = ()
    timeout: float = 900.0
    context_seqs: tuple[int, ...] = (8192,)
    context_cps: tuple[int, ...] = (2,)
    context_budget: int = 64 << 20
    context_window: int = 1024
    context_batches: tuple[str, ...] = CONTEXT_BATCHES

    @staticmethod
    def quick() -> BenchConfig:
        """The ``--quick`` preset: world 2 (and 4 for the 2x2 case), sizes up to 4 MiB, few rounds."""
        return BenchConfig(worlds=(2, 4), sizes=SIZES[:3], reps=13, warmup=2, fake_calls=150, fake_reps=7,
                           model_steps=7, multi_axis_only_at=(4,))

    def case_objs(self) -> list[Case]:
        """The selected :class:`Case` objects, in table order."""
        return [c for c in CASES if c.name in self.cases]
