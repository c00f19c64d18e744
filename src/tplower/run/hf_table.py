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
  :data:`TOL` (float32).
* transformers' own TP: the same weights (saved by the parent with
  ``save_pretrained``) loaded with ``DistributedConfig(tp_size=world,
  tp_plan="auto")`` (needs ``accelerate``), against the same checkpoint
  loaded in one process.

``python -m tplower.run.hf_table --markdown`` prints the README's table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ..core.errors import TPLowerError

__all__ = ["TOL", "Arch", "Outcome", "Row", "architectures", "by_design", "counts", "gaps", "input_ids", "main",
           "markdown", "run_table", "tiny_config", "tiny_model"]

#: largest absolute logit difference from the one-process model that counts as equal (float32)
TOL = 1e-5
#: the fixed input is ``(BATCH, SEQ)`` token ids drawn from ``INPUT_SEED``; weights come from ``WEIGHT_SEED``
BATCH, SEQ, INPUT_SEED, WEIGHT_SEED = 2, 8, 3, 0

Status = Literal["pass", "fail", "refused", "error", "n/a"]


@dataclass(frozen=True)
class Arch:
    """One decoder architecture: its ``model_type``, config class and causal-LM class name."""

    model_type: str
    config_class: str
    causal_lm: str


@dataclass(frozen=True)
class Outcome:
    """One side's result on one architecture.

    ``pass``/``fail``: logits within / beyond :data:`TOL` (``max_diff`` set);
    ``refused``: a :class:`~tplower.TPLowerError` (``detail`` its message);
    ``error``: any other exception (``detail``: type and first line);
    ``n/a``: not run (``detail`` says why).
    """

    status: Status
    max_diff: float | None = None
    detail: str = ""

    def cell(self) -> str:
        """The table cell: the status, with the max diff for pass/fail."""
        return f"{self.status} ({self.max_diff:.1e})" if self.max_diff is not None else self.status


@dataclass(frozen=True)
class Row:
    """One architecture's line of the table."""

    arch: Arch
    tplower: Outcome
    hf: Outcome

    def note(self) -> str:
        """Why a side did not pass (tplower's reason, then transformers'), and any remark on the architecture."""
        mt = self.arch.model_type
        parts = [_KNOWN.get((mt, "tplower")) or _short(self.tplower)] if self.tplower.status != "pass" else []
        if self.hf.status != "pass":
            parts.append(f"transformers: {_KNOWN.get((mt, 'transformers')) or _short(self.hf)}")
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


# ---------------------------------------------------------------------------------------------- configs

# Shared sizes, set where the config class has the attribute. Heads, kv heads, experts, vocab and every
# intermediate size are even, so each sharded dim divides over tp=2.
_SIZES: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128,
    "n_inner": 128, "rotary_dim": 8, "unpadded_vocab_size": 128, "vocab_size_per_layer_input": 128,
    "hidden_size_per_layer_input": 16, "swa_head_dim": 16, "num_layers": 2, "ffn_hidden_size": 128,
    "expert_ffn_hidden_size": 32, "moe_topk": 2, "zero_expert_num": 2,
}
# Per-architecture overrides of the above (applied last).
_OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "gemma4_text": {"global_head_dim": 32},
    "gemma4_unified_text": {"global_head_dim": 32},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [4, 2, 2]}}},
    "phi4_multimodal": {
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                          "image_size": 28, "crop_size": 28, "image_token_id": 120},
        "audio_config": {"hidden_size": 32, "intermediate_size": 64, "num_blocks": 1, "num_attention_heads": 2,
                         "ext_pw_out_channel": 32, "depthwise_separable_out_channel": 32, "nemo_conv_channels": 32,
                         "audio_token_id": 121}},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 4,
                       "indexer_compress_ratio": 2},
}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")


