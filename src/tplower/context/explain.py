"""What context parallelism sends per step, by mode: the exchanges around attention, the loss, the gradients.

Pure arithmetic (no process group), in the ring conventions tplower counts
every collective by (:mod:`tplower.core.lower.traffic`): an ``all_to_all`` sends
``(n-1)/n`` of its input, an ``all_gather`` ``n-1`` local pieces, a
``reduce_scatter`` ``n-1`` output pieces, an ``all_reduce`` ``2(n-1)/n`` of
its tensor. A rank's pieces are padded to the longest before an exchange
(:mod:`tplower.context.attention`), so the local length here is the longest
piece of the layout (:class:`~tplower.context.layout.SequenceLayout`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..core.language.explain import format_bytes
from ..core.support.words import count
from ..runtime.grad_sums import sum_chunks
from .exchange import hybrid_degree
from .layout import SequenceLayout
from .window import holder_keys, plan_window_keys

__all__ = ["context_to_table", "divisors", "explain_context", "head_problem", "ulysses_refusal"]


def _check(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"explain_context: {name}={v!r}; it must be an integer of at least 1")


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` (at least 1), ascending: ``12`` -> ``[1, 2, 3, 4, 6, 12]``."""
    return [d for d in range(1, n + 1) if n % d == 0]


def head_problem(hidden: int, heads: int, kv_heads: int, tp: int = 1, head_dim: int | None = None) -> str | None:
    """What makes these head counts no attention layer, in the words of the sizes' own names; ``None`` if nothing.

    ``hidden`` must divide by ``heads`` unless ``head_dim`` is given (the head size is ``hidden // heads``
    otherwise); ``kv_heads`` must divide ``heads`` (each key/value head serves a whole group of query heads);
    ``tp`` must divide both head counts (tensor parallelism gives each rank whole heads).
    """
    if head_dim is None and hidden % heads:
        near = sorted(divisors(hidden), key=lambda d: (abs(d - heads), d))[:2]
        return (f"heads={heads} does not divide hidden={hidden} (the head size is hidden / heads); give heads "
                f"that divide {hidden}, e.g. {' or '.join(map(str, sorted(near)))}, or head_dim=D for a model "
                "whose head size is not hidden / heads")
    if heads % kv_heads:
        return (f"kv_heads={kv_heads} does not divide heads={heads} (each key/value head serves a whole group of "
                f"query heads); kv_heads is one of {', '.join(map(str, divisors(heads)))}")
    if heads % tp or kv_heads % tp:
        return (f"tp={tp} does not divide heads={heads} and kv_heads={kv_heads} (each tensor-parallel rank holds "
                f"whole heads); tp is one of {', '.join(map(str, divisors(math.gcd(heads, kv_heads))))}")
    return None


def ulysses_refusal(heads: int, tp: int, cp: int) -> str | None:
    """Why ``context_mode='ulysses'`` cannot split these heads over ``cp`` ranks; ``None`` when it can."""
    local = heads // tp
    if local % cp == 0:
        return None
    per_rank = f"the {local} query heads per rank (heads={heads} / tp={tp})" if tp > 1 else f"the {heads} query heads"
    return (f"it splits the query heads over the cp ranks, and {per_rank} do not divide over cp={cp}; cp sizes "
            f"that divide them: {', '.join(map(str, divisors(local)))}")


