"""Every transformers decoder with a ``base_model_tp_plan``, tiny and random, under tplower's ``"auto"`` plan.

For each causal-LM architecture of the installed transformers whose config
defines ``base_model_tp_plan`` (:func:`architectures`), :func:`tiny_config`
builds a small random config (hidden 64, 2 layers, head and expert counts
that divide over tp=2) from the config class's defaults, the shared sizes of
``_SIZES`` and a few per-architecture overrides. :func:`run_table` then runs
every architecture on one set of spawned gloo ranks, catching each
architecture's errors so that one cannot end the others:

* tplower: ``parallelize(copy.deepcopy(ref), mesh, "auto")`` on the rank's
  one-process model ``ref``; the logits must equal ``ref``'s within
  :data:`TOL` (float32), and after one backward of the next-token
  cross-entropy so must every parameter's gradient (``full_tensor`` of a
  DTensor gradient), and a replicated parameter's gradient must be the same
  on every rank (a parameter used on a sharded activation whose gradient is
  never summed differs across ranks: Apertus' ``act_fn.alpha_p`` before
  :mod:`tplower.nn.coverage`).
* transformers' own TP: the same weights (saved by the parent with
  ``save_pretrained``) loaded with ``DistributedConfig(tp_size=world,
  tp_plan="auto")`` (needs ``accelerate``), against the same checkpoint
  loaded in one process.
* for MoE models whose config ships ``base_model_ep_plan``, both again with
  expert parallelism: tplower's ``parallelize(..., experts="ep")`` and
  transformers' ``ep_size=world`` (the experts sharded by index over the tp
  ranks).

``python -m tplower.run.hf_table --markdown`` prints the README's table.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ..core.errors import TPLowerError
from .hf_configs import _SIZES, Arch, architectures, tiny_config, tiny_model
from .quiet import quiet_transformers

__all__ = ["TOL", "Arch", "Outcome", "Row", "architectures", "by_design", "compare_training", "counts", "gaps",
           "has_ep_plan", "input_ids", "main", "markdown", "run_table", "tiny_config", "tiny_model"]

#: largest absolute logit difference from the one-process model that counts as equal (float32)
TOL = 1e-5
#: the fixed input is ``(BATCH, SEQ)`` token ids drawn from ``INPUT_SEED``; weights come from ``WEIGHT_SEED``
BATCH, SEQ, INPUT_SEED = 2, 8, 3

Status = Literal["pass", "fail", "refused", "error", "n/a"]


@dataclass(frozen=True)
class Outcome:
    """One side's result on one architecture.

    ``pass``/``fail``: logits (and, where checked, every gradient and the cross-rank agreement of the
    replicated ones: ``grad_diff``, the worst parameter in ``detail``) within / beyond :data:`TOL`
    (``max_diff``: the logits');
    ``refused``: a :class:`~tplower.TPLowerError` (``detail`` its message);
    ``error``: any other exception (``detail``: type and first line);
    ``n/a``: not run (``detail`` says why).
    """

    status: Status
    max_diff: float | None = None
    detail: str = ""
    grad_diff: float | None = None

    def cell(self) -> str:
        """The table cell: the status, with the max diff for pass/fail (logits, then gradients where checked)."""
        if self.max_diff is None:
            return self.status
        grads = f", grads {self.grad_diff:.1e}" if self.grad_diff is not None else ""
        return f"{self.status} ({self.max_diff:.1e}{grads})"


@dataclass(frozen=True)
class Row:
    """One architecture's line of the table: tensor parallelism, then expert parallelism (MoE models with an
    ``ep_plan``; ``n/a`` elsewhere)."""

    arch: Arch
    tplower: Outcome
    hf: Outcome
    tplower_ep: Outcome = Outcome("n/a")
    hf_ep: Outcome = Outcome("n/a")

    def note(self) -> str:
        """Why a side did not pass (tplower's reason, then transformers', then under EP), and any remark."""
        mt = self.arch.model_type
        parts = [_KNOWN.get((mt, "tplower")) or _short(self.tplower)] if self.tplower.status != "pass" else []
        if self.hf.status != "pass":
            parts.append(f"transformers: {_KNOWN.get((mt, 'transformers')) or _short(self.hf)}")
        if self.tplower_ep.status not in ("pass", "n/a") and self.tplower_ep.detail != self.tplower.detail:
            parts.append(f"tplower EP: {_short(self.tplower_ep)}")
        if self.hf_ep.status not in ("pass", "n/a"):
            parts.append(f"transformers EP: {_short(self.hf_ep)}")
        parts.append(_REMARKS.get(mt, ""))
        return "; ".join(p for p in parts if p)


# Causes found by reading the failing code, shown (instead of the bare exception) while that side does not pass.
_KNOWN: dict[tuple[str, str], str] = {
    ("doge", "tplower"): "transformers' plan makes `self_attn.dt_proj` rowwise, so the dynamic mask it computes "
                         "covers every kv head while q/k/v hold this rank's heads",
    ("doge", "transformers"): "the same plan error",
    ("dory", "tplower"): "`lm_head` (DoryLMHead) multiplies its local logits by its own `logit_scale` (vocab,), "
                         "which transformers' colwise shards like the weight and tplower's leaves whole",
    ("inkling_text", "transformers"): "AssertionError in DTensor reducing a Partial inside `embed_tokens`' norm",
    ("sarvam_moe", "transformers"): "loading under TP fails to convert the checkpoint's attention weights "
                                    "(the one-process load works)",
}
_REMARKS = {"llama4": "`Llama4Config`'s `text_config`: the model of `llama4_text`"}


def by_design(outcome: Outcome) -> bool:
    """A refusal of a style tplower has no faithful translation for (MoE experts, MLA's split projection)."""
    return outcome.status == "refused" and "has no faithful translation" in outcome.detail


def _short(outcome: Outcome) -> str:
    match = re.match(r"plan\['([^']+)'\]: style '([^']+)'.*?translation: ([^;]+)", outcome.detail)
    if match:
        module, style, why = match.groups()
        return f"`{style}` on `{module}`: {why.split(',')[0]}"
    return outcome.detail


# ---------------------------------------------------------------------------------------------- runs

def input_ids() -> torch.Tensor:
    """The fixed ``(BATCH, SEQ)`` input: ids below ``vocab_size - 16``, clear of the special ids set above."""
    high = _SIZES["vocab_size"] - 16
    return torch.randint(0, high, (BATCH, SEQ), generator=torch.Generator().manual_seed(INPUT_SEED))


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    return out.full_tensor() if isinstance(out, DTensor) else out


def _compare(got: torch.Tensor, want: torch.Tensor) -> Outcome:
    if got.shape != want.shape:
        return Outcome("fail", detail=f"logits shape {tuple(got.shape)}, one process {tuple(want.shape)}")
    diff = float((got - want).abs().max())
    return Outcome("pass" if diff <= TOL else "fail", diff, "" if diff <= TOL else f"max diff {diff:.1e} > {TOL:.0e}")


def _train_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The logits (whole), after one backward of the next-token cross-entropy on ``ids``."""
    from torch.distributed.tensor import DTensor

    out = model(input_ids=ids, use_cache=False).logits
    full = out.full_tensor() if isinstance(out, DTensor) else out
    logits = full[:, :-1].float()
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    return full.detach()


def _replica_spread(grad: torch.Tensor) -> float:
    """How far a replicated DTensor gradient's local values differ across its mesh's ranks (max - min)."""
    import torch.distributed as dist

    local = grad.to_local().detach().float()  # type: ignore[attr-defined]
    hi, lo = local.clone(), local.clone()
    group = grad.device_mesh.get_group()  # type: ignore[attr-defined]
    dist.all_reduce(hi, dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, dist.ReduceOp.MIN, group=group)
    return float((hi - lo).abs().max()) if local.numel() else 0.0


def compare_training(tp: nn.Module, ref: nn.Module, ids: torch.Tensor | None,
                     step: Callable[[nn.Module], torch.Tensor] | None = None) -> Outcome:
    """Logits, every parameter gradient and the replicated gradients' cross-rank agreement of ``tp`` vs ``ref``.

    Runs one forward and backward of each (next-token cross-entropy on ``ids``, or ``step(model)``, which
    runs a forward and a backward and returns the whole output, detached); call on every rank alike (the
    agreement check is a collective per replicated DTensor gradient). ``grad_diff`` is the largest of the
    gradient differences and spreads; ``detail`` names the worst parameter when it is beyond :data:`TOL`.
    """
    from torch.distributed.tensor import DTensor, Replicate

    if step is None:
        assert ids is not None, "compare_training: ids or step"
        step = functools.partial(_train_logits, ids=ids)
    want, got = step(ref), step(tp)
    logits = _compare(got, want)
    if logits.max_diff is None:
        return logits
    mine = dict(tp.named_parameters())
    worst, what = 0.0, ""
    for name, p in ref.named_parameters():
        q = mine.get(name)
        g = None if q is None else q.grad
        if (p.grad is None) != (g is None):
            return Outcome("fail", logits.max_diff, f"gradient of {name}: one process "
                           f"{'none' if p.grad is None else 'set'}, parallel {'none' if g is None else 'set'}", 0.0)
        if p.grad is None or g is None:
            continue
        if isinstance(g, DTensor) and all(isinstance(x, Replicate) for x in g.placements):
            spread = _replica_spread(g)
            if spread > worst:
                worst, what = spread, f"replicated gradient of {name} differs across ranks by {spread:.1e}"
        full = g.full_tensor() if isinstance(g, DTensor) else g
        if full.shape != p.grad.shape:
            return Outcome("fail", logits.max_diff, f"gradient of {name}: shape {tuple(full.shape)}, one process "
                           f"{tuple(p.grad.shape)}", 0.0)
        diff = float((full - p.grad).abs().max()) if full.numel() else 0.0
        if diff > worst:
            worst, what = diff, f"gradient of {name} off by {diff:.1e}"
    ok = logits.status == "pass" and worst <= TOL
    detail = logits.detail or (what if worst > TOL else "")
    return Outcome("pass" if ok else "fail", logits.max_diff, detail, worst)


def _describe(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")


def _guarded(run: Callable[[], Outcome]) -> Outcome:
    """``run()``, with a :class:`TPLowerError` as ``refused`` and any other exception as ``error``."""
    try:
        return run()
    except TPLowerError as exc:
        return Outcome("refused", detail=str(exc).strip().splitlines()[0])
    except Exception as exc:  # one architecture's failure is that architecture's row, never the run's end
        return Outcome("error", detail=_describe(exc))


def has_ep_plan(arch: Arch) -> bool:
    """Whether the architecture's config ships a ``base_model_ep_plan`` (its experts can be sharded by index)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return bool(getattr(CONFIG_MAPPING[arch.model_type], "base_model_ep_plan", None))


def _tplower_side(arch: Arch, mesh: Any, ids: torch.Tensor, experts: str = "tp",
                  vocab_size: int | None = None) -> Outcome:
    from ..nn.parallelize import parallelize

    ref = tiny_model(arch, vocab_size)
    tp = parallelize(copy.deepcopy(ref), mesh, "auto", experts=experts)
    return compare_training(tp, ref, ids)


def _hf_side(folder: str, ids: torch.Tensor, world: int, experts: str = "tp") -> Outcome:
    from transformers import AutoModelForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = _logits(ref, ids)
    config = (DistributedConfig(tp_size=world, tp_plan="auto", ep_size=world) if experts == "ep"
              else DistributedConfig(tp_size=world, tp_plan="auto"))
    tp = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, distributed_config=config)
    return _compare(_logits(tp.eval(), ids), want)