def architectures(model_types: Sequence[str] | None = None) -> list[Arch]:
    """The causal-LM architectures whose config defines ``base_model_tp_plan``, by ``model_type``.

    Args:
        model_types: keep only these (in this order); unknown ones raise.

    Raises:
        TPLowerError: a name in ``model_types`` that is not such an architecture.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found: dict[str, Arch] = {}
    for model_type, causal_lm in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if model_type not in CONFIG_MAPPING:
            continue
        config_class = CONFIG_MAPPING[model_type]
        if getattr(config_class, "base_model_tp_plan", None):
            found[model_type] = Arch(model_type, config_class.__name__, str(causal_lm))
    if model_types is None:
        return list(found.values())
    unknown = [m for m in model_types if m not in found]
    if unknown:
        raise TPLowerError(f"model_types: {unknown} are not causal-LM architectures with a base_model_tp_plan; "
                           f"choose from {', '.join(found)}")
    return [found[m] for m in model_types]


def _fields(config_class: Any) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else {}


def _tiny_kwargs(config_class: Any, model_type: str) -> dict[str, Any]:
    """Constructor keywords: ``_SIZES`` for the class's own fields, per-layer lists cut to two, small token ids.

    Only dataclass fields are passed (a derived attribute such as MLA's ``head_dim`` is left to the
    class's ``__post_init__``); a per-layer list that the class gives by default (a field with a
    default factory) keeps its first and last entries; a list its ``__post_init__`` derives is derived
    again for two layers.
    """
    fields = _fields(config_class)
    defaults = config_class()
    layers = fields["num_hidden_layers"].default if "num_hidden_layers" in fields else None
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        value: Any = getattr(defaults, name, None) if field.default is dataclasses.MISSING else field.default
        per_layer = isinstance(value, list) and isinstance(layers, int) and layers > 2 and len(value) == layers
        if name in _SIZES:
            kwargs[name] = [_SIZES[name]] * 2 if per_layer else _SIZES[name]
        elif per_layer and field.default is dataclasses.MISSING:
            kwargs[name] = [value[0], value[-1]]  # two layers, keeping the first and the last kind
    if "qk_rope_head_dim" in fields and "kv_lora_rank" in fields:  # MLA: rope on its own slice, one kv head a head
        kwargs["head_dim"] = _SIZES["qk_rope_head_dim"]
        kwargs["num_key_value_heads"] = _SIZES["num_attention_heads"]
    vocab = kwargs.get("vocab_size", _SIZES["vocab_size"])
    for offset, name in enumerate(_TOKEN_IDS):
        value = fields[name].default if name in fields else None
        if isinstance(value, int) and value >= vocab:
            kwargs[name] = vocab - 1 - offset
        elif isinstance(value, list) and any(isinstance(v, int) and v >= vocab for v in value):
            kwargs[name] = [vocab - 1 - offset - i for i in range(len(value))]
    sub_configs = getattr(config_class, "sub_configs", {}) or {}
    if "text_config" in sub_configs:
        sub = sub_configs["text_config"]
        kwargs["text_config"] = _tiny_kwargs(sub if isinstance(sub, type) else type(defaults.text_config), model_type)
    kwargs.update(_OVERRIDES.get(model_type, {}))
    return kwargs


def tiny_config(model_type: str) -> Any:
    """A small float32 config of ``model_type``: the class defaults, ``_SIZES`` where they apply, the overrides."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    config = config_class(**_tiny_kwargs(config_class, model_type))
    config.dtype = torch.float32
    return config


def _model_config(model_class: Any, config: Any) -> Any:
    """The config ``model_class`` takes: ``config``, or its ``text_config`` (``llama4`` maps to a text-only class)."""
    wanted: Any = getattr(model_class, "config_class", None)
    if wanted is None or isinstance(config, wanted) or not hasattr(config, "get_text_config"):
        return config
    text: Any = config.get_text_config()
    if not isinstance(text, wanted):
        return config
    text.dtype = torch.float32
    return text


def tiny_model(arch: Arch) -> nn.Module:
    """The causal-LM of ``arch`` on :func:`tiny_config`, random weights from ``WEIGHT_SEED``, float32, ``eval()``."""
    import transformers

    model_class = getattr(transformers, arch.causal_lm)
    config = _model_config(model_class, tiny_config(arch.model_type))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(WEIGHT_SEED)
        model: nn.Module = model_class(config)
    return model.to(torch.float32).eval()


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


def _tplower_side(arch: Arch, mesh: Any, ids: torch.Tensor) -> Outcome:
    from ..nn.parallelize import parallelize

    ref = tiny_model(arch)
    want = _logits(ref, ids)
    return _compare(_logits(parallelize(copy.deepcopy(ref), mesh, "auto"), ids), want)


def _hf_side(folder: str, ids: torch.Tensor, world: int) -> Outcome:
    from transformers import AutoModelForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = _logits(ref, ids)
    tp = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              distributed_config=DistributedConfig(tp_size=world, tp_plan="auto"))
    return _compare(_logits(tp.eval(), ids), want)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _rank_body(rank: int, world: int, archs: list[Arch], folders: dict[str, str],
               with_hf: bool) -> list[tuple[Outcome, Outcome]]:
    """On every rank: each architecture's tplower and transformers outcomes, in order."""
    from torch.distributed.device_mesh import init_device_mesh

    # transformers' DistributedConfig reads the launcher's variables; the process group is already up
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ids = input_ids()
    out: list[tuple[Outcome, Outcome]] = []
    with _quiet():
        for arch in archs:
            mine = _guarded(functools.partial(_tplower_side, arch, mesh, ids))
            folder = folders.get(arch.model_type)
            theirs = (_guarded(functools.partial(_hf_side, folder, ids, world))
                      if with_hf and folder else Outcome("n/a", detail="transformers' TP not run"))
            out.append((mine, theirs))
    return out


