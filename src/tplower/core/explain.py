"""Human-readable and JSON explanations of a transition plan (pure; no process group)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .placements import PlacementsLike, format_placement, format_placements, parse_placements
from .transitions import Step, TransitionPlan, plan_transition

__all__ = ["explain_transition", "format_bytes", "plan_to_dict", "plan_to_table"]


def format_bytes(n: int) -> str:
    """``n`` bytes as B, KiB, MiB or GiB with one decimal (binary units)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def explain_transition(src: PlacementsLike, dst: PlacementsLike, mesh_dim_names: Sequence[str],
                       mesh_shape: Sequence[int], global_shape: Sequence[int], *,
                       grad: PlacementsLike | None = None,
                       coord: Sequence[int] | None = None) -> TransitionPlan:
    """Plan a transition for the rank at ``coord`` (default: all zeros, which holds the largest pieces).

    Raises:
        TPLowerError: bad placements or a pair with no lowering.
    """
    nd = len(global_shape)
    names = tuple(mesh_dim_names)
    s = parse_placements(src, names, tensor_ndim=nd, arg="src")
    d = parse_placements(dst, names, tensor_ndim=nd, arg="dst")
    g = None if grad is None else parse_placements(grad, names, tensor_ndim=nd, arg="grad")
    return plan_transition(s, d, global_shape, mesh_shape, tuple(coord or (0,) * len(names)), g)


def _step_row(step: Step, direction: str, names: Sequence[str], itemsize: int) -> dict[str, Any]:
    return {"direction": direction, "axis": names[step.axis], "transition":
            f"{format_placement(step.src)} -> {format_placement(step.dst)}", "collective": step.kind,
            "tensor_dim": step.tensor_dim if step.kind != "all_to_all" else f"{step.tensor_dim}->{step.dst_dim}",
            "reduce_op": step.reduce_op, "in_shape": list(step.in_shape), "out_shape": list(step.out_shape),
            "bytes_per_rank": step.send_elems * itemsize}


def plan_to_dict(plan: TransitionPlan, names: Sequence[str], dtype: torch.dtype) -> dict[str, Any]:
    """The plan as a JSON-ready dict: placements, shapes, one row per step, byte totals."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    fwd = [_step_row(s, "forward", names, itemsize) for s in plan.forward]
    bwd = [_step_row(s, "backward", names, itemsize) for s in plan.backward]
    return {"src": format_placements(plan.src), "dst": format_placements(plan.dst),
            "grad": format_placements(plan.grad), "grad_to": format_placements(plan.grad_dst),
            "global_shape": list(plan.global_shape), "dtype": str(dtype).removeprefix("torch."),
            "local_in_shape": list(plan.in_shape), "local_out_shape": list(plan.out_shape),
            "steps": fwd + bwd,
            "forward_bytes_per_rank": sum(r["bytes_per_rank"] for r in fwd),
            "backward_bytes_per_rank": sum(r["bytes_per_rank"] for r in bwd)}


def plan_to_table(info: dict[str, Any]) -> str:
    """The dict of :func:`plan_to_dict` as an aligned text table with totals."""
    head = ("direction", "axis", "transition", "collective", "dim", "op", "local in -> out", "bytes/rank")
    rows = [(r["direction"], r["axis"], r["transition"], r["collective"], str(r["tensor_dim"] or "-")
             if r["tensor_dim"] != 0 else "0", r["reduce_op"] or "-",
             f"{tuple(r['in_shape'])} -> {tuple(r['out_shape'])}", format_bytes(r["bytes_per_rank"]))
            for r in info["steps"]]
    if not rows:
        rows = [("both", "-", "identity", "none", "-", "-", "-", "0 B")]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    lines = [f"{info['src']} -> {info['dst']} (grad {info['grad']} -> {info['grad_to']}), global "
             f"{tuple(info['global_shape'])} {info['dtype']}, local {tuple(info['local_in_shape'])} -> "
             f"{tuple(info['local_out_shape'])}"]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.append(f"total bytes sent per rank: forward {format_bytes(info['forward_bytes_per_rank'])}, "
                 f"backward {format_bytes(info['backward_bytes_per_rank'])}")
    return "\n".join(lines)