def _rank_body(rank: int, world: int, archs: list[Arch], folders: dict[str, str],
               with_hf: bool, vocab_size: int | None = None) -> list[tuple[Outcome, Outcome, Outcome, Outcome]]:
    """On every rank: each architecture's tplower and transformers outcomes, in order."""
    from torch.distributed.device_mesh import init_device_mesh

    # transformers' DistributedConfig reads the launcher's variables; the process group is already up
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ids = input_ids()
    out: list[tuple[Outcome, Outcome, Outcome, Outcome]] = []
    with quiet_transformers():
        for arch in archs:
            row = []
            for experts in ("tp", "ep"):
                if experts == "ep" and not has_ep_plan(arch):
                    row += [Outcome("n/a", detail="no ep_plan")] * 2
                    continue
                row.append(_guarded(functools.partial(_tplower_side, arch, mesh, ids, experts, vocab_size)))
                folder = folders.get(arch.model_type)
                row.append(_guarded(functools.partial(_hf_side, folder, ids, world, experts))
                           if with_hf and folder else Outcome("n/a", detail="transformers' side not run"))
            out.append((row[0], row[1], row[2], row[3]))
    return out


def _merge(per_rank: Sequence[Outcome]) -> Outcome:
    """One outcome from every rank's: the first that did not pass, else rank 0's with the largest diff."""
    for outcome in per_rank:
        if outcome.status != "pass":
            return outcome
    grads = [o.grad_diff for o in per_rank if o.grad_diff is not None]
    return dataclasses.replace(per_rank[0], max_diff=max(o.max_diff or 0.0 for o in per_rank),
                               grad_diff=max(grads) if grads else None)


