"""What one ``tplower run`` does: :class:`RunConfig`, checked before any process starts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ..core.support.errors import TPLowerError
from ..plans import entries as plans
from .checks import RunError, check_backend, check_kill_rank, check_numbers, check_writable_folder, torchrun_env
from .models import check_plan_modules, check_tp, model_spec, read_sentences, sentences, skeleton

__all__ = ["DTENSOR_STYLES", "RunConfig", "RunError", "check_config", "load_plan", "texts_from", "torchrun_env"]

#: HF styles the DTensor comparison maps to ``ColwiseParallel``/``RowwiseParallel``.
DTENSOR_STYLES: tuple[str, ...] = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise")


@dataclass(frozen=True)
class RunConfig:
    """One run, fully resolved (see ``tplower run --help`` for each field).

    Attributes:
        model: a name in :data:`tplower.run.models.MODELS`.
        world: number of ranks; ``tp * dp``.
        tp, dp: ranks of the tensor-parallel and data-parallel mesh axes.
        texts: the sentences; consecutive pairs are the training pairs.
        plan: module name/glob -> HF style or boundary entry; ``None`` for the model's own.
        steps: training steps (SGD, ``lr``).
        batch_size: sentences per forward batch (split across ``dp``).
        repeat: timed repeats per measurement (the median is reported).
        tolerance: the largest allowed absolute difference from one process.
        timeout: seconds for the whole run and for each collective.
        backend: process-group backend when spawning (``gloo``).
        progress: show a progress bar on rank 0.
        kill_rank: debug: this rank exits abruptly after loading (``-1``: none).
        checkpoint: a folder: after training, save tplower's model there with
            DCP, reload it into the unparallelized model in one process and
            compare outputs (``None``: no checkpoint).
        compile: a ``torch.compile`` backend (``"inductor"``): also compile
            tplower's model and the reference and time them (``None``: eager only).
        codegen: a file path: rank 0 writes the model's generated forwards
            there (:func:`tplower.codegen.emit`) and every rank runs
            tplower's copy through them (:func:`tplower.codegen.install`)
            instead of the hooks (``None``: the hooks).
    """

    model: str = "all-minilm-l6-v2"
    world: int = 2
    tp: int = 2
    dp: int = 1
    texts: tuple[str, ...] = field(default_factory=lambda: tuple(sentences()))
    plan: Mapping[str, Any] | None = None
    steps: int = 2
    batch_size: int = 16
    lr: float = 0.1
    repeat: int = 5
    tolerance: float = 1e-5
    timeout: float = 300.0
    backend: str = "gloo"
    progress: bool = True
    kill_rank: int = -1
    checkpoint: str | None = None
    compile: str | None = None
    codegen: str | None = None

    def resolved_plan(self) -> dict[str, Any]:
        """The plan this run applies: ``plan``, or the model's own."""
        return dict(self.plan) if self.plan is not None else dict(model_spec(self.model).plan)

    @property
    def pairs(self) -> int:
        """Training pairs: consecutive sentences ``(0, 1), (2, 3), ...``."""
        return len(self.texts) // 2


def load_plan(path: str | Path) -> dict[str, Any]:
    """Read a plan file (JSON or YAML): module name/glob -> HF style or boundary entry (:mod:`tplower.plans.entries`).

    Raises:
        RunError: the file cannot be read or parsed, or an entry breaks the
            plan schema (the message names the key and field).
    """
    try:
        return plans.load_plan(Path(path))
    except ImportError:
        raise RunError(f"--plan {str(path)!r} is YAML, which needs PyYAML: pip install pyyaml") from None
    except ValueError as exc:  # TPLowerError, and JSON/YAML syntax errors
        raise RunError(f"--plan {str(path)!r}: {exc}") from None


def check_config(cfg: RunConfig) -> None:
    """Everything that can be checked before processes start.

    Raises:
        RunError: an unknown model, a missing package, sizes that do not
            fit (``tp * dp != world``, ``tp`` not dividing heads), a plan key
            naming no module, too few sentences, a bad number (``--steps``
            below 1, a ``--lr`` or ``--timeout`` not above 0, a negative or
            non-finite ``--tolerance``), a ``kill_rank`` the run does not have,
            or ``nccl`` without a GPU per rank (when spawning), a ``checkpoint``
            folder that cannot be written.
    """
    try:
        model_spec(cfg.model)
    except TPLowerError as exc:
        raise RunError(str(exc)) from None
    check_numbers(steps=cfg.steps, batch_size=cfg.batch_size, repeat=cfg.repeat, tp=cfg.tp, dp=cfg.dp, lr=cfg.lr,
                  tolerance=cfg.tolerance, timeout=cfg.timeout)
    check_kill_rank(cfg.kill_rank, cfg.world)
    if cfg.checkpoint:
        check_writable_folder("--checkpoint", cfg.checkpoint)
    if torchrun_env() is None:  # under torchrun the launcher's environment picks the backend
        check_backend(cfg.backend, cfg.world)
    if cfg.compile is not None:
        import torch._dynamo

        backends = torch._dynamo.list_backends(exclude_tags=())
        if cfg.compile not in backends:  # torch's own test backends work, but are no choice to offer
            shown = [b for b in backends if not b.endswith("_TESTING_ONLY")]
            raise RunError(f"--compile {cfg.compile!r} is not a torch.compile backend; allowed: {', '.join(shown)}")
    if cfg.tp * cfg.dp != cfg.world:
        raise RunError(f"--tp {cfg.tp} x --dp {cfg.dp} = {cfg.tp * cfg.dp} ranks, but the run has {cfg.world} "
                       f"(--nproc or torchrun's WORLD_SIZE); make tp x dp equal the number of processes")
    if cfg.pairs < cfg.dp:
        raise RunError(f"{len(cfg.texts)} sentences give {cfg.pairs} training pairs, fewer than --dp {cfg.dp}; "
                       "give more sentences (--input) or a smaller --dp")
    plan = cfg.resolved_plan()
    try:
        check_tp(cfg.model, cfg.tp)
        model = skeleton(cfg.model)
        check_plan_modules(model, plan)
        _check_entries(model, plan)
    except TPLowerError as exc:
        raise RunError(str(exc)) from None


def _check_entries(model: nn.Module, plan: Mapping[str, Any]) -> None:
    """Each entry resolves for the kind of module it governs, and has a DTensor counterpart to compare with."""
    modules = dict(model.named_modules())
    for qual, key in plans.match_plan(plan, modules).items():
        m = modules[qual]
        kind = "linear" if isinstance(m, nn.Linear) else "embedding" if isinstance(m, nn.Embedding) else "other"
        plans.resolve_entry(plan[key], key, kind=kind)
    for key, value in plan.items():
        if not (value in DTENSOR_STYLES or (isinstance(value, Mapping) and set(value) == {"local_attrs"})):
            raise RunError(f"plan entry {key!r}: {value!r} has no DTensor counterpart for the comparison; tplower "
                           f"run compares plans of {', '.join(DTENSOR_STYLES)} entries (and local_attrs-only ones)")


def texts_from(path: str | None) -> tuple[str, ...]:
    """The sentences of ``--input`` (one a line), or the built-in ones."""
    try:
        return tuple(read_sentences(path)) if path else tuple(sentences())
    except TPLowerError as exc:
        raise RunError(str(exc)) from None
