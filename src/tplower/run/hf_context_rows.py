"""The context-parallel column beyond the table's decoders: rope types, encoders, absolute positions, refusals.

The architecture table runs every causal LM with a shipped tensor-parallel plan
(:mod:`tplower.run.hf_context`) on 8 tokens. The rules one process applies to the
whole sequence need more: rope whose frequencies follow the length switches at
32 positions here, so these rows run 40 tokens with row 1 padded, each
architecture tiny and random (seed 0), in both modes against one process
(:func:`~tplower.run.hf_context.compare_context`). :data:`ROWS` names each row's
model, its batch, what it checks and what it must give: ``pass`` (loss, output
and every gradient within 1e-5 in both modes) or ``refused`` (a
:class:`~tplower.TPLowerError` naming the cause, on every rank).

``python -m tplower.run.hf_context_rows`` prints them as markdown with their totals.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.support.errors import TPLowerError
from .compare import Outcome, guarded, merge
from .hf_configs import tiny_config
from .hf_context import both_modes

__all__ = ["ROWS", "ContextRow", "main", "markdown", "run_rows"]

#: the rows' length: past the 32 positions where the length-dependent rope types switch
LENGTH = 40
_SWITCH = 32
_FACTORS = 8  # per-frequency rope factors: half the tiny head_dim 16


@dataclass(frozen=True)
class ContextRow:
    """One row: ``build()`` the model, run the ``batch`` kind (``causal``: next-token labels; ``masked``: every 4th
    token scored against itself; ``tokens``: a class per token; ``hidden``: the last hidden state), expect
    ``expect``."""

    what: str
    build: Callable[[], nn.Module]
    batch: str
    expect: str = "pass"


def _llama(rope: dict[str, Any], model_type: str = "llama", **over: Any) -> Callable[[], nn.Module]:
    """A tiny causal LM of ``model_type`` with ``rope`` as its ``rope_parameters`` (with ``rope_theta`` 10000, unless
    ``rope`` holds one dict per layer type) and 32 positions unless ``over`` says."""
    def build() -> nn.Module:
        from transformers import AutoModelForCausalLM

        config = tiny_config(model_type)
        per_type = all(isinstance(v, dict) for v in rope.values())
        parameters = rope if per_type else {"rope_theta": 10000.0, **rope}
        for key, value in {"max_position_embeddings": _SWITCH, **over, "rope_parameters": parameters}.items():
            setattr(config, key, value)
        torch.manual_seed(0)
        model: nn.Module = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        return model.float()
    return build


def _model(cls: str, config: str, **kw: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        torch.manual_seed(0)
        made: nn.Module = getattr(transformers, cls)(getattr(transformers, config)(**kw))
        return made.float().eval()
    return build


_ENCODER = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 64, "max_position_embeddings": 64}
_MODERNBERT = {**_ENCODER, "num_hidden_layers": 3, "local_attention": 8, "global_attn_every_n_layers": 2,
               "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "sep_token_id": 3, "cls_token_id": 4}
_SEQ2SEQ = {"vocab_size": 128, "d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 4,
            "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64}
_LONG = {"original_max_position_embeddings": _SWITCH}
ROWS: dict[str, ContextRow] = {
    "llama-rope-default": ContextRow("rope `default`", _llama({"rope_type": "default"}), "causal"),
    "llama-rope-linear": ContextRow("rope `linear` (factor 2)", _llama({"rope_type": "linear", "factor": 2.0}),
                                    "causal"),
    "llama-rope-dynamic": ContextRow("rope `dynamic` (NTK base from the length)",
                                     _llama({"rope_type": "dynamic", "factor": 2.0}), "causal"),
    "llama-rope-yarn": ContextRow("rope `yarn` (attention_scaling)",
                                  _llama({"rope_type": "yarn", "factor": 2.0, **_LONG}), "causal"),
    "llama-rope-longrope": ContextRow(
        "rope `longrope` (factors from the length, attention_scaling)",
        _llama({"rope_type": "longrope", "short_factor": [1.0] * _FACTORS, "long_factor": [4.0] * _FACTORS, **_LONG},
               max_position_embeddings=128), "causal"),
    "llama-rope-llama3": ContextRow("rope `llama3`", _llama({"rope_type": "llama3", "factor": 8.0,
                                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0, **_LONG},
                                                           max_position_embeddings=128), "causal"),
    "gemma3-rope-dynamic-per-layer-type": ContextRow(
        "rope `dynamic` on the full layers only (one `inv_freq` per layer type)",
        _llama({"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}, "gemma3_text",
               layer_types=["sliding_attention", "full_attention"]), "causal"),
    "phi3-longrope": ContextRow("Phi-3 `longrope`", _llama({"rope_type": "longrope", "short_factor": [1.0] * _FACTORS,
                                                           "long_factor": [4.0] * _FACTORS, **_LONG}, "phi3",
                                                          max_position_embeddings=128, **_LONG), "causal"),
    "qwen2_vl-mrope": ContextRow("rope `mrope` sections (text only: positions repeated per section)",
                                 _model("Qwen2VLForConditionalGeneration", "Qwen2VLConfig", text_config={
                                     "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
                                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                     "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                         "rope_theta": 10000.0}},
                                     vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2}),
                                 "causal"),
    "gpt2": ContextRow("absolute position embeddings", _model("GPT2LMHeadModel", "GPT2Config", vocab_size=128,
                                                              n_embd=32, n_layer=2, n_head=4, n_positions=64),
                       "causal"),
    "bert-mlm": ContextRow("masked LM, token type ids", _model("BertForMaskedLM", "BertConfig", **_ENCODER), "masked"),
    "roberta-mlm": ContextRow("masked LM, positions numbered from the pad token",
                              _model("RobertaForMaskedLM", "RobertaConfig", **_ENCODER), "masked"),
    "modernbert-mlm": ContextRow("masked LM, bidirectional sliding window",
                                 _model("ModernBertForMaskedLM", "ModernBertConfig", **_MODERNBERT), "masked"),
    "bert-token-classification": ContextRow("token classification",
                                            _model("BertForTokenClassification", "BertConfig", **_ENCODER), "tokens"),
    "modernbert-token-classification": ContextRow(
        "token classification, sliding window", _model("ModernBertForTokenClassification", "ModernBertConfig",
                                                       **_MODERNBERT), "tokens"),
    "gemma3-bidirectional": ContextRow(
        "bidirectional sliding window (Gemma 3's own rule)",
        _model("Gemma3TextModel", "Gemma3TextConfig", **{**_ENCODER, "num_key_value_heads": 2, "head_dim": 8,
                                                         "sliding_window": 6, "use_bidirectional_attention": True,
                                                         "layer_types": ["sliding_attention", "full_attention"]}),
        "hidden"),
    "opt-padded": ContextRow("positions numbered from the padding mask, no position_ids given",
                             _model("OPTForCausalLM", "OPTConfig", **{**_ENCODER, "ffn_dim": 64,
                                                                      "word_embed_proj_dim": 32}), "causal",
                             "refused"),
    "bert-sequence-classification": ContextRow("a CLS head (sequence-level pooling)",
                                               _model("BertForSequenceClassification", "BertConfig", **_ENCODER),
                                               "tokens", "refused"),
    "bart": ContextRow("encoder-decoder (cross-attention)",
                       _model("BartForConditionalGeneration", "BartConfig", **_SEQ2SEQ), "causal", "refused"),
    "t5": ContextRow("encoder-decoder (cross-attention, relative position buckets)",
                     _model("T5ForConditionalGeneration", "T5Config", vocab_size=128, d_model=32, d_kv=8, d_ff=64,
                            num_layers=1, num_heads=4), "causal", "refused"),
    "bloom": ContextRow("ALiBi", _model("BloomForCausalLM", "BloomConfig", vocab_size=128, hidden_size=32, n_layer=2,
                                        n_head=4), "causal", "refused"),
}


def _batch(kind: str, vocab: int = 100) -> tuple[dict[str, torch.Tensor], bool, str]:
    """The whole batch of a row's kind: ``(batch, shift_labels, output compared)``; row 1 padded by 3 (left for
    causal LMs, right for encoders)."""
    ids = torch.randint(5, vocab, (2, LENGTH), generator=torch.Generator().manual_seed(LENGTH))
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    if kind == "causal":
        mask[1, :3] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}, True, "logits"
    mask[1, -3:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    if kind == "masked":
        batch["labels"] = torch.where((torch.arange(LENGTH) % 4 == 0) & (mask == 1), ids, -100)
    elif kind == "tokens":
        batch["labels"] = (ids % 2).masked_fill(mask == 0, -100)
    return batch, False, "last_hidden_state" if kind == "hidden" else "logits"


def run_row(name: str, mesh: Any) -> Outcome:
    """Row ``name`` on this rank, both modes (a refusal or an error is the row's outcome)."""
    row = ROWS[name]
    batch, shift, out = _batch(row.batch)
    return guarded(lambda: both_modes(row.build(), mesh, batch, shift_labels=shift, out=out))


def _rank_body(rank: int, world: int, names: list[str]) -> list[Outcome]:
    from torch.distributed.device_mesh import init_device_mesh

    from .quiet import quiet_transformers

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    with quiet_transformers():
        return [run_row(name, mesh) for name in names]


def run_rows(names: Sequence[str] | None = None, *, world: int = 2, timeout: float = 900.0) -> dict[str, Outcome]:
    """Every row of :data:`ROWS` (or ``names``) on ``world`` spawned gloo ranks, one spawn for all.

    Raises:
        TPLowerError: a name that is not a row.
        tplower.testing.RankFailure: a rank died or the run outlived ``timeout``.
    """
    from ..testing import run_processes

    chosen = list(names or ROWS)
    unknown = [n for n in chosen if n not in ROWS]
    if unknown:
        raise TPLowerError(f"run_rows: unknown rows {unknown}; the rows are {list(ROWS)}")
    results = run_processes(world, _rank_body, chosen, timeout=timeout, pg_timeout=min(timeout, 120.0))
    return {name: merge([r[i] for r in results]) for i, name in enumerate(chosen)}


def totals(outcomes: dict[str, Outcome]) -> dict[str, int]:
    """How many rows pass, are refused, or give what their row does not expect (``wrong``)."""
    out = {"pass": 0, "refused": 0, "wrong": 0}
    for name, outcome in outcomes.items():
        out[outcome.status if outcome.status == ROWS[name].expect else "wrong"] += 1
    return out


def markdown(outcomes: dict[str, Outcome]) -> str:
    """The rows as a markdown table (row | checks | cp, both modes | why refused), then the totals."""
    lines = ["| row | checks | cp=2, both modes | refused because |", "|---|---|---|---|"]
    for name, outcome in outcomes.items():
        why = outcome.detail.replace("|", "\\|") if outcome.status != "pass" else ""
        lines.append(f"| `{name}` | {ROWS[name].what} | {outcome.cell()} | {why} |")
    t = totals(outcomes)
    lines += ["", f"{len(outcomes)} rows: {t['pass']} match one process, {t['refused']} refused, {t['wrong']} "
                  "otherwise  "]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tplower.run.hf_context_rows [--only a,b]``: the rows' markdown; 1 if a row is not as expected."""
    parser = argparse.ArgumentParser(prog="python -m tplower.run.hf_context_rows",
                                     description="context parallelism beyond the decoders, cp=2, both modes")
    parser.add_argument("--only", default="", help=f"comma list of rows (default: all {len(ROWS)})")
    args = parser.parse_args(argv)
    outcomes = run_rows([n for n in args.only.split(",") if n] or None)
    print(markdown(outcomes))
    return 1 if totals(outcomes)["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
