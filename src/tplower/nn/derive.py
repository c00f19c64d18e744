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
                   ``query``, ``q``, ``q_lin``, ...): those ``colwise`` (each rank owns whole heads: the
                   query heads and, under grouped-query attention, the key/value heads they share), the
                   output projection (``o_proj``, ``out_proj``, ``o``, ``out_lin``, ``dense``, or a sibling
                   ``output.dense``) ``rowwise`` (one ``all_reduce``), when the widths are whole heads
                   (``o.in * k.out == q.out * v.out``, ``k.out`` dividing ``q.out``); the module's integer
                   attributes that count heads (``num_heads``, ``num_key_value_heads``, ...) or hold the
                   projections' width (``all_head_size``, ``inner_dim``) are divided (``local_attrs``).
                   With ``tp`` known, attention whose config head counts (``num_attention_heads``,
                   ``num_key_value_heads``) do not divide over it is left whole: the rule ``parallelize``
                   holds every plan to (``"auto"`` included) is that each rank owns whole heads
``fused_qkv``      one ``query_key_value`` projection laid out head by head (GPT-NeoX, BLOOM, Falcon):
                   ``colwise`` (whole heads per rank), ``dense`` ``rowwise``, head counts divided; a
                   ``forward`` taking ``alibi`` (BLOOM: built for all heads, ``[batch * heads, 1, seq]``)
                   gets ``local_compute`` :func:`tplower.nn.alibi.alibi_heads_forward`, which slices it
                   to the rank's heads
``mlp``            an up (and gate) projection feeding a down projection: ``gate_proj``/``up_proj`` ->
                   ``down_proj``, ``fc1`` -> ``fc2``, ``lin1`` -> ``lin2``, ``dense_h_to_4h`` ->
                   ``dense_4h_to_h``, ``wi``/``wi_0``/``wi_1`` -> ``wo``, ``intermediate.dense`` ->
                   ``output.dense``; the up ones ``colwise``, the down one ``rowwise``, only when the widths
                   match (up ``out_features`` == down ``in_features``); a fused ``gate_up_proj`` is
                   ``packed_colwise``; ``Conv1D`` projections (GPT-2's ``c_fc`` -> ``c_proj``) take
                   ``conv1d_colwise`` / ``conv1d_rowwise``
``head_bias``      an ``nn.Embedding`` child of an attention module with one column per head (T5's
                   relative position bias): its columns split as the heads are, lookups stay local
``fused_conv1d``   GPT-2's attention: one transformers ``Conv1D`` ``c_attn`` (weight ``[in, out]``, query, key
                   and value packed along ``out``) and ``c_proj``: ``c_attn`` ``conv1d_colwise`` with its 3
                   parts each split (``packed``), so each rank keeps its own query, key and value heads,
                   ``c_proj`` ``conv1d_rowwise``; ``num_heads`` and ``split_size`` divided
``not_linear``     a projection of those names that is neither an ``nn.Linear`` nor a ``Conv1D``: left whole,
                   since no style shards it
``whole``          every other module with parameters of its own (norms, position embeddings, convolutions,
                   projections of other names, expert weights): left whole, one line per key with the reason
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

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..core.errors import TPLowerError
from .conv1d import is_conv1d
from .heads import config_head_counts, config_heads, head_attrs

__all__ = ["DerivedPlan", "Rule", "derive_plan"]

_QKV = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"), ("q_lin", "k_lin", "v_lin"))
_OUT = ("o_proj", "out_proj", "o", "out_lin", "dense")
_MLP = ((("gate_proj", "up_proj"), "down_proj"), (("up_proj",), "down_proj"), (("fc1",), "fc2"),
        (("lin1",), "lin2"), (("dense_h_to_4h",), "dense_4h_to_h"), (("wi_0", "wi_1"), "wo"), (("wi",), "wo"),
        (("c_fc",), "c_proj"), (("gate_up_proj",), "down_proj"))


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