def _merge(per_rank: Sequence[Outcome]) -> Outcome:
    """One outcome from every rank's: the first that did not pass, else rank 0's with the largest diff."""
    for outcome in per_rank:
        if outcome.status != "pass":
            return outcome
    return dataclasses.replace(per_rank[0], max_diff=max(o.max_diff or 0.0 for o in per_rank))


def run_table(model_types: Sequence[str] | None = None, *, with_hf: bool = True, world: int = 2,
              timeout: float = 1800.0) -> list[Row]:
    """Run every architecture (or ``model_types``) on ``world`` spawned gloo ranks, one spawn for all.

    Args:
        model_types: a subset of :func:`architectures` (default: all).
        with_hf: also run transformers' own TP (needs ``accelerate``); the
            parent saves each tiny model to a temporary folder for it.
        world: the tp degree (every sharded dim of the tiny configs divides by 2).
        timeout: seconds for the whole run.

    Returns:
        One :class:`Row` per architecture, in :func:`architectures` order;
        a model that cannot be built is a row of ``error`` outcomes.

    Raises:
        tplower.testing.RankFailure: a rank died or the run outlived ``timeout``.
    """
    from ..testing import run_processes

    archs = architectures(model_types)
    broken: dict[str, Outcome] = {}
    with tempfile.TemporaryDirectory(prefix="tplower-hf-") as tmp, _quiet():
        folders: dict[str, str] = {}
        for arch in archs if with_hf else ():  # without transformers' side, a rank reports a build error itself
            try:
                model: Any = tiny_model(arch)
                folder = str(Path(tmp) / arch.model_type)
                model.save_pretrained(folder)
                folders[arch.model_type] = folder
            except Exception as exc:  # a config the generic builder cannot make: its row says why
                broken[arch.model_type] = Outcome("error", detail=f"tiny model: {_describe(exc)}")
        runnable = [a for a in archs if a.model_type not in broken]
        results = run_processes(world, _rank_body, runnable, folders, with_hf, timeout=timeout,
                                pg_timeout=min(timeout, 120.0))
    outcomes = {a.model_type: (_merge([r[i][0] for r in results]), _merge([r[i][1] for r in results]))
                for i, a in enumerate(runnable)}
    return [Row(a, *outcomes[a.model_type]) if a.model_type in outcomes
            else Row(a, broken[a.model_type], broken[a.model_type]) for a in archs]


# ---------------------------------------------------------------------------------------------- report

def counts(rows: Sequence[Row]) -> dict[str, dict[str, int]]:
    """How many architectures each side passes, fails, refuses or errors on."""
    out: dict[str, dict[str, int]] = {"tplower": {}, "transformers": {}}
    for row in rows:
        for side, outcome in (("tplower", row.tplower), ("transformers", row.hf)):
            out[side][outcome.status] = out[side].get(outcome.status, 0) + 1
    return out


def gaps(rows: Sequence[Row], *, allow_by_design: bool = True) -> list[Row]:
    """Rows transformers' TP passes and tplower does not (by default a refusal :func:`by_design` is allowed)."""
    return [r for r in rows if r.hf.status == "pass" and r.tplower.status != "pass"
            and not (allow_by_design and by_design(r.tplower))]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(rows: Sequence[Row]) -> str:
    """The README table: architecture | tplower | transformers TP | note, then the counts."""
    lines = ["| architecture | tplower | transformers TP | note |", "|---|---|---|---|"]
    for row in rows:
        arch = f"`{row.arch.model_type}` ({row.arch.causal_lm})"
        lines.append(f"| {arch} | {row.tplower.cell()} | {row.hf.cell()} | {_cell(row.note())} |")
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
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = run_table([m for m in args.only.split(",") if m] or None, with_hf=not args.no_hf)
    seconds = time.perf_counter() - start
    if args.markdown:
        print(markdown(rows))
    else:
        for row in rows:
            print(f"{row.arch.model_type:24} {row.tplower.cell():24} {row.hf.cell():24} {row.note()}")
    print(f"\n{len(rows)} architectures in {seconds:.0f} s", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    missing = gaps(rows)
    for row in missing:
        print(f"tplower misses {row.arch.model_type}, which transformers' TP passes: {row.note()}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
