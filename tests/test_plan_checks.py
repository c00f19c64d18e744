"""A new user's first plan mistakes, refused at ``parallelize`` before anything changes, each with its fix.

* A misspelled key (``upp`` for ``up``) is an error naming the key and the closest names the model has (it was
  a warning, then ``mat1 and mat2 shapes cannot be multiplied`` in the forward); ``strict=False`` keeps the
  warning. The message is the one ``tplower run`` gives (:func:`tplower.run.models.check_plan_modules`). Keys
  a transformers model's own plan ships for layers its config lacks name nothing silently, given as ``"auto"``
  or as the ``tp_plan`` mapping itself.
* A plan that splits some of an attention's query/key/value projections and not the others (it ended in
  ``The size of tensor a (2) must match the size of tensor b (4)``) is refused naming the missing siblings and
  the keys to add. A plan that splits all three, a fused projection, or siblings replicated on purpose pass.

Expected messages are written out by hand from the toy models' module names.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tplower import TPLowerError
from tplower.nn.parallelize import parallelize
from tplower.nn.resolve import resolve_plan
from tplower.plans.keys import unmatched_key_message
from tplower.testing import run_threaded

FIX = "Fix the key (module names as in model.named_modules(), '*' for one name part such as a layer index)"


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"mlp": _MLP()}) for _ in range(2))


def test_the_message_names_the_key_the_closest_names_and_what_is_there() -> None:
    names = [n for n, _ in _Toy().named_modules()] + [n for n, _ in _Toy().named_parameters()]
    assert unmatched_key_message("layers.*.mlp.upp", names, "_Toy") == (
        "plan key 'layers.*.mlp.upp' names no module of _Toy; did you mean 'layers.*.mlp.up'? layers.*.mlp has: "
        f"down, up. {FIX}"
    )
    assert unmatched_key_message("layer.*.mlp.up", names, "_Toy") == (
        f"plan key 'layer.*.mlp.up' names no module of _Toy; did you mean 'layers.*.mlp.up'? top-level names: "
        f"layers. {FIX}"
    )
    # a key without its prefix: the names that end as it does, layer indices written '*'
    assert unmatched_key_message("mlp.down", names, "_Toy").startswith(
        "plan key 'mlp.down' names no module of _Toy; did you mean 'layers.*.mlp.down'?"
    )
    assert unmatched_key_message("layers.0.mlp.up.wieght", names, "_Toy") == (
        "plan key 'layers.0.mlp.up.wieght' names no module of _Toy; did you mean 'layers.0.mlp.up.weight'? "
        f"layers.0.mlp.up has: bias, weight. {FIX}"
    )


def _misspelled(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = _MLP()
    with pytest.raises(TPLowerError) as exc:
        parallelize(model, mesh, {"upp": "colwise", "down": "rowwise"})
    untouched = not any(isinstance(p, DTensor) for p in model.parameters())
    loose = parallelize(_MLP(), mesh, {"upp": "colwise", "down": "rowwise"}, strict=False)
    return {
        "msg": str(exc.value),
        "untouched": untouched,
        "loose": {n: type(p).__name__ for n, p in loose.named_parameters()},
    }


def test_a_misspelled_key_is_an_error_and_strict_false_keeps_the_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:  # the ranks are threads: their warnings come here
        warnings.simplefilter("always")
        got = run_threaded(2, _misspelled)
    for rank in got:
        assert rank["msg"] == (
            f"plan key 'upp' names no module of _MLP; did you mean 'up'? top-level names: down, up. "
            f"{FIX}; or pass strict=False to leave keys that name nothing out with a warning"
        )
        assert rank["untouched"]
        assert rank["loose"] == {
            "up.weight": "DTensor",
            "up.bias": "DTensor",
            "down.weight": "DTensor",
            "down.bias": "DTensor",
        }
    said = [str(w.message) for w in caught if "matches no module" in str(w.message)]
    assert said and all(
        m == "tplower: plan key 'upp' matches no module; did you mean 'up'? top-level names: down, up" for m in said
    )


def test_tplower_run_gives_the_same_message() -> None:
    transformers = pytest.importorskip("transformers")
    from tplower.run.models import check_plan_modules

    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
    )
    with pytest.raises(TPLowerError) as exc:
        check_plan_modules(bert, {"encoder.layer.*.attention.self.querry": "colwise"})
    assert str(exc.value) == (
        "plan key 'encoder.layer.*.attention.self.querry' names no module of BertModel; did you mean "
        "'encoder.layer.*.attention.self.query'? encoder.layer.*.attention.self has: dropout, key, query, value. "
        f"{FIX}"
    )


def _shipped(rank: int, world: int, ref: nn.Module) -> int:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    resolved = resolve_plan(copy.deepcopy(ref), mesh, dict(ref.tp_plan))  # strict: the shipped plan as a mapping
    return len(resolved.modules)


def test_a_shipped_plan_given_as_a_mapping_never_trips_the_check() -> None:
    """Qwen3-MoE ships dense-MLP keys (``mlp.gate_proj``) that this all-experts config has no module for."""
    pytest.importorskip("transformers")
    from tplower.run.hf_table import architectures, tiny_model

    ref = tiny_model(architectures(["qwen3_moe"])[0])
    assert "model.layers.*.mlp.gate_proj" in ref.tp_plan
    assert not any(n.endswith("mlp.gate_proj") for n, _ in ref.named_modules())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planned = run_threaded(2, _shipped, ref)[0]
    assert planned > 0 and not [str(w.message) for w in caught if "matches no module" in str(w.message)]


class _Attention(nn.Module):
    def __init__(self, names: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj")) -> None:
        super().__init__()
        for name in names:
            self.add_module(name, nn.Linear(8, 8))
        self.o_proj = nn.Linear(8, 8)


class _Layers(nn.Module):
    def __init__(self, names: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj")) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"self_attn": _Attention(names)}) for _ in range(2))


class _Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(8, 24), nn.Linear(8, 8)


CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "q_only": (_Layers, {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}),
    "query_key": (
        lambda: _Layers(("query", "key", "value")),
        {"layers.*.self_attn.query": "colwise", "layers.*.self_attn.key": "colwise"},
    ),
    "replicated": (
        _Layers,
        {
            "layers.*.self_attn.q_proj": "colwise",
            "layers.*.self_attn.k_proj": "replicate",
            "layers.*.self_attn.v_proj": "replicate",
            "layers.*.self_attn.o_proj": "rowwise",
        },
    ),
    "all_three": (
        _Layers,
        {
            "layers.*.self_attn.q_proj": "colwise",
            "layers.*.self_attn.k_proj": "colwise",
            "layers.*.self_attn.v_proj": "colwise",
            "layers.*.self_attn.o_proj": "rowwise",
        },
    ),
    "fused": (_Fused, {"qkv": "colwise", "o": "rowwise"}),
}
REFUSED = {
    "q_only": "plan: attention 'layers.*.self_attn' splits ['q_proj'] over axis 'tp' but not its sibling projections "
    "['k_proj', 'v_proj'] (each rank would hold heads / tp queries against every head's keys and values: "
    "mismatched shapes in the attention); add 'layers.*.self_attn.k_proj': 'colwise', "
    "'layers.*.self_attn.v_proj': 'colwise' to the plan, or leave ['q_proj'] whole",
    "query_key": "plan: attention 'layers.*.self_attn' splits ['query', 'key'] over axis 'tp' but not its sibling "
    "projections ['value']",
}


def _siblings(rank: int, world: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for name, (make, plan) in CASES.items():
        model = make()
        try:
            parallelize(model, mesh, plan)
            out[name] = "accepted"
        except TPLowerError as exc:
            assert not any(isinstance(p, DTensor) for p in model.parameters()), name
            out[name] = str(exc)
    return out


def test_an_attention_split_in_part_is_refused_naming_the_missing_siblings() -> None:
    for got in run_threaded(2, _siblings):
        assert got["q_only"] == REFUSED["q_only"]
        assert got["query_key"].startswith(REFUSED["query_key"])
        # k and v replicated on purpose (the plan says so, e.g. one key/value head): the plan's choice, not a
        # forgotten key
        assert (got["replicated"], got["all_three"], got["fused"]) == ("accepted", "accepted", "accepted")


ATTN, MLP = "model.layers.*.self_attn", "model.layers.*.mlp"
#: tiny Llama's own plan (``plan_for(model, "auto")``) with one edit each, as a user makes it
EDITS: dict[str, tuple[tuple[str, str | None], ...]] = {
    "no_o_proj": ((f"{ATTN}.o_proj", None),),
    "no_down_proj": ((f"{MLP}.down_proj", None),),
    "q_rowwise": ((f"{ATTN}.q_proj", "rowwise"),),
    "no_gate_proj": ((f"{MLP}.gate_proj", None),),
    "no_gate_up": ((f"{MLP}.gate_proj", None), (f"{MLP}.up_proj", None)),
    "o_replicated": ((f"{ATTN}.o_proj", "replicate"),),
    # the refusal's other fix: q, k and v gathered whole, so the unplanned o_proj meets whole heads
    "gathered": ((f"{ATTN}.o_proj", None), *((f"{ATTN}.{n}_proj", "colwise_gather_output") for n in "qkv")),
    "vocab_parallel": (("lm_head", "colwise"),),  # logits left sharded for vocab_parallel_cross_entropy
}
_QKV = "'model.layers.*.self_attn.q_proj', 'model.layers.*.self_attn.k_proj', 'model.layers.*.self_attn.v_proj'"
_UP = "'model.layers.*.mlp.gate_proj', 'model.layers.*.mlp.up_proj'"
PARTNER_REFUSED = {
    "no_o_proj": f"plan: {_QKV} are colwise over axis 'tp': each rank gives 1/tp of the output features, and that "
    "split output reaches 'model.layers.*.self_attn.o_proj', which is not in the plan (mismatched shapes at its first "
    "forward); add 'model.layers.*.self_attn.o_proj': 'rowwise' (the colwise layer's rowwise partner), or make the "
    f"colwise output whole: 'colwise_gather_output' (torch's use_local_output=False) for {_QKV}",
    "no_down_proj": f"plan: {_UP} are colwise over axis 'tp': each rank gives 1/tp of the output features, and that "
    "split output reaches 'model.layers.*.mlp.down_proj', which is not in the plan (mismatched shapes at its first "
    "forward); add 'model.layers.*.mlp.down_proj': 'rowwise' (the colwise layer's rowwise partner), or make the "
    f"colwise output whole: 'colwise_gather_output' (torch's use_local_output=False) for {_UP}",
    "q_rowwise": "plan: attention 'model.layers.*.self_attn' splits ['k_proj', 'v_proj'] colwise over axis 'tp' (each "
    "rank gives 1/tp of their output features) but its sibling projections give whole features (q_proj rowwise (its "
    "output reduced whole)): mismatched shapes where the model combines them; give them the same split "
    "('model.layers.*.self_attn.q_proj': 'colwise'), or leave ['k_proj', 'v_proj'] whole",
    "no_gate_proj": "plan: MLP 'model.layers.*.mlp' splits ['up_proj'] colwise over axis 'tp' (each rank gives 1/tp "
    "of their output features) but its sibling projections give whole features (gate_proj not in the plan): "
    "mismatched shapes where the model combines them; give them the same split ('model.layers.*.mlp.gate_proj': "
    "'colwise'), or leave ['up_proj'] whole",
    "no_gate_up": "plan: 'model.layers.*.mlp.down_proj' in 'model.layers.*.mlp' is rowwise over axis 'tp': it takes "
    "1/tp of its input features, but its producers give whole features (model.layers.*.mlp.gate_proj not in the "
    "plan; model.layers.*.mlp.up_proj not in the plan); split them ('model.layers.*.mlp.gate_proj': 'colwise', "
    "'model.layers.*.mlp.up_proj': 'colwise'), or let 'model.layers.*.mlp.down_proj' split its whole input: "
    "'rowwise_split_input'",
    "o_replicated": f"plan: {_QKV} are colwise over axis 'tp': each rank gives 1/tp of the output features, and that "
    "split output reaches 'model.layers.*.self_attn.o_proj', which takes whole input features as placed (mismatched "
    "shapes at its first forward); add 'model.layers.*.self_attn.o_proj': 'rowwise' (the colwise layer's rowwise "
    f"partner), or make the colwise output whole: 'colwise_gather_output' (torch's use_local_output=False) for {_QKV}",
}


def _edited(rank: int, world: int, ref: nn.Module) -> dict[str, Any]:
    import tplower

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}
    for name, edits in EDITS.items():
        plan = tplower.plan_for(ref, "auto")
        for key, value in edits:
            plan.pop(key) if value is None else plan.__setitem__(key, value)
        model = copy.deepcopy(ref)
        try:
            tp = parallelize(model, mesh, plan)
        except TPLowerError as exc:
            out[name] = (str(exc), any(isinstance(p, DTensor) for p in model.parameters()))
            continue
        logits = tp(input_ids=ids).logits.detach()
        out[name] = float((logits - ref(input_ids=ids).logits.detach()).abs().max()) if name == "gathered" else \
            tuple(logits.shape)
    return out


def test_an_edited_plan_that_breaks_a_colwise_rowwise_pair_is_refused_naming_the_fix() -> None:
    """``plan_for(model, "auto")`` with a layer's partner deleted or changed: refused at ``parallelize`` on every
    rank, the model unchanged (it was ``mat1 and mat2 shapes cannot be multiplied`` in the first forward); the
    refusal's other fix (the colwise outputs gathered) gives one process's logits; a colwise output head (logits
    left sharded on purpose) is no pair and passes."""
    pytest.importorskip("transformers")
    from tplower.run.hf_configs import architectures, tiny_model

    ref = tiny_model(architectures(["llama"])[0])
    for got in run_threaded(2, _edited, ref):
        for name, message in PARTNER_REFUSED.items():
            assert got[name] == (message, False), name
        assert isinstance(got["gathered"], float) and got["gathered"] <= 1e-5, got["gathered"]
        assert got["vocab_parallel"] == (2, 8, ref.config.vocab_size // 2)
