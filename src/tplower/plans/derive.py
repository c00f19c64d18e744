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
                   gets ``local_compute`` :func:`tplower.families.alibi.alibi_heads_forward`, which slices it
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

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..core.support.errors import TPLowerError
from ..families.conv1d import is_conv1d
from .heads import config_head_counts, config_heads, head_attrs
from .module_facts import (
    ATTENTION_OUTPUTS,
    MLP_PAIRS,
    QKV_NAMES,
    features,
    glob,
    is_linear,
    is_projection,
    join,
    split_style,
    takes,
    whole_reason,
)

__all__ = ["DerivedPlan", "Rule", "derive_plan"]

_QKV, _OUT, _MLP = QKV_NAMES, ATTENTION_OUTPUTS, MLP_PAIRS


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


def _within(name: str, members: Iterable[str]) -> bool:
    """Whether ``name`` is one of ``members`` or inside one."""
    return any(name == m or name.startswith(f"{m}.") for m in members)


class _Deriver:
    def __init__(self, model: nn.Module, embeddings: bool, axis: str, tp: int | None = None) -> None:
        self.model, self.embeddings, self.axis, self.tp = model, embeddings, axis, tp
        self.modules = dict(model.named_modules())
        self.heads = config_heads(model)
        self.out = DerivedPlan()
        self.taken: set[str] = set()
        self.placed: dict[str, Any] = {}  # module name -> its entry (None: left whole), in derivation order

    def put(self, name: str, value: Any, rule: str, why: str) -> None:
        key = glob(name)
        if name in self.taken:
            return
        self.taken.add(name)
        self.placed[name] = value
        if key not in {r.key for r in self.out.rules}:
            self.out.rules.append(Rule(key, rule, why))

    def build(self) -> None:
        """The plan: one glob per key where every layer takes the same value, and an exact key for each module
        that differs from its glob's first value (``{}`` for one left whole while other layers split)."""
        groups: dict[str, list[tuple[str, Any]]] = {}
        for name, value in self.placed.items():
            groups.setdefault(glob(name), []).append((name, value))
        for key, members in groups.items():
            first = next((v for _, v in members if v is not None), None)
            if first is None:
                continue
            self.out.plan[key] = first
            for name, value in members:
                if value != first:
                    self.out.plan[name] = {} if value is None else value
                    self.out.rules.append(Rule(name, "layer", f"differs from the other layers' {key}: an exact key "
                                               + ("keeps it whole" if value is None else "gives its own entry")))

    def child(self, prefix: str, name: str) -> nn.Module | None:
        return self.modules.get(join(prefix, name))

    def not_linear(self, name: str) -> bool:
        module = self.modules.get(name)
        if module is None or is_projection(module):
            return False
        self.whole(name, "not_linear", f"{type(module).__name__} is neither an nn.Linear nor a Conv1D (no style "
                   "shards its weight)")
        return True

    def whole(self, qual: str, rule: str, why: str, members: Iterable[str] = ()) -> None:
        """Say once per key that ``qual`` (and ``members``, which no later rule then takes) is left whole."""
        if glob(qual) not in {r.key for r in self.out.rules}:
            self.out.rules.append(Rule(glob(qual), rule, f"{why}; left whole"))
        for name in (qual, *members):
            if name not in self.taken:
                self.taken.add(name)
                self.placed[name] = None

    def can_split(self, qual: str, module: nn.Module, rule: str, members: list[str], q_width: int) -> bool:
        """Whether the attention at ``qual`` splits by heads: it holds no weights beyond ``members`` but per-head
        ones (a norm over one head, a per-head bias table), and, at a known tp, each rank owns whole query and
        key/value heads. Else it is left whole, and said why."""
        bad = {k: v for k, v in config_head_counts(self.model).items() if self.tp and v % self.tp}
        if bad:
            what = ", ".join(f"{k}={v}" for k, v in bad.items())
            self.whole(qual, rule, f"{what} does not divide over tp={self.tp} (each rank must own whole query and "
                       "key/value heads, as parallelize requires of every plan)", members)
            return False
        heads = config_head_counts(self.model).get("num_attention_heads")
        head_dim = getattr(module, "head_dim", None) or (q_width // heads if heads and q_width % heads == 0 else 0)
        if other := self.other_weights(qual, module, members, head_dim):
            self.whole(qual, rule, f"it holds weights besides its projections ({', '.join(other)}) that may work on "
                       "all heads or whole widths, which no rule can tell from their shapes", members)
        return not other

    def other_weights(self, qual: str, module: nn.Module, members: list[str], head_dim: int) -> list[str]:
        """The attention module's own parameters, and its descendants' weights outside ``members`` other than
        a vector of one head's width (a per-head norm: whole on every rank) or a per-head bias table."""
        out = [n for n, _ in module.named_parameters(recurse=False)]
        for name, child in module.named_modules():
            own = [p for _, p in child.named_parameters(recurse=False)]
            if not name or not own or _within(join(qual, name), members):
                continue
            if not (isinstance(child, nn.Embedding) and child.embedding_dim in self.heads) and not all(
                    p.dim() == 1 and p.shape[0] == head_dim for p in own):
                out.append(name)
        return out

    def attention(self, qual: str, module: nn.Module) -> None:
        names = dict(module.named_children())
        for q, k, v in _QKV:
            if not all(n in names for n in (q, k, v)):
                continue
            if any(self.not_linear(join(qual, n)) for n in (q, k, v)):
                return
            out = next((join(qual, n) for n in _OUT if is_projection(names.get(n))), None)
            parent = qual.rpartition(".")[0]
            if out is None and is_linear(self.modules.get(join(parent, "output.dense"))):
                out = join(parent, "output.dense")  # BERT and ViT: attention.self + attention.output.dense
            qkv = [join(qual, n) for n in (q, k, v)]
            if out is None:
                self.whole(qual, "attention", f"{q}/{k}/{v} but no output projection ({', '.join(_OUT)} or a "
                           "sibling output.dense)", qkv)
                return
            (wq, wk, wv), wo = (features(names[n], "out") for n in (q, k, v)), features(self.modules[out], "in")
            if wq % wk or wo * wk != wq * wv:  # heads: q and k share a head dim, v and o another, kv heads divide q
                self.whole(qual, "attention", f"widths {q} {wq}, {k} {wk}, {v} {wv}, {out.rpartition('.')[2]} "
                           f"in {wo} are not whole heads of (grouped-query) attention", [*qkv, out])
                return
            if self.can_split(qual, module, "attention", [*qkv, out], wq):
                self.split_attention(qual, module, qkv, out, wq, wk)
            return
        if is_conv1d(names.get("c_attn")) and is_conv1d(names.get("c_proj")):
            self.fused_conv1d(qual, module, names)
            return
        fused = names.get("query_key_value")
        if (fused is not None and not self.not_linear(join(qual, "query_key_value")) and is_linear(fused)
                and is_linear(names.get("dense")) and self.can_split(qual, module, "fused_qkv", [
                    join(qual, "query_key_value"), join(qual, "dense")], features(fused, "out") // 3)):
            attrs = head_attrs(module, self.heads, features(fused, "out") // 3)
            entry: dict[str, Any] = {"local_attrs": attrs} if attrs else {}
            if takes(module, "alibi") and "num_heads" in attrs:  # BLOOM: alibi is built for all heads outside
                entry["local_compute"] = "tplower.families.alibi:alibi_heads_forward"
            if entry:
                self.put(qual, entry, "fused_qkv", f"head counts {sorted(attrs)} divided by tp" + (
                    "; the alibi argument (built for all heads) sliced to this rank's heads"
                    if "local_compute" in entry else ""))
            self.put(join(qual, "query_key_value"), "colwise", "fused_qkv",
                     "query/key/value packed head by head: a colwise split gives each rank whole heads")
            self.put(join(qual, "dense"), "rowwise", "fused_qkv", "attention output projection: rowwise "
                     "(one all_reduce)")

    def fused_conv1d(self, qual: str, module: nn.Module, names: dict[str, nn.Module]) -> None:
        """GPT-2's attention: ``c_attn`` packs query, key and value along its ``Conv1D`` output, ``c_proj`` out."""
        attn, proj = names["c_attn"], names["c_proj"]
        width = features(proj, "in")
        members = [join(qual, n) for n in ("c_attn", "c_proj")]
        if "q_attn" in names or features(attn, "out") != 3 * width:  # cross-attention: c_attn packs key, value only
            self.whole(qual, "fused_conv1d", f"c_attn's {features(attn, 'out')} outputs are not query, key and value "
                       f"of {width} each (cross-attention)", members)
            return
        if not self.can_split(qual, module, "fused_conv1d", members, width):
            return
        attrs = head_attrs(module, self.heads, width)
        if attrs:
            self.put(qual, {"local_attrs": attrs}, "fused_conv1d", f"head counts and widths {sorted(attrs)} divided "
                     "by tp (each rank splits and reshapes its own heads)")
        self.put(join(qual, "c_attn"), {"style": "conv1d_colwise", "packed": {"weight": 3, "bias": 3}},
                 "fused_conv1d", "query, key and value packed along the Conv1D output: each part split on its own, "
                 "so each rank keeps its own heads of all three")
        self.put(join(qual, "c_proj"), "conv1d_rowwise", "fused_conv1d", "attention output projection (Conv1D): "
                 "rowwise (one all_reduce)")

    def split_attention(self, qual: str, module: nn.Module, qkv: list[str], out: str, q_width: int,
                        k_width: int) -> None:
        attrs = head_attrs(module, self.heads, q_width)
        if attrs:
            self.put(qual, {"local_attrs": attrs}, "attention", f"head counts and widths {sorted(attrs)} divided "
                     "by tp (each rank reshapes its own heads)")
        grouped = f" ({q_width // k_width} query heads share a key/value head)" if q_width != k_width else ""
        for name in qkv:
            self.put(name, split_style(self.modules[name], "colwise"), "attention",
                     "query/key/value projection: colwise, each rank owns whole heads" + grouped)
        self.put(out, split_style(self.modules[out], "rowwise"), "attention",
                 "attention output projection: rowwise (one all_reduce)")
        for name, child in module.named_children():  # T5's relative position bias: one column per head
            if isinstance(child, nn.Embedding) and child.embedding_dim in self.heads:
                self.put(join(qual, name), {"params": {"weight": {self.axis: "S(1)"}}}, "head_bias",
                         "a per-head bias table (one column per head): columns split as the heads, lookups local")

    def mlp(self, qual: str, module: nn.Module) -> None:
        names = dict(module.named_children())
        for ups, down in _MLP:
            if not all(n in names for n in (*ups, down)) or any(join(qual, n) in self.taken for n in (*ups, down)):
                continue
            if any(self.not_linear(join(qual, n)) for n in (*ups, down)):
                return
            self.pair(qual, [join(qual, n) for n in ups], join(qual, down), packed=ups == ("gate_up_proj",))
            return
        inter, output = self.child(qual, "intermediate.dense"), self.child(qual, "output.dense")
        if is_linear(inter) and is_linear(output):  # BERT and ViT layers
            self.pair(qual, [join(qual, "intermediate.dense")], join(qual, "output.dense"))

    def pair(self, qual: str, ups: list[str], down: str, packed: bool = False) -> None:
        d = self.modules[down]
        widths = [features(self.modules[u], "out") // (2 if packed else 1) for u in ups]
        if any(w != features(d, "in") for w in widths):
            self.whole(qual, "mlp", f"widths {widths} of {ups} do not feed {down} ({features(d, 'in')} inputs)",
                       [*ups, down])
            return
        if packed and any(is_conv1d(self.modules[u]) for u in ups):
            self.whole(qual, "mlp", "gate and up packed in a Conv1D", [*ups, down])
            return
        scopes = {m.rpartition(".")[0] for m in (*ups, down)}  # the MLP module (BERT: intermediate and output)
        other = [join(s, n) for s in sorted(scopes) for n, p in self.modules[s].named_parameters()
                 if widths[0] in p.shape and not _within(join(s, n), [*ups, down])]
        if other:
            self.whole(qual, "mlp", f"weights of the intermediate width besides the projections ({', '.join(other)}) "
                       "would meet its split", [*ups, down])
            return
        for name in ups:
            style = "packed_colwise" if packed else split_style(self.modules[name], "colwise")
            self.put(name, style, "mlp",
                     "up/gate projection: colwise" + (" (gate and up packed: each half split)" if packed else ""))
        self.put(down, split_style(d, "rowwise"), "mlp", "down projection: rowwise (one all_reduce)")

    def head_and_embeddings(self) -> None:
        config = getattr(self.model, "config", None)
        text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
        vocab = getattr(text, "vocab_size", None)
        for qual, module in self.modules.items():
            if isinstance(module, nn.Embedding) and module.num_embeddings == vocab and qual:
                if self.embeddings:
                    self.put(qual, "embedding_rowwise", "embeddings", "word embeddings: vocabulary-parallel")
                else:
                    self.out.rules.append(Rule(glob(qual), "embeddings", "word embeddings left whole (sharding "
                                               "adds an all_reduce per step; embeddings=True shards the vocabulary)"))
            elif isinstance(module, nn.Linear) and module.out_features == vocab and qual not in self.taken:
                if self.embeddings:
                    self.put(qual, "colwise_rep", "output_head", "output head: vocabulary colwise, logits gathered")
                else:
                    self.out.rules.append(Rule(glob(qual), "output_head", "output head left whole"))

    def rest(self) -> None:
        """One line per key for every module with parameters of its own that no rule placed or explained."""
        said = {r.key for r in self.out.rules} | set(self.out.plan)
        for qual, module in self.modules.items():
            key = glob(qual) or f"({type(module).__name__})"
            if qual in self.taken or key in said or next(module.parameters(recurse=False), None) is None:
                continue
            said.add(key)
            self.out.rules.append(Rule(key, "whole", f"{whole_reason(module)}; left whole"))

    def run(self) -> DerivedPlan:
        for qual, module in self.modules.items():
            self.attention(qual, module)
        for qual, module in self.modules.items():
            self.mlp(qual, module)
        self.head_and_embeddings()
        self.build()
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
            config head counts (:data:`tplower.plans.heads.HEAD_COUNTS`) do not divide over it is left whole, and
            said so, rather than split into pieces ``parallelize`` refuses. ``None``: split wherever the rules match.

    Returns:
        A :class:`DerivedPlan`: ``plan`` is ready for :func:`tplower.parallelize` or a YAML file, ``rules``
        says which rule made (or skipped) each key.

    Raises:
        TPLowerError: the plan would shard nothing: no rule matched a module (no attention or MLP projections
            of known names), or every match is left whole (the message gives the first reason); write a plan by
            hand (``tplower plan`` output is a starting point).
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
        whole = [f"{r.key}: {r.why}" for r in derived.rules if r.rule not in ("whole", "embeddings", "output_head")]
        raise TPLowerError(f"derive: no rule shards a module of {type(model).__name__} " + (
            f"(every match is left whole: {whole[0]}{'; ...' if len(whole) > 1 else ''})" if whole else
            "(no rule matched a module: no attention or MLP projections of known names)")
            + "; write the plan by hand")
    return derived