def _hybrid_rows(h_q: int, h_kv: int, n: int, u: int, piece: int, layers: int, layout: SequenceLayout,
                 window: int | None, windowed: int, key_bytes: int) -> list[dict[str, Any]]:
    """The hybrid mode's exchanges over ``n`` ranks as ``n/u`` groups of ``u``: Ulysses inside a group (its
    ``all_to_all`` over ``u`` ranks, key/value heads repeated where they do not divide over ``u``), then the
    group's keys and values, ``h_kv * rep`` heads of ``u`` pieces, gathered across the groups (their gradients
    reduce-scattered back; under a window, those the group's windows reach, ``h_kv * rep / u`` heads a rank). An
    exchange over one rank sends nothing and is left out."""
    g, rep = n // u, 1 if h_kv % u == 0 else u // math.gcd(h_kv, u)
    inside, across = f"inside groups of {u}", f"across {g} groups"
    rows = [] if u == 1 else [
        {"what": f"query, output (S(seq) <-> S(heads) {inside})", "collective": "all_to_all", "count": 4 * layers,
         "bytes_per_rank": 4 * layers * (u - 1) * (h_q // u) * piece},
        {"what": f"key, value ({inside}" + (f", each head repeated {rep}x)" if rep > 1 else ")"),
         "collective": "all_to_all", "count": 4 * layers, "bytes_per_rank": 4 * layers * (u - 1) * (h_kv * rep // u)
         * piece}]
    if g > 1:
        rows += _gather_rows(layout, window, windowed, layers, g, h_kv * rep, piece, key_bytes * h_kv * rep // u,
                             across)
    return rows


def _window_rows(layout: SequenceLayout, window: int, holders: int, key_bytes: int, count: int,
                 where: str) -> list[dict[str, Any]] | None:
    """The exchange of the keys the windows reach over ``holders`` holders (:mod:`tplower.context.window`), for
    ``count`` layers, of the holder that sends most per step (``key_bytes``: a key and its value on one rank);
    ``None`` where the windows reach every key (the all-gather's rows hold)."""
    slots, needs = holder_keys(layout, window, holders, padded=False)
    plan = plan_window_keys(slots, needs, 0, layout.length, range(holders))
    if plan is None:
        return None
    sent = [sum(row) for row in plan.matrix]
    got = [sum(row[h] for row in plan.matrix) for h in range(holders)]
    most = max(range(holders), key=lambda h: sent[h] + got[h])
    at = f", {where}" if where else ""
    return [{"what": f"key, value the windows reach (W={window}{at})", "collective": "all_to_all",
             "count": count, "bytes_per_rank": count * sent[most] * key_bytes},
            {"what": f"key, value gradients back to their holders (W={window}{at})", "collective": "all_to_all",
             "count": count, "bytes_per_rank": count * got[most] * key_bytes}]


def _gather_rows(layout: SequenceLayout, window: int | None, windowed: int, layers: int, holders: int,
                 heads: int, piece: int, key_bytes: int, where: str) -> list[dict[str, Any]]:
    """Keys and values ``S(seq) -> R`` over ``holders`` (gradients reduce-scattered back) for each layer, but for
    the ``windowed`` layers with a window of ``window`` keys where it hides keys (:func:`_window_rows`)."""
    rows = _window_rows(layout, window, holders, key_bytes, windowed, where) if window and windowed else None
    whole = layers - windowed if rows is not None else layers
    rows = rows or []
    at = f" {where}" if where else ""
    if whole:
        rows = [{"what": f"key, value (S(seq) -> R{at})", "collective": "all_gather", "count": 2 * whole,
                 "bytes_per_rank": 2 * whole * (holders - 1) * heads * piece},
                {"what": f"key, value gradients (P(sum) -> S(seq){at})", "collective": "reduce_scatter",
                 "count": 2 * whole, "bytes_per_rank": 2 * whole * (holders - 1) * heads * piece}, *rows]
    return rows


def explain_context(batch: int, seq: int, hidden: int, heads: int, kv_heads: int, cp: int, tp: int = 1, *,
                    layers: int = 1, head_dim: int | None = None, params: int = 0, tensors: int = 0,
                    balance: bool = True, dtype: torch.dtype = torch.float32, ulysses: int | None = None,
                    window: int | None = None, window_layers: int | None = None) -> dict[str, Any]:
    """The collectives and bytes each rank sends per train step under each context-parallel mode.

    Args:
        batch, seq: the whole batch's ``[B, S]``.
        hidden, heads, kv_heads: the model's hidden size and query and key/value head counts.
        cp: ranks of the context-parallel axis; ``tp``: of the tensor-parallel one (it splits the heads).
        layers: attention layers.
        head_dim: default ``hidden // heads``.
        params: parameter elements each rank holds (after tp): their gradients are summed over cp once, at
            the end of backward, in chunks of at most 25 MiB, one ``all_reduce`` each
            (:mod:`tplower.runtime.grad_sums`; 0: left out).
        tensors: parameter tensors: each adds one element to the sums, the flag that says whether a rank
            used it.
        balance: as :func:`tplower.shard_sequence` cuts the sequence.
        dtype: activations' and gradients' dtype.
        ulysses: the hybrid mode's Ulysses degree (a divisor of ``cp``); default: the one
            :func:`tplower.parallelize` chooses from the heads
            (:func:`~tplower.context.exchange.hybrid_degree`).
        window: a causal sliding window of this many keys on ``window_layers`` of the layers (default: every
            layer), run on the batch's runs (``sdpa``): the all-gather mode, and the hybrid's exchange across
            groups, send only the keys the windows reach where they hide some (:mod:`tplower.context.window`:
            one ``all_to_all`` each way; the rank that sends most is shown, ranks differ), else every key.

    Returns:
        ``{"ulysses": {...}, "allgather": {...}, "hybrid": {...}, "inputs": {...}}``; each mode has ``rows``
        (``what``, ``collective``, ``count``, ``bytes_per_rank``) and ``step_bytes_per_rank`` (forward and
        backward); ``inputs`` has the hybrid's ``ulysses`` degree. The hybrid's rows are those of a layer that
        runs on the batch's runs (``sdpa``, causal, a sliding window or none); a layer with a dense mask runs the
        all-gather mode's exchanges (:mod:`tplower.context.attention`).

        A mode that cannot run with these sizes (Ulysses, or the hybrid's Ulysses degree, where the query heads
        per rank do not divide over it) has ``possible`` false, ``refused`` (why, and the sizes that would run),
        no rows and ``step_bytes_per_rank`` ``None``; a mode that can has ``possible`` true.

    Raises:
        ValueError: a size below 1, head counts no attention layer has (:func:`head_problem`), a ``ulysses``
            that does not divide ``cp``, or ``window_layers`` without ``window`` or above ``layers``.
    """
    _check(batch=batch, seq=seq, hidden=hidden, heads=heads, kv_heads=kv_heads, cp=cp, tp=tp, layers=layers)
    if ulysses is not None:
        _check(ulysses=ulysses)
        if cp % ulysses:
            raise ValueError(f"explain_context: ulysses={ulysses} does not divide cp={cp}; the hybrid mode's "
                             f"Ulysses degree is one of {', '.join(map(str, divisors(cp)))}")
    if head_dim is not None:
        _check(head_dim=head_dim)
    if window is not None:
        _check(window=window)
    if window_layers is not None and (window is None or not 0 <= window_layers <= layers):
        raise ValueError(f"explain_context: window_layers={window_layers!r} needs a window and at most "
                         f"layers={layers} (got window={window!r})")
    if problem := head_problem(hidden, heads, kv_heads, tp, head_dim):
        raise ValueError(f"explain_context: {problem}")
    d = head_dim if head_dim is not None else hidden // heads
    item = torch.empty((), dtype=dtype).element_size()
    n = cp
    width = max(SequenceLayout(seq, n, balance).lengths)
    h_q, h_kv = heads // tp, kv_heads // tp
    u = ulysses if ulysses is not None else hybrid_degree(n, [(h_q, h_kv)])
    rep = 1 if h_kv % n == 0 else n // math.gcd(h_kv, n)  # Ulysses repeats key/value heads fewer than cp
    piece = batch * width * d * item  # one head of one rank's padded piece

    def a2a(h: int) -> int:
        return (n - 1) * (h // n) * piece if h % n == 0 else 0

    uly = [{"what": "query, output (S(seq) <-> S(heads))", "collective": "all_to_all", "count": 4 * layers,
            "bytes_per_rank": 4 * layers * a2a(h_q)},
           {"what": "key, value" + (f" (each head repeated {rep}x)" if rep > 1 else ""), "collective": "all_to_all",
            "count": 4 * layers, "bytes_per_rank": 4 * layers * a2a(h_kv * rep)}]
    layout, windowed = SequenceLayout(seq, n, balance), layers if window_layers is None else window_layers
    key_bytes = 2 * batch * d * item  # a key and its value, one head
    gather = _gather_rows(layout, window, windowed, layers, n, h_kv, piece, key_bytes * h_kv, "")
    common = [{"what": "the loss (P(sum) -> R)", "collective": "all_reduce", "count": 1,
               "bytes_per_rank": 2 * (n - 1) * 4 // n}]
    if params:
        chunks = sum_chunks(params + tensors, item)
        common.append({"what": f"parameter gradients ({params} elements, P(sum) -> R, at the end of backward)",
                       "collective": "all_reduce", "count": len(chunks),
                       "bytes_per_rank": sum(2 * (n - 1) * c * item // n for c in chunks)})
    out: dict[str, Any] = {"inputs": {"batch": batch, "seq": seq, "hidden": hidden, "heads": heads,
                                      "kv_heads": kv_heads, "head_dim": d, "cp": cp, "tp": tp, "layers": layers,
                                      "local_width": width, "dtype": str(dtype).removeprefix("torch."),
                                      "ulysses": u}}
    fits = [d for d in divisors(cp) if h_q % d == 0]
    refusals = {"ulysses": ulysses_refusal(heads, tp, cp), "allgather": None,
                "hybrid": None if h_q % u == 0 else f"ulysses={u} splits the {h_q} query heads per rank over {u} "
                          f"ranks, which does not divide them; degrees that divide cp={cp} and them: "
                          f"{', '.join(map(str, fits))}"}
    hybrid = _hybrid_rows(h_q, h_kv, n, u, piece, layers, layout, window, windowed, key_bytes)
    for mode, rows in (("ulysses", uly), ("allgather", gather), ("hybrid", hybrid)):
        if (why := refusals[mode]) is not None:
            out[mode] = {"rows": [], "step_bytes_per_rank": None, "possible": False, "refused": why}
            continue
        rows = rows + common
        out[mode] = {"rows": rows, "step_bytes_per_rank": sum(r["bytes_per_rank"] for r in rows), "possible": True}
    return out


def context_to_table(info: dict[str, Any]) -> str:
    """The dict of :func:`explain_context` as text: one table per mode and which sends least."""
    i = info["inputs"]
    lines = [f"context parallelism per train step: batch {i['batch']} x {i['seq']} tokens (longest piece "
             f"{i['local_width']}), hidden {i['hidden']}, {i['heads']} heads / {i['kv_heads']} key/value heads of "
             f"{i['head_dim']}, {count(i['layers'], 'layer')}, cp={i['cp']}, tp={i['tp']}, {i['dtype']}"]
    titles = {"ulysses": "context_mode='ulysses'", "allgather": "context_mode='allgather'",
              "hybrid": f"context_mode='hybrid' (context_ulysses={i['ulysses']}: {i['cp'] // i['ulysses']} x "
                        f"{i['ulysses']})"}
    for mode, title in titles.items():
        part = info[mode]
        if not part["possible"]:
            lines += ["", f"{title}: refused: {part['refused']}"]
            continue
        lines += ["", title]
        head = ("what", "collective", "count", "bytes/rank")
        rows = [(r["what"], r["collective"], str(r["count"]),
                 format_bytes(r["bytes_per_rank"])) for r in part["rows"]]
        widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
        lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip())
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        lines.append(f"total per rank, forward and backward: {format_bytes(part['step_bytes_per_rank'])}")
    sent = {m: info[m]["step_bytes_per_rank"] for m in titles if info[m]["possible"]}
    best = min(sent, key=lambda m: sent[m])
    if len(sent) == 1:
        lines += ["", f"use context_mode={best!r}, the only mode that runs here ({format_bytes(sent[best])} per rank "
                  "per step)"]
        return "\n".join(lines)
    others = ", ".join(f"{m} {format_bytes(b)}" for m, b in sent.items() if m != best)
    lines += ["", f"fewer bytes per step: {best} ({format_bytes(sent[best])}; {others})" +
              ("; time and memory favour ulysses where its heads divide (benchmarks/results/context_modes.md)"
               if "ulysses" in sent else "")]
    return "\n".join(lines)
