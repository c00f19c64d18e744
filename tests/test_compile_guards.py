"""What a compiled parallelized model guards on: one number per boundary and per swap, each layout once.

Two gloo ranks parallelize a two-block model (per block: a norm the plan
leaves whole, a colwise ``up``, a rowwise ``down``), compile it
(``fullgraph``, the ``eager`` backend: guards do not depend on the backend)
and read dynamo's guard log. Every guard checked per call is time spent
outside the graph; before the layouts were interned each boundary exposed
its moves, parameter layouts and options (about 50 guarded attributes, and
``is`` guards evaluated in Python for its module and lowerer), and each norm
its slots and stack. The output is checked against one process.
"""

from __future__ import annotations

import copy
import io
import logging
import re
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import tplower
from tplower.testing import run_processes

PLAN = {f"blocks.{i}.{name}": style for i in range(2) for name, style in (("up", "colwise"), ("down", "rowwise"))}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _body(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    ref, x = _Model(), torch.randn(2, 3, 8)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = tplower.parallelize(copy.deepcopy(ref), mesh, PLAN)
    blocks = model.blocks
    shared = {name: blocks[0].get_submodule(name).forward.static is blocks[1].get_submodule(name).forward.static
              for name in ("up", "down")}
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logging.getLogger("torch._dynamo.guards.__guards").addHandler(handler)
    torch._logging.set_logs(guards=True)
    try:
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        with torch.no_grad():
            out = compiled(x)
            want = ref(x)
    finally:
        torch._logging.set_logs()
        logging.getLogger("torch._dynamo.guards.__guards").removeHandler(handler)
    sources = set(re.findall(r"source=(\S+?), accessed_by", buf.getvalue()))
    # what each boundary's forward and each hook object exposes to the trace, by attribute name
    forward_attrs = {m.group(1) for s in sources if (m := re.search(r"\.forward\.(\w+)$", s))}
    hook_attrs = {m.group(1) for s in sources if (m := re.search(r"_hooks\)\)\[\d+\]\](?:\.__self__)?\.(\w+)$", s))}
    layout_type = r"type=<class 'tplower\.runtime\.\w+\.(?:_Static|_SwapStatic)'>"
    layouts = set(re.findall(r"source=(\S+?), accessed_by=\S+, " + layout_type, buf.getvalue()))
    return {"shared": shared, "forward_attrs": sorted(forward_attrs), "hook_attrs": sorted(hook_attrs),
            "layouts": len(layouts), "err": float((out - want).abs().max())}


def test_a_boundary_and_a_swap_show_the_trace_one_number() -> None:
    for r in run_processes(2, _body, timeout=300):
        assert r["err"] <= 1e-5, r
        assert r["shared"] == {"up": True, "down": True}, r  # equal layouts in both blocks: one object
        # a boundary: the number of its layout (and its dict, checked for a ``__call__`` of its own)
        assert r["forward_attrs"] == ["__dict__", "static_key"], r
        # a norm's pre-hook (a bound method): the number of its slots; its forward hook: the number of the stack
        assert set(r["hook_attrs"]) == {"__dict__", "__func__", "__self__", "static_key", "key"}, r
        # up's layout, down's layout, the norm's own slots and its block's slots for it (the parent's swap):
        # four layout objects for eight hooked modules, each guarded once
        assert r["layouts"] == 4, r