def _projection(module: nn.Module | None) -> bool:
    """An ``nn.Linear`` or a transformers ``Conv1D`` (the same map, weight stored ``[in, out]``)."""
    return _linear(module) or is_conv1d(module)


def _width(module: nn.Module, side: str) -> int:
    """``in`` or ``out`` features of an ``nn.Linear`` or a ``Conv1D``."""
    if is_conv1d(module):
        return int(getattr(module, "nx" if side == "in" else "nf"))
    return int(getattr(module, "in_features" if side == "in" else "out_features"))


def _style(module: nn.Module, split: str) -> str:
    """``colwise``/``rowwise`` for an ``nn.Linear``, ``conv1d_colwise``/``conv1d_rowwise`` for a ``Conv1D``."""
    return f"conv1d_{split}" if is_conv1d(module) else split


def _takes(module: nn.Module, name: str) -> bool:
    """Whether the module's ``forward`` has a parameter called ``name``."""
    try:
        return name in inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False


def _whole_reason(module: nn.Module) -> str:
    """Why the final pass leaves a module with parameters of its own whole (no rule placed it)."""
    name = type(module).__name__
    if "norm" in name.lower():
        return f"{name}: a norm, on whole activations (every rank normalizes the same values)"
    if isinstance(module, nn.Embedding):
        return f"{name}: an embedding (positions, types) added to whole activations"
    if isinstance(module, nn.modules.conv._ConvNd):
        return f"{name}: a convolution, which no rule splits"
    if _projection(module):
        return (f"{name}: a projection no rule names (not a query/key/value, output, up/gate or down projection of "
                "a known name)")
    own = sorted(n for n, _ in module.named_parameters(recurse=False))
    return f"{name}: parameters {own} that no rule places"