def run_table(model_types: Sequence[str] | None = None, *, with_hf: bool = True, world: int = 2,
              timeout: float = 1800.0, vocab_size: int | None = None) -> list[Row]:
    """Run every architecture (or ``model_types``) on ``world`` spawned gloo ranks, one spawn for all.

    Args:
        model_types: a subset of :func:`architectures` (default: all).
        with_hf: also run transformers' own TP (needs ``accelerate``); the
            parent saves each tiny model to a temporary folder for it.
        world: the tp degree (every sharded dim of the tiny configs divides by 2).
        timeout: seconds for the whole run.
        vocab_size: every tiny model's vocabulary (default ``_SIZES``' 128,
            which divides by 2; e.g. 129, which no tp divides: vocabulary-
            parallel embeddings and heads then shard unevenly).

    Returns:
        One :class:`Row` per architecture, in :func:`architectures` order;
        a model that cannot be built is a row of ``error`` outcomes.

    Raises:
        tplower.testing.RankFailure: a rank died or the run outlived ``timeout``.
    """
    from ..testing import run_processes

    archs = architectures(model_types)
    broken: dict[str, Outcome] = {}
    with tempfile.TemporaryDirectory(prefix="tplower-hf-") as tmp, quiet_transformers():
        folders: dict[str, str] = {}
        for arch in archs if with_hf else ():  # without transformers' side, a rank reports a build error itself
            try:
                model: Any = tiny_model(arch, vocab_size)
                folder = str(Path(tmp) / arch.model_type)
                model.save_pretrained(folder)
                folders[arch.model_type] = folder
            except Exception as exc:  # a config the generic builder cannot make: its row says why
                broken[arch.model_type] = Outcome("error", detail=f"tiny model: {_describe(exc)}")
        runnable = [a for a in archs if a.model_type not in broken]
        results = run_processes(world, _rank_body, runnable, folders, with_hf, vocab_size, timeout=timeout,
                                pg_timeout=min(timeout, 120.0))
    outcomes = {a.model_type: tuple(_merge([r[i][side] for r in results]) for side in range(4))
                for i, a in enumerate(runnable)}
    return [Row(a, *outcomes[a.model_type]) if a.model_type in outcomes
            else Row(a, broken[a.model_type], broken[a.model_type]) for a in archs]


