"""The Hugging Face ``tp_plan`` vocabulary: each style written as a plan entry for one tensor-parallel axis.

:data:`HF_STYLES` maps a style (``colwise``, ``rowwise``, ``sequence_parallel``,
``embedding_rowwise``, ...) to the entry fields it means per module kind;
:func:`entry_from_style` looks one up and refuses, with the reason, a style
with no faithful translation (expert-parallel styles, a style on a kind
of module it is not defined for). Mixture-of-experts blocks under tensor
parallelism: ``moe_tp_experts`` on the experts module, the packed 3-D expert
weights named by their own keys, each split on the intermediate dim its module's
layout declares (:mod:`tplower.plans.expert_layout`).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..core.support.errors import TPLowerError

__all__ = ["HF_STYLES", "PARAMETER_ONLY_STYLES", "check_style", "entry_from_style"]


# The placements every style is written with: PyTorch's own types, so a style's entry is read (typed) as it is made.
_R, _S0, _S1, _S_LAST, _SUM = Replicate(), Shard(0), Shard(1), Shard(-1), Partial("sum")


# Each style is written for one tensor-parallel axis ``a``; values follow transformers'
# ParallelInterface (integrations/tensor_parallel.py) and torch's ColwiseParallel/RowwiseParallel:
# a Linear's weight is [out, in], so colwise shards dim 0 and rowwise dim 1; rowwise adds its bias
# once after the reduction (transformers moves it to ``_bias`` for the same reason). Colwise places
# every other direct parameter of the module on dim 0 too (a per-output scale, as transformers'
# shard_param does for all of a module's parameters).

def _colwise(a: str, out: Placement) -> dict[str, Any]:
    return {"in_src": {"0": {a: _R}}, "in_dst": {"0": {a: _R}},
            "out_src": {"out": {a: _S_LAST}}, "out_dst": {"out": {a: out}},
            "params": {"weight": {a: _S0}, "bias": {a: _S0}, "*": {a: _S0}}}


def _rowwise(a: str, inp: Placement) -> dict[str, Any]:
    return {"in_src": {"0": {a: inp}}, "in_dst": {"0": {a: _S_LAST}},
            "out_src": {"out": {a: _SUM}}, "out_dst": {"out": {a: _R}},
            "params": {"weight": {a: _S1}, "bias": {a: _R}}, "deferred_bias": "bias"}


def _local_colwise(a: str) -> dict[str, Any]:
    return {"in_src": {"0": {a: _R}}, "in_dst": {"0": {a: _R}}, "in_grad": {"0": {a: _R}},
            "params": {"weight": {a: _S0}, "bias": {a: _S0}, "*": {a: _S0}}}


def _local_rowwise(a: str) -> dict[str, Any]:
    return {"out_src": {"out": {a: _SUM}}, "out_dst": {"out": {a: _SUM}},
            "params": {"weight": {a: _S1}, "bias": {a: _R}}}


def _sequence_parallel(a: str) -> dict[str, Any]:
    # torch's SequenceParallel: input and output sharded on the sequence dim (1), parameters
    # replicated; each rank's parameter gradient covers its tokens only, so it is reduced.
    return {"in_src": {"0": {a: _S1}}, "in_dst": {"0": {a: _S1}},
            "out_src": {"out": {a: _S1}}, "out_dst": {"out": {a: _S1}},
            "params": {"*": {a: _R}}, "param_grads": {"*": {a: _SUM}}}


def _embedding_hidden(a: str) -> dict[str, Any]:
    # weight dim -1 (the hidden dim) sharded, ids replicated, output gathered: transformers 5's
    # "embedding_colwise" (and its older RowwiseParallel on nn.Embedding); torch's ColwiseParallel
    # (output_layouts=Replicate()) for embeddings.
    return {"out_src": {"out": {a: _S_LAST}}, "out_dst": {"out": {a: _R}}, "params": {"weight": {a: _S1}}}


def _embedding_vocab(a: str) -> dict[str, Any]:
    # vocabulary-parallel: weight rows sharded, masked local lookup, partial outputs all-reduced;
    # transformers 5's "embedding_rowwise", torch's RowwiseParallel on nn.Embedding.
    return {"masked_lookup": "0", "out_src": {"out": {a: _SUM}}, "out_dst": {"out": {a: _R}},
            "params": {"weight": {a: _S0}}}


def _packed_colwise(a: str) -> dict[str, Any]:
    # a fused projection (gate and up packed along the output dim): each packed part sharded on its own,
    # so each rank holds its piece of every part (transformers' _StridedShard(0, split_factor=2)).
    return {**_colwise(a, _S_LAST), "packed": {"weight": 2, "bias": 2}}


_CONV1D = "tplower.families.conv1d:conv1d_forward"


def _conv1d_colwise(a: str) -> dict[str, Any]:
    # transformers' Conv1D stores its weight [in, out]: a column split shards weight dim 1 and bias dim 0; the
    # local compute sizes the output from the local weight (Conv1D.forward reshapes to the module's whole nf).
    # A fused projection (GPT-2's c_attn: q, k, v along out) adds packed: {weight: 3, bias: 3}.
    return {**_colwise(a, _S_LAST), "params": {"weight": {a: _S1}, "bias": {a: _S0}},
            "local_compute": _CONV1D}


def _conv1d_rowwise(a: str) -> dict[str, Any]:
    # a row split of a Conv1D shards weight dim 0 (its inputs); the bias is added once after the reduction
    return {**_rowwise(a, _S_LAST), "params": {"weight": {a: _S0}, "bias": {a: _R}},
            "local_compute": _CONV1D}


def _replicated_partial_grad(a: str) -> dict[str, Any]:
    # parameters replicated, their local gradients partial (a per-head q/k norm between colwise and
    # rowwise layers sees this rank's heads only): reduced in backward.
    return {"params": {"*": {a: _R}}, "param_grads": {"*": {a: _SUM}}}


def _moe_tp_experts(a: str) -> dict[str, Any]:
    # tensor parallelism inside the experts (transformers' MoeExpertsParallel): every rank runs its piece of
    # every expert's intermediate dim on all tokens, so the block's output is a partial sum, reduced once for
    # all experts. The hidden states ("0") and the routing weights ("2": top_k_weights) enter replicated; each
    # rank's gradient of them covers its piece of the experts only, so it is reduced in backward (the default
    # input gradient of an entry that shards a parameter: the expert weights, placed by their own plan keys;
    # experts left whole keep whole gradients). The routing indices ("1") are integers and pass as they are.
    # Experts that take their tokens already scaled by the router (Llama 4: forward(hidden_states)) have no "2".
    moved = {"0": {a: _R}, "2": {a: _R}}
    return {"in_src": moved, "in_dst": moved, "out_src": {"out": {a: _SUM}}, "out_dst": {"out": {a: _R}},
            "optional_inputs": ("2",)}


def _ep_dispatch_experts(a: str) -> dict[str, Any]:
    # expert parallelism (transformers' ep_dispatch_experts): the experts are sharded by index (their weights'
    # plan keys: grouped_gemm, Shard(0)); each rank takes its piece of the replicated tokens and their routing,
    # dispatches every slot to the rank holding its expert, and gathers the combined output back (uneven: the
    # token count need not divide). The module then holds E/n experts (num_experts divided).
    whole = {"0": {a: _R}, "1": {a: _R}, "2": {a: _R}}
    piece = {"0": {a: _S0}, "1": {a: _S0}, "2": {a: _S0}}
    return {"in_src": whole, "in_dst": piece, "out_src": {"out": {a: _S0}}, "out_dst": {"out": {a: _R}},
            "uneven": ("out",), "local_attrs": {"num_experts": "divide"}, "expert_dispatch": "num_experts"}


_ALL_REDUCE: dict[str, Any] = {"*": lambda a: {"out_src": {"out": {a: _SUM}}, "out_dst": {"out": {a: _R}}}}

#: style -> {module kind -> builder(axis) or the reason it has no faithful translation}
HF_STYLES: dict[str, dict[str, Any]] = {
    "colwise": {"linear": lambda a: _colwise(a, _S_LAST),
                "embedding": "use embedding_rowwise (vocabulary) or embedding_colwise (hidden dim) for embeddings",
                "other": "it is defined for nn.Linear modules only (a transformers Conv1D, weight [in, out], takes "
                         "conv1d_colwise)"},
    "colwise_rep": {"linear": lambda a: _colwise(a, _R)},
    # transformers 5.25's head-aligned styles (UnitColwiseParallel, on k_proj/v_proj): whole heads per rank, which
    # is plain colwise/rowwise where the head counts divide over tp; where they do not, transformers replicates
    # heads over a sub-mesh, and parallelize refuses the split attention (the head-count rule, plans.heads)
    "unit_colwise": {"linear": lambda a: _colwise(a, _S_LAST)},
    "unit_rowwise": {"linear": lambda a: _rowwise(a, _S_LAST)},
    "colwise_gather_output": {"linear": lambda a: _colwise(a, _R)},
    "rowwise": {"linear": lambda a: _rowwise(a, _S_LAST), "embedding": _embedding_hidden,
                "other": "it is defined for nn.Linear and nn.Embedding modules only (a transformers Conv1D, weight "
                         "[in, out], takes conv1d_rowwise)"},
    "rowwise_rep": {"linear": lambda a: _rowwise(a, _R), "embedding": _embedding_hidden},
    "rowwise_split_input": {"linear": lambda a: _rowwise(a, _R)},
    "local_colwise": {"linear": _local_colwise},
    # transformers' Conv1D (GPT-2): a linear layer with its weight stored [in, out] (tplower.families.conv1d)
    "conv1d_colwise": {"other": _conv1d_colwise},
    "conv1d_rowwise": {"other": _conv1d_rowwise},
    "local_rowwise": {"linear": _local_rowwise},
    "packed_colwise": {"linear": _packed_colwise,
                       "other": "a module key takes it on nn.Linear only; name a packed 3-D expert weight by its "
                                "own key (layers.*.mlp.experts.gate_up_proj)"},
    "moe_tp_experts": {"*": _moe_tp_experts},
    "ep_dispatch_experts": {"*": _ep_dispatch_experts},
    # an identity (zero-compute) expert among tensor-parallel experts: each rank gives 1/n of its input, so the
    # block's one reduction counts it once, and 1/n of the gradient, which the block's input reduces
    "moe_identity_expert": {"*": lambda a: {"share": ("out",)}},
    "embedding_rowwise": {"embedding": _embedding_vocab},
    "embedding_colwise": {"embedding": _embedding_hidden},
    "gather": _ALL_REDUCE,
    "all_reduce": _ALL_REDUCE,
    "sequence_parallel": {"*": _sequence_parallel},
    "replicate": {"*": lambda a: {"params": {"*": {a: _R}}}},
    "replicated_with_grad_allreduce": {"*": _replicated_partial_grad},
    "local_params": {"*": lambda a: {}},
    # multi-head latent attention: the rotary tail of kv_a_proj's output skips kv_b_proj (colwise)
    "mla_kv_a_proj": {"*": lambda a: {"partial_tail": "qk_rope_head_dim"}},
}
#: styles transformers uses only on a key that names one parameter (a packed 3-D expert weight), never a module
PARAMETER_ONLY_STYLES = frozenset({"packed_rowwise", "grouped_gemm"})

_EP = "transformers' expert-parallel router style; tplower's expert parallelism keeps the router replicated"
_UNFAITHFUL = {
    "local": "IsolatedParallel partitions expert weights by transformers' own expert-parallel rules",
    "local_packed_rowwise": "packed (fused gate/up) weights interleave shards; split the module instead",
    "packed_rowwise": "a module key cannot take it: name the packed expert weight by its own key",
    "grouped_gemm": "a module key cannot take it: name the expert weight by its own key",
    "ep_router": _EP,
    "isolated": "IsolatedParallel partitions expert weights by transformers' own expert-parallel rules",
}


def check_style(style: str, module: str = "?") -> None:
    """Refuse a style that is no key of :data:`HF_STYLES`: unknown, or one with no faithful translation (the message
    says why); ``module`` names the plan key in the message.

    Raises:
        TPLowerError: as said.
    """
    if style in HF_STYLES:
        return
    why = _UNFAITHFUL.get(style)
    if why is not None:
        raise TPLowerError(f"plan[{module!r}]: style {style!r} has no faithful translation: {why}")
    raise TPLowerError(f"plan[{module!r}]: style {style!r} is unknown; allowed: {', '.join(HF_STYLES)}")


def entry_from_style(style: str, kind: str = "linear", *, axis: str = "tp", module: str = "?") -> dict[str, Any]:
    """The entry fields of an HF ``tp_plan`` style for a module of ``kind`` on mesh axis ``axis``.

    Placements are PyTorch's ``Shard``/``Replicate``/``Partial``, named by ``axis`` (``{"tp": Shard(0)}``): a
    style is read as it is made, never as text.

    Args:
        style: a key of :data:`HF_STYLES`.
        kind: ``"linear"`` (``nn.Linear``), ``"embedding"`` (``nn.Embedding``) or ``"other"``.
        module: the module name, for messages.

    Raises:
        TPLowerError: an unknown style, or one without a faithful translation
            for this kind of module (the message says why).
    """
    check_style(style, module)
    table = HF_STYLES[style]
    rule = table.get(kind, table.get("*"))
    if rule is None:
        kinds = [k for k, v in table.items() if not isinstance(v, str)]
        rule = f"it is defined for {' and '.join(kinds)} modules only"
    if isinstance(rule, str):
        article = "an" if kind[:1] in "aeiou" else "a"
        raise TPLowerError(f"plan[{module!r}]: style {style!r} on {article} {kind} module has no faithful "
                           f"translation: {rule}")
    return rule(axis)  # type: ignore[no-any-return]
