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
* derive (the command's default, ``with_derive`` in :func:`run_table`):
  ``parallelize(..., "derive")``, checked as the tplower column, with the
  bytes each rank sends in the step against the shipped plan's
  (:mod:`tplower.run.hf_derive`).

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.support.words import count
from .compare import TOL, Outcome, compare_logits, compare_training, describe, eval_logits, guarded, merge
from .hf_configs import _SIZES, Arch, architectures, tiny_config, tiny_model
from .hf_context import context_side
from .hf_context_rows import markdown as context_markdown
from .hf_context_rows import run_rows
from .hf_context_rows import totals as context_totals
from .hf_derive import byte_counts, derive_cell, derive_side
from .quiet import quiet_transformers

__all__ = ["TOL", "Arch", "Outcome", "Row", "architectures", "by_design", "compare_training", "counts", "gaps",
           "has_ep_plan", "input_ids", "main", "markdown", "run_table", "tiny_config", "tiny_model"]

#: the fixed input is ``(BATCH, SEQ)`` token ids drawn from ``INPUT_SEED``; weights come from ``WEIGHT_SEED``
BATCH, SEQ, INPUT_SEED = 2, 8, 3

_NOT_RUN = Outcome("n/a")


@dataclass(frozen=True)
class Row:
    """One architecture's line of the table: tensor parallelism, then expert parallelism (MoE models with an
    ``ep_plan``; ``n/a`` elsewhere), then tplower's derived plan (``n/a`` unless run)."""

    arch: Arch
    tplower: Outcome
    hf: Outcome
    tplower_ep: Outcome = _NOT_RUN
    hf_ep: Outcome = _NOT_RUN
    derive: Outcome = _NOT_RUN
    context: Outcome = _NOT_RUN

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
        if self.derive.status not in ("pass", "n/a"):
            parts.append(f"derive: {_short(self.derive)}")
        if self.context.status not in ("pass", "n/a"):
            parts.append(f"cp: {_short(self.context)}")
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


def has_ep_plan(arch: Arch) -> bool:
    """Whether the architecture's config ships a ``base_model_ep_plan`` (its experts can be sharded by index)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return bool(getattr(CONFIG_MAPPING[arch.model_type], "base_model_ep_plan", None))


def _tplower_side(arch: Arch, mesh: Any, ids: torch.Tensor, experts: str = "tp",
                  vocab_size: int | None = None, count: bool = False) -> Outcome:
    from ..nn.parallelize import parallelize

    ref = tiny_model(arch, vocab_size)
    tp = parallelize(copy.deepcopy(ref), mesh, "auto", experts=experts)
    return compare_training(tp, ref, ids, count=count)


def _hf_side(folder: str, ids: torch.Tensor, world: int, experts: str = "tp") -> Outcome:
    from transformers import AutoModelForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = eval_logits(ref, ids)
    config = (DistributedConfig(tp_size=world, tp_plan="auto", ep_size=world) if experts == "ep"
              else DistributedConfig(tp_size=world, tp_plan="auto"))
    tp = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, distributed_config=config)
    return compare_logits(eval_logits(tp.eval(), ids), want)


def _rank_body(rank: int, world: int, archs: list[Arch], folders: dict[str, str], with_hf: bool,
               vocab_size: int | None = None, with_derive: bool = False,
               with_context: bool | Sequence[str] = False) -> list[tuple[Outcome, ...]]:
    """On every rank: each architecture's tplower and transformers outcomes (TP, EP), then derive's and context
    parallelism's, in order."""
    from torch.distributed.device_mesh import init_device_mesh

    # transformers' DistributedConfig reads the launcher's variables; the process group is already up
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    cp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)) if with_context else None
    ids = input_ids()
    out: list[tuple[Outcome, ...]] = []
    with quiet_transformers():
        for arch in archs:
            row = []
            for experts in ("tp", "ep"):
                if experts == "ep" and not has_ep_plan(arch):
                    row += [Outcome("n/a", detail="no ep_plan")] * 2
                    continue
                count = with_derive and experts == "tp"  # the shipped plan's bytes, for the derive column
                row.append(guarded(functools.partial(_tplower_side, arch, mesh, ids, experts, vocab_size, count)))
                folder = folders.get(arch.model_type)
                row.append(guarded(functools.partial(_hf_side, folder, ids, world, experts))
                           if with_hf and folder else Outcome("n/a", detail="transformers' side not run"))
            row.append(guarded(functools.partial(derive_side, arch, mesh, ids, vocab_size)) if with_derive
                       else Outcome("n/a", detail="derive not run"))
            cp = cp_mesh is not None and (with_context is True or (
                not isinstance(with_context, bool) and arch.model_type in with_context))
            row.append(guarded(functools.partial(context_side, arch, cp_mesh, ids, vocab_size)) if cp
                       else Outcome("n/a", detail="context parallelism not run"))
            out.append(tuple(row))
    return out


def run_table(model_types: Sequence[str] | None = None, *, with_hf: bool = True, world: int = 2,
              timeout: float = 1800.0, vocab_size: int | None = None, with_derive: bool = False,
              with_context: bool | Sequence[str] = False) -> list[Row]:
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
        with_derive: also run ``"derive"`` (:mod:`tplower.run.hf_derive`)
            and count the bytes of it and of the shipped plan's TP step.
        with_context: also run context parallelism at cp = ``world``, both
            modes (:mod:`tplower.run.hf_context`), for every architecture
            (``True``) or those of the given model types.

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
                broken[arch.model_type] = Outcome("error", detail=f"tiny model: {describe(exc)}")
        runnable = [a for a in archs if a.model_type not in broken]
        results = run_processes(world, _rank_body, runnable, folders, with_hf, vocab_size, with_derive,
                                with_context, timeout=timeout, pg_timeout=min(timeout, 120.0))
    outcomes = {a.model_type: tuple(merge([r[i][side] for r in results]) for side in range(6))
                for i, a in enumerate(runnable)}
    return [Row(a, *outcomes[a.model_type]) if a.model_type in outcomes
            else Row(a, broken[a.model_type], broken[a.model_type]) for a in archs]


