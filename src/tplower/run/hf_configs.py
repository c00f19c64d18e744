"""The tiny configs of :mod:`tplower.run.hf_table`: every transformers decoder with a ``base_model_tp_plan``.

:func:`architectures` lists them from transformers' own registry;
:func:`tiny_config` shrinks each config to shared small sizes (every sharded
dim divides over tp=2) with per-architecture overrides; :func:`tiny_model`
builds the random-weight causal LM (``WEIGHT_SEED``), float32, ``eval()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.support.errors import TPLowerError

__all__ = ["WEIGHT_SEED", "Arch", "architectures", "tiny_config", "tiny_model"]

#: the random weights of every tiny model come from this seed
WEIGHT_SEED = 0


@dataclass(frozen=True)
class Arch:
    """One decoder architecture: its ``model_type``, config class and causal-LM class name."""

    model_type: str
    config_class: str
    causal_lm: str



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
    # transformers 5.25: one sliding and one indexed layer (its default layout wants 5 layers), index heads
    # among the 2 query heads of a key head, an index pool that the compression divides
    "kolibri1_1": {"layer_types": ["sliding_attention", "indexed_attention"], "index_layers": [1],
                   "kv_source_layers": [0, 1], "index_num_heads": 2, "index_topk": 8, "index_pool_size": 32,
                   "index_compression": 4, "index_num_local_tokens": 4, "index_num_sink_tokens": 2,
                   "sliding_window": 8},
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


def _tiny_kwargs(config_class: Any, model_type: str, vocab_size: int | None = None) -> dict[str, Any]:
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
            size = vocab_size if name == "vocab_size" and vocab_size is not None else _SIZES[name]
            kwargs[name] = [size] * 2 if per_layer else size
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
        kwargs["text_config"] = _tiny_kwargs(sub if isinstance(sub, type) else type(defaults.text_config), model_type,
                                             vocab_size)
    kwargs.update(_OVERRIDES.get(model_type, {}))
    return kwargs


def tiny_config(model_type: str, vocab_size: int | None = None) -> Any:
    """A small float32 config of ``model_type``: the class defaults, ``_SIZES`` where they apply, the overrides.

    ``vocab_size`` replaces ``_SIZES``' (e.g. an odd one, which no tp divides).
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    config = config_class(**_tiny_kwargs(config_class, model_type, vocab_size))
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


def tiny_model(arch: Arch, vocab_size: int | None = None) -> nn.Module:
    """The causal-LM of ``arch`` on :func:`tiny_config` (``vocab_size`` as there), random weights from
    ``WEIGHT_SEED``, float32, ``eval()``."""
    import transformers

    model_class = getattr(transformers, arch.causal_lm)
    config = _model_config(model_class, tiny_config(arch.model_type, vocab_size))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(WEIGHT_SEED)
        model: nn.Module = model_class(config)
    return model.to(torch.float32).eval()
