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
