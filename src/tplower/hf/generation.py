"""Trainers that generate their own batches (TRL's ``GRPOTrainer``): the generation batch counted over ``dp``.

TRL sizes a generation batch by the processes it sees (``GRPOConfig``: ``generation_batch_size =
per_device_train_batch_size * world_size * steps_per_generation``), gathers every process's rewards with
``accelerate.utils.gather`` (over every rank, not the accelerator's ``gather``) to normalize them per prompt
group, and slices its own rows back by ``process_index``. On a mesh the ranks of one tp/cp/ep group hold the same
rows, so :func:`fit_generation` counts the generation batch over ``dp`` alone; the world-wide gather then holds
each group's rows once per rank of it, next to each other, which per-group statistics do not notice as long as no
prompt group spans ``dp`` ranks. What would notice (a group spanning ``dp`` ranks next to tp copies, a standard
deviation over the whole batch) is refused by :func:`check_generation`.
"""

from __future__ import annotations

from typing import Any

from ..core.support.errors import TPLowerError
from .layout import DataLayout

__all__ = ["check_generation", "fit_generation", "generates"]


def generates(args: Any) -> bool:
    """Whether ``args`` are a generating trainer's (they size a generation batch in prompt groups)."""
    return all(hasattr(args, k) for k in ("generation_batch_size", "steps_per_generation", "num_generations"))


def check_generation(args: Any, layout: DataLayout) -> None:
    """Refuse a generating trainer's arguments that a mesh would train differently from one process.

    Raises:
        TPLowerError: with ranks that share data (tp, cp or ep): ``scale_rewards="batch"`` or
            ``multi_objective_aggregation="normalize_then_sum"`` (a standard deviation over every gathered row,
            each counted once per rank of its group); with ``dp`` as well, prompt groups that span ``dp`` ranks
            (``per_device_train_batch_size * steps_per_generation`` not a multiple of ``num_generations``); a
            generation batch over ``dp`` that holds no whole number of groups.
    """
    if not generates(args) or layout.dp_size == layout.mesh.size():
        return
    if getattr(args, "scale_rewards", None) == "batch" \
            or getattr(args, "multi_objective_aggregation", None) == "normalize_then_sum":
        raise TPLowerError("prepare_trainer: scale_rewards='batch' and multi_objective_aggregation="
                           "'normalize_then_sum' take a standard deviation over the rewards TRL gathers from every "
                           f"process, where each of the mesh's {layout.shared} groups counts each row once per rank; "
                           "use scale_rewards='group' (the default)")
    rows = args.per_device_train_batch_size * args.steps_per_generation
    if rows * layout.dp_size % args.num_generations:
        raise TPLowerError(f"prepare_trainer: a generation batch over dp holds {rows * layout.dp_size} rows "
                           f"(per_device_train_batch_size {args.per_device_train_batch_size} x dp {layout.dp_size} x "
                           f"steps_per_generation {args.steps_per_generation}), not a whole number of groups of "
                           f"num_generations={args.num_generations} (TRL counted {args.generation_batch_size} over "
                           "every rank); make it a multiple of num_generations")
    if layout.dp_size > 1 and rows % args.num_generations:
        raise TPLowerError(f"prepare_trainer: each dp rank generates {rows} rows at a time "
                           f"(per_device_train_batch_size {args.per_device_train_batch_size} x steps_per_generation "
                           f"{args.steps_per_generation}), not a whole number of groups of num_generations="
                           f"{args.num_generations}: a group would span dp ranks, and TRL's gather over every "
                           "process would mix it with the tp copies of the others; make the rows a multiple of "
                           "num_generations")


def fit_generation(args: Any, layout: DataLayout) -> None:
    """Count a generating trainer's generation batch over ``dp``: ``generation_batch_size =
    per_device_train_batch_size * dp * steps_per_generation`` (``steps_per_generation`` kept as
    ``GRPOConfig`` set it, from the accumulation steps unless given). Call :func:`check_generation` first."""
    if generates(args) and layout.dp_size != layout.mesh.size():
        args.generation_batch_size = args.per_device_train_batch_size * layout.dp_size * args.steps_per_generation
