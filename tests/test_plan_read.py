"""A plan is read once: the first stage turns its text into PyTorch's placement types, later stages take those.

``parallelize`` reads each placement string of a user's plan exactly once (counted with a ``sys.setprofile``
trace of :func:`tplower.parse_placement`, against the strings counted by hand in the plan below), an entry built
with text holds it read, and a spelling error is still reported with the plan key and the text as written.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

import tplower
from tplower import BoundaryEntry, TPLowerError
from tplower.core.language import placements
from tplower.testing import run_threaded


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 6), nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


#: a plan written as text: 1 placement string under "up", 6 under "down" (the comma list "R" is one), 7 in all
PLAN: dict[str, Any] = {
    "up": {"style": "colwise", "params": {"weight": {"tp": "S(0)"}}},
    "down": {"in_src": {"0": {"tp": "S(-1)"}}, "in_dst": {"0": {"tp": "S(-1)"}}, "out_src": {"out": {"tp": "P(sum)"}},
             "out_dst": {"out": "R"}, "params": {"weight": {"tp": "S(1)"}, "bias": {"tp": "R"}},
             "deferred_bias": "bias"},
}
STRINGS = 7


def _texts_parsed(rank: int, world: int) -> tuple[int, list[str]]:
    """``parallelize(_MLP(), mesh, PLAN)`` traced: how many ``parse_placement`` calls were given a string, and
    the parameters' placements it installed."""
    code = placements.parse_placement.__code__
    seen = [0]

    def prof(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code is code and isinstance(frame.f_locals.get("text"), str):
            seen[0] += 1

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = _MLP()
    sys.setprofile(prof)
    try:
        tplower.parallelize(model, mesh, PLAN)
    finally:
        sys.setprofile(None)
    placed = [f"{n}: {tplower.format_placements(p.placements)}" for n, p in model.named_parameters()]
    return seen[0], placed


def test_parallelize_parses_each_placement_string_of_a_plan_once() -> None:
    [(parsed, placed)] = run_threaded(1, _texts_parsed)
    assert parsed == STRINGS
    assert placed == ["up.weight: S(0)", "up.bias: S(0)", "down.weight: S(1)", "down.bias: R"]


def test_an_entry_made_with_text_holds_it_read() -> None:
    entry = BoundaryEntry(in_src={"x": {"tp": "S(1)"}}, out_src={"out": "P(sum),R"}, params={"weight": [Shard(0)]})
    assert entry.in_src == {"x": {"tp": Shard(1)}}
    assert entry.out_src == {"out": (Partial("sum"), Replicate())}
    assert entry.params == {"weight": (Shard(0),)}
    with pytest.raises(TPLowerError, match=r"BoundaryEntry.in_dst\['x'\]: placement='S\(x\)' is not a valid"):
        BoundaryEntry(in_dst={"x": {"tp": "S(x)"}})


def _refusal(rank: int, world: int, plan: dict[str, Any]) -> str:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with pytest.raises(TPLowerError) as refused:
        tplower.parallelize(_MLP(), mesh, plan)
    return str(refused.value)


@pytest.mark.parametrize(("plan", "said"), [
    ({"down": {"params": {"weight": {"tp": "S(x)"}}}}, "plan['down'].params['weight']: placement='S(x)' is not"),
    ({"d*": {"out_src": {"out": "P(mean)"}}}, "plan['d*'].out_src['out']: placement='P(mean)': reduce op 'mean'"),
    ({"up": {"in_src": {"0": {"tq": "R"}}}}, "plan['up'].in_src['0']: mesh axis 'tq' is not in the mesh"),
    ({"up": "colwize"}, "plan['up']: style 'colwize' is unknown"),
], ids=["placement", "reduce op", "axis", "style"])
def test_a_spelling_error_names_the_key_and_the_text(plan: dict[str, Any], said: str) -> None:
    [message] = run_threaded(1, _refusal, plan)
    assert said in message, message
