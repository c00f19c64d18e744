"""Derive a tensor-parallel plan from a model's module structure (``parallelize(model, mesh, "derive")``).

For models that ship no ``tp_plan`` (BERT and its family, GPT-NeoX-style
fused attention, T5, OPT, Whisper, ViT, custom research models),
:func:`derive_plan` walks the module tree and fills Megatron's split from
rules, each explained as it matches (:meth:`DerivedPlan.explain`,
``tplower explain --plan derive``):

=================  ==========================================================================================
rule               matches, and what it plans
=================  ==========================================================================================
``attention``      a module with ``nn.Linear`` children named as query/key/value projections (``q_proj``,
                   ``query``, ``q``, ``q_lin``, ...): those ``colwise`` (each rank owns whole heads), the
                   output projection (``o_proj``, ``out_proj``, ``o``, ``out_lin``, ``dense``, or a sibling
                   ``output.dense``) ``rowwise`` (one ``all_reduce``); the module's integer attributes that
                   count heads (``num_heads``, ``n_heads``, ``num_attention_heads``, ...) or hold the
                   projections' width (``all_head_size``, ``inner_dim``) are divided (``local_attrs``)
``fused_qkv``      one ``query_key_value`` projection laid out head by head (GPT-NeoX, BLOOM, Falcon):
                   ``colwise`` (whole heads per rank), ``dense`` ``rowwise``, head counts divided
``mlp``            an up (and gate) projection feeding a down projection: ``gate_proj``/``up_proj`` ->
                   ``down_proj``, ``fc1`` -> ``fc2``, ``lin1`` -> ``lin2``, ``dense_h_to_4h`` ->
                   ``dense_4h_to_h``, ``wi``/``wi_0``/``wi_1`` -> ``wo``, ``intermediate.dense`` ->
                   ``output.dense``; the up ones ``colwise``, the down one ``rowwise``, only when the widths
                   match (up ``out_features`` == down ``in_features``); a fused ``gate_up_proj`` is
                   ``packed_colwise``
``head_bias``      an ``nn.Embedding`` child of an attention module with one column per head (T5's
                   relative position bias): its columns split as the heads are, lookups stay local
``not_linear``     a projection of those names that is not an ``nn.Linear`` (transformers' ``Conv1D`` with its
                   ``[in, out]`` weight): left whole, since no style shards it
=================  ==========================================================================================

Everything else stays replicated: embeddings and the output head (sharding
them adds a collective per step: ``embeddings=True`` makes word embeddings
vocabulary-parallel and an output head of the vocabulary ``colwise_rep``),
norms (whole activations between the row- and column-parallel layers),
convolutions, pooling layers. A parameter left whole that still meets a
sharded activation is found at the first forward by
:mod:`tplower.nn.coverage`. Keys are globs over layer indices
(``encoder.layer.*.attention.self.query``), one per distinct name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..core.errors import TPLowerError

__all__ = ["DerivedPlan", "Rule", "derive_plan"]

_QKV = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"), ("q_lin", "k_lin", "v_lin"))
_OUT = ("o_proj", "out_proj", "o", "out_lin", "dense")
_MLP = ((("gate_proj", "up_proj"), "down_proj"), (("up_proj",), "down_proj"), (("fc1",), "fc2"),
        (("lin1",), "lin2"), (("dense_h_to_4h",), "dense_4h_to_h"), (("wi_0", "wi_1"), "wo"), (("wi",), "wo"),
        (("c_fc",), "c_proj"), (("gate_up_proj",), "down_proj"))
_WIDTH_ATTRS = ("all_head_size", "inner_dim")
_HEAD_WORDS = re.compile(r"(^|_)(heads?|n_head|num_heads)($|_)")


@dataclass(frozen=True)
class Rule:
    """One rule's match: the plan key it wrote (or the module it left whole), the rule's name and why."""

    key: str
    rule: str
    why: str


@dataclass
class DerivedPlan:
    """What :func:`derive_plan` derived: the plan (``{glob: style or entry}``) and the rules that matched."""

    plan: dict[str, Any] = field(default_factory=dict)
    rules: list[Rule] = field(default_factory=list)

    def explain(self) -> str:
        """One line per rule match: ``key  rule: why``."""
        width = max((len(r.key) for r in self.rules), default=0)
        return "\n".join(f"{r.key:{width}}  {r.rule}: {r.why}" for r in self.rules)


def _glob(name: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _linear(module: nn.Module | None) -> bool:
    return isinstance(module, nn.Linear)


def _head_attrs(module: nn.Module, heads: Iterable[int], width: int) -> dict[str, str]:
    """The integer attributes of an attention module that count heads or hold the projections' width."""
    counts = set(heads)
    out = {}
    for name, value in vars(module).items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            continue
        if (_HEAD_WORDS.search(name) and value in counts and "dim" not in name and "size" not in name) or (
                name in _WIDTH_ATTRS and value == width):
            out[name] = "divide"
    return out