# ---------------------------------------------------------------------------------------------- report

def counts(rows: Sequence[Row]) -> dict[str, dict[str, int]]:
    """How many architectures each side passes, fails, refuses or errors on (EP sides: MoE models only)."""
    out: dict[str, dict[str, int]] = {"tplower": {}, "transformers": {}, "tplower EP": {}, "transformers EP": {}}
    for row in rows:
        for side, outcome in (("tplower", row.tplower), ("transformers", row.hf), ("tplower EP", row.tplower_ep),
                              ("transformers EP", row.hf_ep)):
            if outcome.status != "n/a" or not side.endswith("EP"):
                out[side][outcome.status] = out[side].get(outcome.status, 0) + 1
    return out


def gaps(rows: Sequence[Row], *, allow_by_design: bool = True) -> list[Row]:
    """Rows transformers passes and tplower does not, under TP or under EP (by default a refusal
    :func:`by_design` is allowed)."""
    def missed(mine: Outcome, theirs: Outcome) -> bool:
        return theirs.status == "pass" and mine.status != "pass" and not (allow_by_design and by_design(mine))

    return [r for r in rows if missed(r.tplower, r.hf) or missed(r.tplower_ep, r.hf_ep)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(rows: Sequence[Row]) -> str:
    """The README table: architecture | tplower | transformers TP | note, then the counts."""
    lines = ["| architecture | tplower | transformers TP | tplower EP | transformers EP | note |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        arch = f"`{row.arch.model_type}` ({row.arch.causal_lm})"
        lines.append(f"| {arch} | {row.tplower.cell()} | {row.hf.cell()} | {row.tplower_ep.cell()} | "
                     f"{row.hf_ep.cell()} | {_cell(row.note())} |")
    lines.append("")
    for side, per_status in counts(rows).items():
        lines.append(f"{side}: " + ", ".join(f"{n} {status}" for status, n in sorted(per_status.items())) + "  ")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tplower.run.hf_table [--only a,b] [--no-hf] [--markdown] [--json FILE]``; 1 if :func:`gaps`."""
    parser = argparse.ArgumentParser(prog="python -m tplower.run.hf_table",
                                     description="tplower's and transformers' TP on every HF decoder, tiny, at tp=2")
    parser.add_argument("--only", default="", help="comma list of model_types (default: every architecture)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' own TP")
    parser.add_argument("--markdown", action="store_true", help="print the README table")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON to this file")
    parser.add_argument("--vocab", type=int, default=None,
                        help="every tiny model's vocabulary size (default 128; e.g. 129, which no tp divides)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = run_table([m for m in args.only.split(",") if m] or None, with_hf=not args.no_hf, vocab_size=args.vocab)
    seconds = time.perf_counter() - start
    if args.markdown:
        print(markdown(rows))
    else:
        for row in rows:
            print(f"{row.arch.model_type:24} {row.tplower.cell():18} {row.hf.cell():18} {row.tplower_ep.cell():18} "
                  f"{row.hf_ep.cell():18} {row.note()}")
    print(f"\n{len(rows)} architectures in {seconds:.0f} s", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    missing = gaps(rows, allow_by_design=False)
    for row in missing:
        print(f"tplower misses {row.arch.model_type}, which transformers passes: {row.note()}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
