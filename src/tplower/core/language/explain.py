"""Human-readable and JSON explanations of a transition plan (pure; no process group)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .placements import PlacementsLike, format_placement, format_placements, parse_placements
from .transitions import Step, TransitionPlan, plan_transition

__all__ = ["explain_moe", "explain_transition", "format_bytes", "moe_to_table", "plan_to_dict", "plan_to_table"]


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
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip())
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.append(f"total bytes sent per rank: forward {format_bytes(info['forward_bytes_per_rank'])}, "
                 f"backward {format_bytes(info['backward_bytes_per_rank'])}")
    return "\n".join(lines)


def _transition_rows(what: str, src: str, dst: str, grad: str, shape: tuple[int, int], n: int,
                     itemsize: int) -> list[dict[str, Any]]:
    plan = explain_transition(src, dst, ("tp",), (n,), shape, grad=grad)
    rows = []
    for direction, steps in (("forward", plan.forward), ("backward", plan.backward)):
        rows += [{"what": what, "direction": direction, "collective": st.kind, "shape": list(shape),
                  "bytes_per_rank": st.send_elems * itemsize} for st in steps]
    return rows


def explain_moe(tokens: int, hidden: int, top_k: int, num_experts: int, tp: int,
                dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The collectives one mixture-of-experts block issues per step, and the bytes each rank sends, both ways.

    ``"tp"``: tensor parallelism inside the experts (``moe_tp_experts``): the
    block's partial output is all-reduced once; in backward the gradients of
    the hidden states and of the routing weights, partial on each rank, are
    all-reduced. ``"ep"``: expert parallelism (``ep_dispatch_experts``): each
    rank takes its ``ceil(T/n)`` tokens (nothing sent), exchanges its
    per-expert counts (``all_gather`` of ``E`` int64), sends each of its
    ``t * k`` slots to the rank holding its expert and back (``all_to_all``,
    forward and backward: under uniform routing ``(n-1)/n`` of the rows leave
    the rank, all of them at worst), and gathers the block's output; in
    backward the hidden states' and routing weights' gradients are gathered.
    Transitions are planned by :func:`explain_transition` (ring conventions of
    :mod:`tplower.core.language.transitions`); the all-to-all bytes are expectations.

    Args:
        tokens: ``T``, tokens per step entering the block (batch x sequence), replicated over tp.
        hidden: ``H``, the hidden size.
        top_k: ``k``, experts per token.
        num_experts: ``E``.
        tp: ``n``, ranks of the axis (experts sharded by index over it for ``"ep"``).
        dtype: the activations' dtype.

    Returns:
        ``{"tp": {...}, "ep": {...}, "inputs": {...}}``; each of ``tp`` and
        ``ep`` has ``possible`` (true), ``rows`` (``what``, ``direction``, ``collective``,
        ``shape``, ``bytes_per_rank``), ``forward_bytes_per_rank``,
        ``backward_bytes_per_rank`` and ``step_bytes_per_rank``; ``ep`` also
        ``worst_step_bytes_per_rank`` (every slot to another rank). When
        ``num_experts`` does not divide over ``tp`` (each rank holds whole
        experts), ``ep`` is ``possible`` false with ``refused`` (why, and the
        rank counts that divide the experts), no rows and ``None`` bytes;
        ``tp`` is explained all the same.

    Raises:
        ValueError: a size below 1, or ``top_k > num_experts``.
    """
    for name, v in (("tokens", tokens), ("hidden", hidden), ("top_k", top_k), ("num_experts", num_experts),
                    ("tp", tp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"explain_moe: {name}={v!r}; it must be an integer of at least 1")
    if top_k > num_experts:
        raise ValueError(f"explain_moe: top_k={top_k} exceeds num_experts={num_experts}")
    item = torch.empty((), dtype=dtype).element_size()
    n = tp
    tp_rows = (_transition_rows("block output", "P(sum)", "R", "R", (tokens, hidden), n, item)
               + _transition_rows("hidden states' gradient", "R", "R", "P(sum)", (tokens, hidden), n, item)
               + _transition_rows("routing weights' gradient", "R", "R", "P(sum)", (tokens, top_k), n, item))
    t = -(-tokens // n)
    slots = t * top_k
    a2a = (n - 1) * slots * hidden * item // n
    worst = slots * hidden * item if n > 1 else 0
    ep_rows = (_transition_rows("hidden states (this rank's tokens)", "R", "S(0)", "S(0)", (tokens, hidden), n, item)
               + _transition_rows("routing weights (this rank's tokens)", "R", "S(0)", "S(0)", (tokens, top_k), n,
                                  item)
               + [{"what": "per-expert token counts", "direction": "forward", "collective": "all_gather",
                   "shape": [num_experts], "bytes_per_rank": (n - 1) * num_experts * 8}]
               + [{"what": f"{what} ({slots} slots, uniform routing)", "direction": d, "collective": "all_to_all",
                   "shape": [slots, hidden], "bytes_per_rank": a2a if n > 1 else 0}
                  for d in ("forward", "backward") for what in ("dispatch", "combine")]
               + _transition_rows("block output", "S(0)", "R", "R", (tokens, hidden), n, item))

    def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
        fwd = sum(r["bytes_per_rank"] for r in rows if r["direction"] == "forward")
        bwd = sum(r["bytes_per_rank"] for r in rows if r["direction"] == "backward")
        return {"possible": True, "rows": rows, "forward_bytes_per_rank": fwd, "backward_bytes_per_rank": bwd,
                "step_bytes_per_rank": fwd + bwd}

    if num_experts % n:
        divisors = ", ".join(str(d) for d in range(1, num_experts + 1) if num_experts % d == 0)
        ep: dict[str, Any] = {
            "possible": False, "rows": [], "forward_bytes_per_rank": None, "backward_bytes_per_rank": None,
            "step_bytes_per_rank": None, "worst_step_bytes_per_rank": None,
            "refused": f"{num_experts} experts do not divide over {n} ranks (expert parallelism gives each rank whole "
                       f"experts, by index); rank counts that divide them: {divisors}"}
    else:
        ep = totals(ep_rows)
        ep["worst_step_bytes_per_rank"] = ep["step_bytes_per_rank"] + 4 * (worst - a2a)
    return {"inputs": {"tokens": tokens, "hidden": hidden, "top_k": top_k, "num_experts": num_experts, "tp": tp,
                       "dtype": str(dtype).removeprefix("torch.")},
            "tp": totals(tp_rows), "ep": ep}


def moe_to_table(info: dict[str, Any]) -> str:
    """The dict of :func:`explain_moe` as text: one table per kind, totals, and which sends less."""
    i = info["inputs"]
    lines = [f"one MoE block per step: {i['tokens']} tokens x hidden {i['hidden']}, top-{i['top_k']} of "
             f"{i['num_experts']} experts, tp={i['tp']}, {i['dtype']}"]
    for kind, title in (("tp", "tensor parallelism inside the experts (experts='tp')"),
                        ("ep", "expert parallelism (experts='ep')")):
        part = info[kind]
        if not part["possible"]:
            lines += ["", f"{title}: refused: {part['refused']}"]
            continue
        lines += ["", title]
        head = ("direction", "what", "collective", "shape", "bytes/rank")
        rows = [(r["direction"], r["what"], r["collective"], str(tuple(r["shape"])), format_bytes(r["bytes_per_rank"]))
                for r in part["rows"]] or [("both", "-", "none", "-", "0 B")]
        widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
        lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip())
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        extra = (f" (every slot to another rank: {format_bytes(part['worst_step_bytes_per_rank'])})"
                 if kind == "ep" else "")
        lines.append(f"total per rank: forward {format_bytes(part['forward_bytes_per_rank'])}, backward "
                     f"{format_bytes(part['backward_bytes_per_rank'])}, step "
                     f"{format_bytes(part['step_bytes_per_rank'])}{extra}")
    tp_b, ep_b = info["tp"]["step_bytes_per_rank"], info["ep"]["step_bytes_per_rank"]
    if ep_b is None:
        lines += ["", f"use tensor parallelism inside the experts, the only kind that runs here ({format_bytes(tp_b)} "
                  "per rank per step)"]
        return "\n".join(lines)
    fewer = "expert parallelism" if ep_b < tp_b else "tensor parallelism inside the experts"
    lines += ["", f"fewer bytes per step: {fewer} ({format_bytes(min(tp_b, ep_b))} vs {format_bytes(max(tp_b, ep_b))})"]
    return "\n".join(lines)
