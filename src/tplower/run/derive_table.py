"""Encoder and decoder families that ship no ``tp_plan``, under ``parallelize(model, mesh, "derive")`` at tp=2.

Each family is a tiny random model (hidden 64, 2 layers, 4 heads, float32,
``eval()``) built from its transformers config; :func:`run_derived` runs them
all on one spawn of gloo ranks and compares with one process, by
:func:`tplower.run.hf_table.compare_training`: the output (``last_hidden_state``)
and, after one backward of its mean square, every parameter's gradient and
the replicated gradients' agreement across ranks, within
:data:`~tplower.run.hf_table.TOL`. A row also says how many modules the
derived plan shards (a plan that shards nothing passes trivially).

``python -m tplower.run.derive_table [--only bert,t5]`` prints the table.
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .compare import Outcome, compare_training, guarded, merge
from .quiet import quiet_transformers

__all__ = ["FAMILIES", "DerivedRow", "main", "run_derived", "tiny_family"]

_H, _L, _A, _I, _V = 64, 2, 4, 128, 128
BATCH, SEQ, SEED = 2, 8, 0

#: family -> (config class, model class, config fields)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bert": ("BertConfig", "BertModel", {}),
    "roberta": ("RobertaConfig", "RobertaModel", {}),
    "electra": ("ElectraConfig", "ElectraModel", {"embedding_size": _H}),
    "distilbert": ("DistilBertConfig", "DistilBertModel", {"dim": _H, "n_layers": _L, "n_heads": _A,
                                                           "hidden_dim": _I}),
    "gpt2": ("GPT2Config", "GPT2Model", {"n_embd": _H, "n_layer": _L, "n_head": _A, "bos_token_id": 0,
                                         "eos_token_id": 0}),
    "opt": ("OPTConfig", "OPTModel", {"ffn_dim": _I, "word_embed_proj_dim": _H, "pad_token_id": 1}),
    "bloom": ("BloomConfig", "BloomModel", {"n_layer": _L, "n_head": _A}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXModel", {}),
    "vit": ("ViTConfig", "ViTModel", {"image_size": 8, "patch_size": 4}),
    "whisper_encoder": ("WhisperConfig", "WhisperEncoder", {"d_model": _H, "encoder_layers": _L,
                                                            "encoder_attention_heads": _A, "encoder_ffn_dim": _I,
                                                            "num_mel_bins": 8, "max_source_positions": SEQ,
                                                            "pad_token_id": 0, "decoder_start_token_id": 0}),
    "t5_encoder": ("T5Config", "T5EncoderModel", {"d_model": _H, "num_layers": _L, "num_heads": _A, "d_ff": _I,
                                                  "d_kv": _H // _A}),
}


def tiny_family(family: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The tiny random model of ``family`` (weights seeded, float32, ``eval()``) and its fixed input."""
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    fields = {"hidden_size": _H, "num_hidden_layers": _L, "num_attention_heads": _A, "intermediate_size": _I,
              "vocab_size": _V, **extra}
    config = getattr(transformers, config_name)(**fields)
    model_class: Any = getattr(transformers, model_name, None)
    if model_class is None:  # the encoder alone is not exported at the top level
        from transformers.models.whisper import modeling_whisper

        model_class = getattr(modeling_whisper, model_name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model: nn.Module = model_class(config)
        gen = torch.Generator().manual_seed(SEED + 1)
        if family == "vit":
            inputs = {"pixel_values": torch.randn(BATCH, 3, 8, 8, generator=gen)}
        elif family == "whisper_encoder":  # the encoder halves the frames: 2 * max_source_positions in
            inputs = {"input_features": torch.randn(BATCH, 8, 2 * SEQ, generator=gen)}
        else:
            inputs = {"input_ids": torch.randint(2, _V, (BATCH, SEQ), generator=gen)}
    return model.to(torch.float32).eval(), inputs


def _step(inputs: dict[str, torch.Tensor], model: nn.Module) -> torch.Tensor:
    out: torch.Tensor = model(**inputs).last_hidden_state
    out.float().square().mean().backward()
    return out.detach()


@dataclass(frozen=True)
class DerivedRow:
    """One family: its outcome at tp=2 under the derived plan, and how many modules that plan shards."""

    family: str
    outcome: Outcome
    sharded: int


def _one(family: str, mesh: Any) -> tuple[Outcome, int]:
    from ..nn.parallelize import parallelize
    from ..plans.derive import derive_plan

    ref, inputs = tiny_family(family)
    plan = derive_plan(ref).plan
    sharded = sum(1 for v in plan.values() if isinstance(v, str) or "style" in v or "params" in v)
    tp = parallelize(copy.deepcopy(ref), mesh, plan)
    return compare_training(tp, ref, None, functools.partial(_step, inputs)), sharded


def _rank_body(rank: int, world: int, families: list[str]) -> list[tuple[Outcome, int]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = []
    with quiet_transformers():
        for family in families:
            counted: list[int] = [0]

            def run(family: str = family, counted: list[int] = counted) -> Outcome:
                outcome, counted[0] = _one(family, mesh)
                return outcome

            out.append((guarded(run), counted[0]))
    return out


def run_derived(families: Sequence[str] | None = None, *, world: int = 2, timeout: float = 600.0
                ) -> list[DerivedRow]:
    """Every family (or ``families``) under its derived plan on ``world`` spawned gloo ranks, one spawn for all.

    Raises:
        KeyError: an unknown family (see :data:`FAMILIES`).
        tplower.testing.RankFailure: a rank died or the run outlived ``timeout``.
    """
    from ..testing import run_processes

    names = list(families) if families else list(FAMILIES)
    for name in names:
        if name not in FAMILIES:
            raise KeyError(f"family {name!r} is not one of {', '.join(FAMILIES)}")
    results = run_processes(world, _rank_body, names, timeout=timeout, pg_timeout=min(timeout, 120.0))
    return [DerivedRow(name, merge([r[i][0] for r in results]), results[0][i][1]) for i, name in enumerate(names)]


def main(argv: Sequence[str] | None = None, print_: Callable[[str], None] = print) -> int:
    """``python -m tplower.run.derive_table [--only a,b]``; 1 if a family does not pass."""
    parser = argparse.ArgumentParser(prog="python -m tplower.run.derive_table",
                                     description="families without a tp_plan, derived, at tp=2 against one process")
    parser.add_argument("--only", default="", help=f"comma list of families (default all: {', '.join(FAMILIES)})")
    args = parser.parse_args(argv)
    rows = run_derived([f for f in args.only.split(",") if f] or None)
    for row in rows:
        print_(f"{row.family:16} {row.outcome.cell():34} sharded modules: {row.sharded:3} {row.outcome.detail}")
    passed = sum(r.outcome.status == "pass" for r in rows)
    print_(f"\n{passed} of {len(rows)} families pass")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
