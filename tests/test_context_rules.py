"""Rules one process applies to the whole sequence, under context parallelism: 2 threaded ranks against one process.

Each case is a model-specific rule that reads more than a rank's tokens: rope
frequencies picked from the sequence length (Llama ``dynamic``, Phi-3
``longrope``, at 40 tokens past a switch at 32), the loss's divisor given for a
whole gradient-accumulation step, a bidirectional sliding window (Gemma 3 as an
encoder; ModernBERT's ``sliding_window + 1``), labels one per token (a masked LM,
a token classifier), an encoder-decoder model, and what the audit of such rules
found: positions a model numbers itself (RoBERTa from the pad token, OPT from the
padding mask), a pooled first token, a sequence-level head, encoder states. Each gives one process's loss,
output and every gradient (within 1e-5), or a refusal on every rank that issued
no collective.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from context_cases import _grads, batch, tiny
from torch.distributed.device_mesh import init_device_mesh

import tplower
from tplower.core.lower.traffic import CollectiveTraffic
from tplower.core.support.errors import TPLowerError
from tplower.run.hf_context import compare_context
from tplower.testing import run_threaded

TOL = 1e-5
IDS = torch.randint(5, 100, (2, 29), generator=torch.Generator().manual_seed(0))
MASK = torch.ones(2, 29, dtype=torch.long)
MASK[1, 24:] = 0  # row 1 padded at its end
SEGMENTS = (torch.arange(29) >= 13).long().expand(2, 29)  # token type 1 from token 13 on
MLM = torch.where(torch.arange(29) % 4 == 0, IDS, -100)  # every 4th token masked and scored against itself


def _transformers(cls: str, config: str, **kw: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import transformers

        torch.manual_seed(0)
        return getattr(transformers, cls)(getattr(transformers, config)(**kw)).float().eval()
    return build


def _rope(kind: str, rope: dict[str, Any], **over: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        model = tiny(kind, "sdpa")
        config = type(model.config)(**{**model.config.to_dict(), **over, "rope_parameters": rope})
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    return build


def _gemma3_rope() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from tplower.run.hf_configs import tiny_config

    config = tiny_config("gemma3_text")
    config.max_position_embeddings, config.layer_types = 32, ["sliding_attention", "full_attention"]
    config.rope_parameters = {"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    torch.manual_seed(0)
    model: torch.nn.Module = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.float()


_BERT = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 64, "type_vocab_size": 2, "max_position_embeddings": 64}
_MODERNBERT = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
               "num_attention_heads": 4, "local_attention": 8, "global_attn_every_n_layers": 2, "pad_token_id": 0,
               "bos_token_id": 1, "eos_token_id": 2, "sep_token_id": 3, "cls_token_id": 4}
_GEMMA3 = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 6,
           "use_bidirectional_attention": True, "layer_types": ["sliding_attention", "full_attention"]}
_FACTORS = 8  # longrope's per-frequency factors: half the tiny configs' head_dim 16


@dataclass(frozen=True)
class Rule:
    """One comparison: ``build`` a model, run ``batch`` whole in one process and split over cp."""

    build: Callable[[], torch.nn.Module]
    batch: dict[str, torch.Tensor]
    mode: str = "ulysses"
    out: str = "logits"
    shift_labels: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


WHOLE = {"input_ids": torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(4))}
RULES = {
    # item 1: 40 tokens, the switch at 32: rank 1 of the head-tail cut holds positions 10-29 only
    "rope-dynamic": Rule(_rope("llama", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                               max_position_embeddings=32), {**WHOLE, "labels": WHOLE["input_ids"]}),
    "rope-longrope": Rule(_rope("llama", {"rope_type": "longrope", "rope_theta": 10000.0,
                                          "short_factor": [1.0] * _FACTORS, "long_factor": [4.0] * _FACTORS,
                                          "original_max_position_embeddings": 32},
                                max_position_embeddings=128), {**WHOLE, "labels": WHOLE["input_ids"]}, "allgather"),
    # rope parameters per layer type: Gemma 3's rotary module keeps one inv_freq per type, the full layers' dynamic
    "rope-dynamic-per-layer-type": Rule(_gemma3_rope, {**WHOLE, "labels": WHOLE["input_ids"]}, "allgather"),
    # item 3: transformers stores sliding_window 6 as 4 and Gemma 3 masks |q - k| < 4
    "gemma3-bidirectional-ulysses": Rule(_transformers("Gemma3TextModel", "Gemma3TextConfig", **_GEMMA3),
                                         {"input_ids": IDS, "attention_mask": MASK}, out="last_hidden_state"),
    "gemma3-bidirectional-allgather": Rule(_transformers("Gemma3TextModel", "Gemma3TextConfig", **_GEMMA3),
                                           {"input_ids": IDS, "attention_mask": MASK}, "allgather",
                                           "last_hidden_state"),
    # item 4 (and ModernBERT's window, local_attention 8, passed to attention as sliding_window + 1)
    "modernbert-mlm": Rule(_transformers("ModernBertForMaskedLM", "ModernBertConfig", **_MODERNBERT),
                           {"input_ids": IDS, "attention_mask": MASK, "labels": MLM}, shift_labels=False),
    # the audit: RoBERTa numbers its tokens from the pad token (its embeddings' own function, run on the whole ids);
    # a base BERT's pooler (the first token) gives no output under cp, its encoder one process's
    "roberta-mlm": Rule(_transformers("RobertaForMaskedLM", "RobertaConfig", **_BERT),
                        {"input_ids": IDS, "attention_mask": MASK, "labels": MLM}, "allgather", shift_labels=False),
    "bert-base-with-pooler": Rule(_transformers("BertModel", "BertConfig", **_BERT),
                                  {"input_ids": IDS, "attention_mask": MASK}, out="last_hidden_state"),
    "bert-token-classification": Rule(_transformers("BertForTokenClassification", "BertConfig", **_BERT),
                                      {"input_ids": IDS, "token_type_ids": SEGMENTS, "labels": IDS % 2}, "allgather",
                                      shift_labels=False),
}


def _accumulated(mesh: Any) -> dict[str, float]:
    """Two micro-batches of one step with the caller's ``num_items_in_batch`` over both (as transformers' Trainer
    passes it): the summed loss and the accumulated gradients, against one process running the same step."""
    ref = tiny("llama", "sdpa")
    model = tplower.parallelize(copy.deepcopy(ref), mesh, None, context="cp")
    micro = [batch("padded", 21), batch("plain", 21)]
    count = torch.tensor(sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro))  # labels shifted by one
    want = sum(ref(**b, num_items_in_batch=count, use_cache=False).loss for b in micro)
    want.backward()
    parts = [tplower.shard_sequence({**b, "num_items_in_batch": count}, mesh) for b in micro]
    got = sum(model(**p).loss for p in parts)
    got.backward()
    return {"loss": float((got - want).detach().abs()), "grad": float((_grads(model) - _grads(ref)).abs().max()),
            "kept": float(all(p["num_items_in_batch"] is count for p in parts))}


def _refused(call: Callable[[], Any]) -> tuple[str, int]:
    """The refusal ``call`` raises and how many collectives it issued first."""
    with CollectiveTraffic() as traffic:
        try:
            call()
        except TPLowerError as e:
            return str(e), sum(traffic.counts.values())
    return "no error", sum(traffic.counts.values())


def _refusals(mesh: Any, models: dict[str, torch.nn.Module]) -> dict[str, tuple[str, int]]:
    def installed(name: str) -> torch.nn.Module:
        return tplower.parallelize(copy.deepcopy(models[name]), mesh, None, context="cp")

    mlm, causal, opt, decoder = (installed(n) for n in ("modernbert-mlm", "rope-dynamic", "opt", "bert-decoder"))
    shifted = tplower.shard_sequence({"input_ids": IDS, "labels": MLM}, mesh)  # shift_labels=True: wrong for MLM
    unshifted = tplower.shard_sequence({"input_ids": IDS, "labels": IDS}, mesh, shift_labels=False)
    padded = tplower.shard_sequence({"input_ids": IDS, "attention_mask": MASK.flip(1)}, mesh)  # no position_ids
    plain = tplower.shard_sequence({"input_ids": IDS}, mesh)
    states = torch.zeros(2, 5, 32)
    return {
        "positions-from-the-mask": _refused(lambda: opt(**padded)),
        "encoder-states": _refused(lambda: decoder(**plain, encoder_hidden_states=states)),
        "encoder-decoder": _refused(lambda: tplower.parallelize(copy.deepcopy(models["bart"]), mesh, None,
                                                                context="cp")),
        "sequence-classification": _refused(lambda: installed("bert-classifier")),
        "mlm-labels-shifted": _refused(lambda: mlm(**shifted)),
        "causal-labels-unshifted": _refused(lambda: causal(**unshifted)),
    }


def _body(rank: int, world: int, models: dict[str, torch.nn.Module]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    out: dict[str, Any] = {name: compare_context(copy.deepcopy(models[name]), mesh, r.batch, r.mode, out=r.out,
                                                 shift_labels=r.shift_labels) for name, r in RULES.items()}
    out["accumulated"] = _accumulated(mesh)
    out["refusals"] = _refusals(mesh, models)
    base = tplower.parallelize(copy.deepcopy(models["bert-base-with-pooler"]), mesh, None, context="cp")
    out["pooled"] = (base(**tplower.shard_sequence({"input_ids": IDS}, mesh)).pooler_output,
                     models["bert-base-with-pooler"](input_ids=IDS).pooler_output.shape)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    models = {name: r.build() for name, r in RULES.items()}  # built once, outside the threads (one generator)
    models["bart"] = _transformers("BartForConditionalGeneration", "BartConfig", vocab_size=128, d_model=32,
                                   encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)()
    models["bert-classifier"] = _transformers("BertForSequenceClassification", "BertConfig", **_BERT)()
    models["opt"] = _transformers("OPTForCausalLM", "OPTConfig", vocab_size=128, hidden_size=32, num_hidden_layers=1,
                                  ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=32)()
    models["bert-decoder"] = _transformers("BertLMHeadModel", "BertConfig", **_BERT, is_decoder=True,
                                           add_cross_attention=True)()
    out: list[dict[str, Any]] = run_threaded(2, _body, models, timeout=300)
    return out


@pytest.mark.parametrize("name", sorted(RULES))
def test_rule_read_over_the_whole_sequence_matches_one_process(ranks: list[dict[str, Any]], name: str) -> None:
    for r in ranks:
        output, grad = r[name]
        assert output <= TOL and grad <= TOL, (name, output, grad)


def test_a_given_token_count_is_kept_over_gradient_accumulation(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        got = r["accumulated"]
        assert got["kept"] == 1.0 and got["loss"] <= TOL and got["grad"] <= TOL, got


REFUSED = {
    "encoder-decoder": ("BartForConditionalGeneration", "encoder-decoder", "cross-attention", "without context="),
    "sequence-classification": ("BertForSequenceClassification", "sequence-level head", "gather_sequence"),
    "mlm-labels-shifted": ("ModernBertForMaskedLM", "its own label", "shift_labels=False"),
    "causal-labels-unshifted": ("LlamaForCausalLM", "causal LM", "shift_labels=True"),
    "positions-from-the-mask": ("OPTForCausalLM", "OPTDecoder", "padding mask", "position_ids"),
    "encoder-states": ("BertLMHeadModel", "encoder_hidden_states", "cross-attention"),
}


def test_a_base_encoders_pooled_first_token_is_not_given(ranks: list[dict[str, Any]]) -> None:
    # one process pools the sequence's first token; under cp a rank's first token is its piece's: no pooled output
    for r in ranks:
        pooled, whole = r["pooled"]
        assert pooled is None and whole == (2, 32)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_on_every_rank_before_any_collective(ranks: list[dict[str, Any]], name: str) -> None:
    for r in ranks:
        message, collectives = r["refusals"][name]
        assert collectives == 0, (name, collectives)
        for part in REFUSED[name]:
            assert part in message, (name, message)