# ---------------------------------------------------------------------------------------------- report

def counts(rows: Sequence[Row]) -> dict[str, dict[str, int]]:
    """How many architectures each side passes, fails, refuses or errors on (EP sides: MoE models only; derive:
    where it ran)."""
    out: dict[str, dict[str, int]] = {"tplower": {}, "transformers": {}, "tplower EP": {}, "transformers EP": {}}
    for row in rows:
        for side, outcome in (("tplower", row.tplower), ("transformers", row.hf), ("tplower EP", row.tplower_ep),
                              ("transformers EP", row.hf_ep), ("tplower derive", row.derive),
                              ("tplower cp", row.context)):
            if outcome.status != "n/a" or side in ("tplower", "transformers"):
                per = out.setdefault(side, {})
                per[outcome.status] = per.get(outcome.status, 0) + 1
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
    """The README table: architecture | tplower | transformers TP | EP both | (derive) | note, then the counts
    (and, with the derive column, its bytes against the shipped plan's)."""
    derived = any(r.derive.status != "n/a" for r in rows)
    context = any(r.context.status != "n/a" for r in rows)
    lines = ["| architecture | tplower | transformers TP | tplower EP | transformers EP | "
             + ("tplower derive | " if derived else "") + ("tplower cp | " if context else "") + "note |",
             "|---|---|---|---|---|---|" + "---|" * derived + "---|" * context]
    for row in rows:
        arch = f"`{row.arch.model_type}` ({row.arch.causal_lm})"
        mine = (f"{derive_cell(row.derive, row.tplower)} | " if derived else "") + \
            (f"{row.context.cell()} | " if context else "")
        lines.append(f"| {arch} | {row.tplower.cell()} | {row.hf.cell()} | {row.tplower_ep.cell()} | "
                     f"{row.hf_ep.cell()} | {mine}{_cell(row.note())} |")
    lines.append("")
    for side, per_status in counts(rows).items():
        lines.append(f"{side}: " + ", ".join(count(n, status) if status == "error" else f"{n} {status}"
                                             for status, n in sorted(per_status.items())) + "  ")
    if derived:
        b = byte_counts((r.derive, r.tplower) for r in rows)
        ratio = f"{b['derived_bytes'] / b['shipped_bytes']:.2f}" if b["shipped_bytes"] else "n/a"
        lines.append(f"derive bytes per step against the shipped plan, where both pass: {b['fewer']} fewer, "
                     f"{b['same']} the same, {b['more']} more; {b['derived_bytes']:,} against "
                     f"{b['shipped_bytes']:,} bytes in all ({ratio}x)  ")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tplower.run.hf_table [--only a,b] [--no-hf] [--no-derive] [--markdown] [--json FILE]``; 1 if
    :func:`gaps`, or a context-parallel row beyond the decoders is not as expected."""
    parser = argparse.ArgumentParser(prog="python -m tplower.run.hf_table",
                                     description="tplower's and transformers' TP on every HF decoder, tiny, at tp=2")
    parser.add_argument("--only", default="", help="comma list of model_types (default: every architecture)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' own TP")
    parser.add_argument("--no-derive", action="store_true", help="skip the derived plan's column (and byte counts)")
    parser.add_argument("--no-context", action="store_true",
                        help="skip the context-parallel column (cp=2, both modes) and its rows beyond the decoders "
                             "(those run without --only: rope types, encoders, GPT-2, refusals)")
    parser.add_argument("--markdown", action="store_true", help="print the README table")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON to this file")
    parser.add_argument("--vocab", type=int, default=None,
                        help="every tiny model's vocabulary size (default 128; e.g. 129, which no tp divides)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = run_table([m for m in args.only.split(",") if m] or None, with_hf=not args.no_hf, vocab_size=args.vocab,
                     with_derive=not args.no_derive, with_context=not args.no_context)
    beyond = None if args.no_context or args.only else run_rows()  # the cp rows beyond the decoders (all of them)
    seconds = time.perf_counter() - start
    if args.markdown:
        print(markdown(rows))
        if beyond is not None:
            print(f"\n{context_markdown(beyond)}")
    else:
        for row in rows:
            print(f"{row.arch.model_type:24} {row.tplower.cell():18} {row.hf.cell():18} {row.tplower_ep.cell():18} "
                  f"{row.hf_ep.cell():18} {derive_cell(row.derive, row.tplower):18} {row.context.cell():18} "
                  f"{row.note()}")
    if beyond is not None and not args.markdown:
        print("\n" + "\n".join(f"{name:32} {o.cell():18} {o.detail}" for name, o in beyond.items()))
    print(f"\n{len(rows)} architectures in {seconds:.0f} s", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    missing = gaps(rows, allow_by_design=False)
    for row in missing:
        print(f"tplower misses {row.arch.model_type}, which transformers passes: {row.note()}", file=sys.stderr)
    return 1 if missing or (beyond is not None and context_totals(beyond)["wrong"]) else 0


if __name__ == "__main__":
    sys.exit(main())