class _Deriver:
    def __init__(self, model: nn.Module, embeddings: bool, axis: str, tp: int | None = None) -> None:
        self.model, self.embeddings, self.axis, self.tp = model, embeddings, axis, tp
        self.modules = dict(model.named_modules())
        self.heads = config_heads(model)
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
        if module is None or _projection(module):
            return False
        if _glob(name) not in {r.key for r in self.out.rules}:
            self.out.rules.append(Rule(_glob(name), "not_linear", f"{type(module).__name__} is neither an "
                                       "nn.Linear nor a Conv1D (no style shards its weight); left whole"))
        self.taken.add(name)
        return True

    def whole(self, qual: str, rule: str, why: str, members: Iterable[str] = ()) -> None:
        """Say once per key that ``qual`` (and ``members``, which no later rule then takes) is left whole."""
        if _glob(qual) not in {r.key for r in self.out.rules}:
            self.out.rules.append(Rule(_glob(qual), rule, f"{why}; left whole"))
        self.taken.update((qual, *members))

    def heads_divide(self, qual: str, rule: str, members: Iterable[str]) -> bool:
        """Whether each rank can own whole query and key/value heads at the known tp (else left whole, said)."""
        bad = {k: v for k, v in config_head_counts(self.model).items() if self.tp and v % self.tp}
        if bad:
            what = ", ".join(f"{k}={v}" for k, v in bad.items())
            self.whole(qual, rule, f"{what} does not divide over tp={self.tp} (each rank must own whole query and "
                       "key/value heads, as parallelize requires of every plan)", members)
        return not bad

    def attention(self, qual: str, module: nn.Module) -> None:
        names = dict(module.named_children())
        for q, k, v in _QKV:
            if not all(n in names for n in (q, k, v)):
                continue
            if any(self.not_linear(_join(qual, n)) for n in (q, k, v)):
                return
            out = next((_join(qual, n) for n in _OUT if _projection(names.get(n))), None)
            parent = qual.rpartition(".")[0]
            if out is None and _linear(self.modules.get(_join(parent, "output.dense"))):
                out = _join(parent, "output.dense")  # BERT and ViT: attention.self + attention.output.dense
            qkv = [_join(qual, n) for n in (q, k, v)]
            if out is None:
                self.whole(qual, "attention", f"{q}/{k}/{v} but no output projection ({', '.join(_OUT)} or a "
                           "sibling output.dense)", qkv)
                return
            (wq, wk, wv), wo = (_width(names[n], "out") for n in (q, k, v)), _width(self.modules[out], "in")
            if wq % wk or wo * wk != wq * wv:  # heads: q and k share a head dim, v and o another, kv heads divide q
                self.whole(qual, "attention", f"widths {q} {wq}, {k} {wk}, {v} {wv}, {out.rpartition('.')[2]} "
                           f"in {wo} are not whole heads of (grouped-query) attention", [*qkv, out])
                return
            if self.heads_divide(qual, "attention", [*qkv, out]):
                self.split_attention(qual, module, qkv, out, wq, wk)
            return
        if is_conv1d(names.get("c_attn")) and is_conv1d(names.get("c_proj")):
            self.fused_conv1d(qual, module, names)
            return
        fused = names.get("query_key_value")
        if (fused is not None and not self.not_linear(_join(qual, "query_key_value")) and _linear(fused)
                and _linear(names.get("dense")) and self.heads_divide(qual, "fused_qkv", (
                    _join(qual, "query_key_value"), _join(qual, "dense")))):
            attrs = head_attrs(module, self.heads, int(fused.out_features) // 3)  # type: ignore[arg-type]
            entry: dict[str, Any] = {"local_attrs": attrs} if attrs else {}
            if _takes(module, "alibi") and "num_heads" in attrs:  # BLOOM: alibi is built for all heads outside
                entry["local_compute"] = "tplower.nn.alibi:alibi_heads_forward"
            if entry:
                self.put(qual, entry, "fused_qkv", f"head counts {sorted(attrs)} divided by tp" + (
                    "; the alibi argument (built for all heads) sliced to this rank's heads"
                    if "local_compute" in entry else ""))
            self.put(_join(qual, "query_key_value"), "colwise", "fused_qkv",
                     "query/key/value packed head by head: a colwise split gives each rank whole heads")
            self.put(_join(qual, "dense"), "rowwise", "fused_qkv", "attention output projection: rowwise "
                     "(one all_reduce)")

    def fused_conv1d(self, qual: str, module: nn.Module, names: dict[str, nn.Module]) -> None:
        """GPT-2's attention: ``c_attn`` packs query, key and value along its ``Conv1D`` output, ``c_proj`` out."""
        attn, proj = names["c_attn"], names["c_proj"]
        width = _width(proj, "in")
        members = [_join(qual, n) for n in ("c_attn", "c_proj")]
        if "q_attn" in names or _width(attn, "out") != 3 * width:  # cross-attention: c_attn packs key, value only
            self.whole(qual, "fused_conv1d", f"c_attn's {_width(attn, 'out')} outputs are not query, key and value "
                       f"of {width} each (cross-attention)", members)
            return
        if not self.heads_divide(qual, "fused_conv1d", members):
            return
        attrs = head_attrs(module, self.heads, width)
        if attrs:
            self.put(qual, {"local_attrs": attrs}, "fused_conv1d", f"head counts and widths {sorted(attrs)} divided "
                     "by tp (each rank splits and reshapes its own heads)")
        self.put(_join(qual, "c_attn"), {"style": "conv1d_colwise", "packed": {"weight": 3, "bias": 3}},
                 "fused_conv1d", "query, key and value packed along the Conv1D output: each part split on its own, "
                 "so each rank keeps its own heads of all three")
        self.put(_join(qual, "c_proj"), "conv1d_rowwise", "fused_conv1d", "attention output projection (Conv1D): "
                 "rowwise (one all_reduce)")

    def split_attention(self, qual: str, module: nn.Module, qkv: list[str], out: str, q_width: int,
                        k_width: int) -> None:
        attrs = head_attrs(module, self.heads, q_width)
        if attrs:
            self.put(qual, {"local_attrs": attrs}, "attention", f"head counts and widths {sorted(attrs)} divided "
                     "by tp (each rank reshapes its own heads)")
        grouped = f" ({q_width // k_width} query heads share a key/value head)" if q_width != k_width else ""
        for name in qkv:
            self.put(name, _style(self.modules[name], "colwise"), "attention",
                     "query/key/value projection: colwise, each rank owns whole heads" + grouped)
        self.put(out, _style(self.modules[out], "rowwise"), "attention",
                 "attention output projection: rowwise (one all_reduce)")
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
        widths = [_width(self.modules[u], "out") // (2 if packed else 1) for u in ups]
        if any(w != _width(d, "in") for w in widths):
            self.whole(qual, "mlp", f"widths {widths} of {ups} do not feed {down} ({_width(d, 'in')} inputs)",
                       [*ups, down])
            return
        if packed and any(is_conv1d(self.modules[u]) for u in ups):
            self.whole(qual, "mlp", "gate and up packed in a Conv1D", [*ups, down])
            return
        for name in ups:
            style = "packed_colwise" if packed else _style(self.modules[name], "colwise")
            self.put(name, style, "mlp",
                     "up/gate projection: colwise" + (" (gate and up packed: each half split)" if packed else ""))
        self.put(down, _style(d, "rowwise"), "mlp", "down projection: rowwise (one all_reduce)")

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

    def rest(self) -> None:
        """One line per key for every module with parameters of its own that no rule placed or explained."""
        said = {r.key for r in self.out.rules} | set(self.out.plan)
        for qual, module in self.modules.items():
            key = _glob(qual) or f"({type(module).__name__})"
            if qual in self.taken or key in said or next(module.parameters(recurse=False), None) is None:
                continue
            said.add(key)
            self.out.rules.append(Rule(key, "whole", f"{_whole_reason(module)}; left whole"))

    def run(self) -> DerivedPlan:
        for qual, module in self.modules.items():
            self.attention(qual, module)
        for qual, module in self.modules.items():
            self.mlp(qual, module)
        self.head_and_embeddings()
        self.rest()
        return self.out


def derive_plan(model: nn.Module, *, embeddings: bool = False, axis: str = "tp", tp: int | None = None
                ) -> DerivedPlan:
    """A plan for ``model`` derived from its module structure (rules in the module docstring).

    Works on a model on any device, the meta device included (only names, types, sizes and integer attributes
    are read).

    Args:
        model: the model to plan.
        embeddings: also shard word embeddings (vocabulary-parallel) and an output head of the vocabulary
            (``colwise_rep``).
        axis: the tensor-parallel mesh axis named by entries that place a parameter themselves.
        tp: the size of that axis, where known (``parallelize(..., "derive")`` passes it): attention whose
            config head counts (:data:`HEAD_COUNTS`) do not divide over it is left whole, and said so, rather
            than split into pieces ``parallelize`` refuses. ``None``: split wherever the rules match.

    Returns:
        A :class:`DerivedPlan`: ``plan`` is ready for :func:`tplower.parallelize` or a YAML file, ``rules``
        says which rule made (or skipped) each key.

    Raises:
        TPLowerError: no rule matched any module (the model has no attention or MLP projections of known
            names); write a plan by hand (``tplower plan`` output is a starting point).
        TypeError, ValueError: ``model`` is not an ``nn.Module``; ``tp`` is not a positive integer or ``None``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"derive_plan: model must be a torch.nn.Module, got {type(model).__name__}")
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int)):
        raise TypeError(f"derive_plan: tp must be an int or None, got {type(tp).__name__}")
    if tp is not None and tp < 1:
        raise ValueError(f"derive_plan: tp={tp}; allowed: a positive integer (the axis size) or None")
    derived = _Deriver(model, embeddings, axis, tp).run()
    if not derived.plan:
        raise TPLowerError(f"derive: no rule matched a module of {type(model).__name__} (no attention or MLP "
                           "projections of known names); write the plan by hand")
    return derived