def _config_heads(model: nn.Module) -> set[int]:
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    found = set()
    for attr in ("num_attention_heads", "num_key_value_heads", "num_heads", "n_head", "n_heads",
                 "encoder_attention_heads", "decoder_attention_heads"):
        value = getattr(text, attr, None)
        if isinstance(value, int) and value > 0:
            found.add(value)
    return found


class _Deriver:
    def __init__(self, model: nn.Module, embeddings: bool, axis: str) -> None:
        self.model, self.embeddings, self.axis = model, embeddings, axis
        self.modules = dict(model.named_modules())
        self.heads = _config_heads(model)
        self.out = DerivedPlan()
        self.taken: set[str] = set()

    def put(self, name: str, value: Any, rule: str, why: str) -> None:
        key = _glob(name)
        if name in self.taken:
            return
        self.taken.add(name)
        if key in self.out.plan:
            return
        self.out.plan[key] = value
        self.out.rules.append(Rule(key, rule, why))

    def child(self, prefix: str, name: str) -> nn.Module | None:
        return self.modules.get(_join(prefix, name))

    def not_linear(self, name: str) -> bool:
        module = self.modules.get(name)
        if module is None or _linear(module):
            return False
        if _glob(name) not in {r.key for r in self.out.rules}:
            self.out.rules.append(Rule(_glob(name), "not_linear", f"{type(module).__name__} is not an nn.Linear "
                                       "(no style shards its weight); left whole"))
        self.taken.add(name)
        return True

    def attention(self, qual: str, module: nn.Module) -> None:
        names = dict(module.named_children())
        for q, k, v in _QKV:
            if not all(n in names for n in (q, k, v)):
                continue
            if any(self.not_linear(_join(qual, n)) for n in (q, k, v)):
                return
            out = next((_join(qual, n) for n in _OUT if _linear(names.get(n))), None)
            parent = qual.rpartition(".")[0]
            if out is None and _linear(self.modules.get(_join(parent, "output.dense"))):
                out = _join(parent, "output.dense")  # BERT and ViT: attention.self + attention.output.dense
            width = sum(names[n].out_features for n in (q, k, v))  # type: ignore[misc]
            if out is None or self.modules[out].in_features != names[v].out_features:  # type: ignore[operator,arg-type]
                return
            self.split_attention(qual, module, [_join(qual, n) for n in (q, k, v)], out,
                                 names[q].out_features, width)  # type: ignore[arg-type]
            return
        fused = names.get("query_key_value")
        if fused is not None and not self.not_linear(_join(qual, "query_key_value")) and _linear(names.get("dense")):
            attrs = _head_attrs(module, self.heads, int(fused.out_features) // 3)  # type: ignore[arg-type]
            if attrs:
                self.put(qual, {"local_attrs": attrs}, "fused_qkv", f"head counts {sorted(attrs)} divided by tp")
            self.put(_join(qual, "query_key_value"), "colwise", "fused_qkv",
                     "query/key/value packed head by head: a colwise split gives each rank whole heads")
            self.put(_join(qual, "dense"), "rowwise", "fused_qkv", "attention output projection: rowwise "
                     "(one all_reduce)")

    def split_attention(self, qual: str, module: nn.Module, qkv: list[str], out: str, q_width: int,
                        width: int) -> None:
        attrs = _head_attrs(module, self.heads, q_width)
        if attrs:
            self.put(qual, {"local_attrs": attrs}, "attention", f"head counts and widths {sorted(attrs)} divided "
                     "by tp (each rank reshapes its own heads)")
        for name in qkv:
            self.put(name, "colwise", "attention", "query/key/value projection: colwise, each rank owns whole heads")
        self.put(out, "rowwise", "attention", "attention output projection: rowwise (one all_reduce)")
        for name, child in module.named_children():  # T5's relative position bias: one column per head
            if isinstance(child, nn.Embedding) and child.embedding_dim in self.heads:
                self.put(_join(qual, name), {"params": {"weight": {self.axis: "S(1)"}}}, "head_bias",
                         "a per-head bias table (one column per head): columns split as the heads, lookups local")

    def mlp(self, qual: str, module: nn.Module) -> None:
        names = dict(module.named_children())
        for ups, down in _MLP:
            if not all(n in names for n in (*ups, down)) or any(_join(qual, n) in self.taken for n in (*ups, down)):
                continue
            if any(self.not_linear(_join(qual, n)) for n in (*ups, down)):
                return
            self.pair(qual, [_join(qual, n) for n in ups], _join(qual, down), packed=ups == ("gate_up_proj",))
            return
        inter, output = self.child(qual, "intermediate.dense"), self.child(qual, "output.dense")
        if _linear(inter) and _linear(output):  # BERT and ViT layers
            self.pair(qual, [_join(qual, "intermediate.dense")], _join(qual, "output.dense"))

    def pair(self, qual: str, ups: list[str], down: str, packed: bool = False) -> None:
        d = self.modules[down]
        assert isinstance(d, nn.Linear)
        widths = [self.modules[u].out_features // (2 if packed else 1) for u in ups]  # type: ignore[operator]
        if any(w != d.in_features for w in widths):
            self.out.rules.append(Rule(_glob(qual), "mlp", f"widths {widths} of {ups} do not feed {down} "
                                       f"({d.in_features} inputs); left whole"))
            return
        for name in ups:
            self.put(name, "packed_colwise" if packed else "colwise", "mlp",
                     "up/gate projection: colwise" + (" (gate and up packed: each half split)" if packed else ""))
        self.put(down, "rowwise", "mlp", "down projection: rowwise (one all_reduce)")

    def head_and_embeddings(self) -> None:
        config = getattr(self.model, "config", None)
        text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
        vocab = getattr(text, "vocab_size", None)
        for qual, module in self.modules.items():
            if isinstance(module, nn.Embedding) and module.num_embeddings == vocab and qual:
                if self.embeddings:
                    self.put(qual, "embedding_rowwise", "embeddings", "word embeddings: vocabulary-parallel")
                else:
                    self.out.rules.append(Rule(_glob(qual), "embeddings", "word embeddings left whole (sharding "
                                               "adds an all_reduce per step; embeddings=True shards the vocabulary)"))
            elif isinstance(module, nn.Linear) and module.out_features == vocab and qual not in self.taken:
                if self.embeddings:
                    self.put(qual, "colwise_rep", "output_head", "output head: vocabulary colwise, logits gathered")
                else:
                    self.out.rules.append(Rule(_glob(qual), "output_head", "output head left whole"))

    def run(self) -> DerivedPlan:
        for qual, module in self.modules.items():
            self.attention(qual, module)
        for qual, module in self.modules.items():
            self.mlp(qual, module)
        self.head_and_embeddings()
        return self.out


def derive_plan(model: nn.Module, *, embeddings: bool = False, axis: str = "tp") -> DerivedPlan:
    """A plan for ``model`` derived from its module structure (rules in the module docstring).

    Works on a model on any device, the meta device included (only names, types, sizes and integer attributes
    are read).

    Args:
        model: the model to plan.
        embeddings: also shard word embeddings (vocabulary-parallel) and an output head of the vocabulary
            (``colwise_rep``).
        axis: the tensor-parallel mesh axis named by entries that place a parameter themselves.

    Returns:
        A :class:`DerivedPlan`: ``plan`` is ready for :func:`tplower.parallelize` or a YAML file, ``rules``
        says which rule made (or skipped) each key.

    Raises:
        TPLowerError: no rule matched any module (the model has no attention or MLP projections of known
            names); write a plan by hand (``tplower plan`` output is a starting point).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"derive_plan: model must be a torch.nn.Module, got {type(model).__name__}")
    derived = _Deriver(model, embeddings, axis).run()
    if not derived.plan:
        raise TPLowerError(f"derive: no rule matched a module of {type(model).__name__} (no attention or MLP "
                           "projections of known names); write the plan by hand")
    return derived


def plan_text(derived: DerivedPlan) -> dict[str, Any]:
    """The plan as plain data (for YAML/JSON), keys in derivation order."""
    return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in derived.plan.items()}
