"""What a compiled train step's graphs hold, tplower against ``parallelize_module``, side by side.

Feeds README.md ("When to choose it": 12 against 24 backward collectives) and docs/compile.md ("What the
graphs hold").

    python benchmarks/graph_counts.py                       # llama-tiny, aot_eager graphs (seconds)
    python benchmarks/graph_counts.py --inductor            # inductor's post-grad graphs (about a minute)
    python benchmarks/graph_counts.py --model all-minilm-l6-v2 --show

Two gloo ranks (``tp = 2``) each build the model twice, with
:func:`tplower.parallelize` (the model's plan; ``"auto"`` for llama-tiny) and
with ``parallelize_module`` on the same plan (:func:`tplower.run.paths.parallelize_dtensor`),
compile the loss of one train step of each with ``fullgraph=True``, run it
and its backward once and count the operators of the forward and backward graphs
(:mod:`tplower.bench.graphs`): collectives, waits, copies (clone, copy, pads,
``cat``, ``_to_copy``, ...), views and the rest, plus the copies next to each
collective. ``--show`` prints the graphs' code too.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from tplower.bench.graphs import (
    GraphCapture,
    copies_around_collectives,
    inductor_post_grad_capture,
    op_counts,
    op_name,
)
from tplower.testing import run_processes

CATEGORIES = ("collective", "wait", "copy", "view", "other")


def _variant_graphs(name: str, model_name: str, variant: str, inductor: bool) -> dict[str, Any]:
    """Compile and run one train step of ``variant`` (``tplower`` or ``dtensor``); its graphs' counts."""
    from compiled_steps import build  # the sibling script (this folder is on sys.path when run)

    from tplower.run.models import model_spec, sentences
    from tplower.run.tasks import make_batch, training_loss

    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    spec = model_spec(model_name)
    model, tok = build(model_name, mesh, variant)
    batch = make_batch(model_name, tok, sentences()[:8])

    def loss_of() -> torch.Tensor:
        return training_loss(spec.task, model, batch)

    torch._dynamo.reset()
    graphs: list[Any]
    if inductor:
        with inductor_post_grad_capture() as graphs:
            torch.compile(loss_of, backend="inductor", fullgraph=True)().backward()
    else:
        cap = GraphCapture()
        torch.compile(loss_of, backend=cap, fullgraph=True)().backward()
        graphs = cap.forward + cap.backward
    names = ["forward", "backward"] if len(graphs) == 2 else [f"graph{i}" for i in range(len(graphs))]
    out: dict[str, Any] = {}
    for label, g in zip(names, graphs, strict=True):
        around = copies_around_collectives(g)
        graph = g if isinstance(g, torch.fx.Graph) else g.graph
        names = Counter(op_name(n) for n in graph.nodes if n.op == "call_function")
        out[label] = {"counts": op_counts(g), "around": around, "names": dict(names),
                      "code": graph.python_code("self").src}
    return out


def _rank(rank: int, world: int, model_name: str, inductor: bool) -> dict[str, Any] | None:
    from tplower.conformance import quiet_dtensor_logs

    quiet_dtensor_logs()
    res = {v: _variant_graphs(v, model_name, v, inductor) for v in ("tplower", "dtensor")}
    return res if rank == 0 else None


def table(res: dict[str, Any]) -> str:
    """The side-by-side table of one run's counts (markdown)."""
    lines = ["| graph | variant | " + " | ".join(CATEGORIES) + " | copies next to collectives |",
             "|---|---|" + "---|" * (len(CATEGORIES) + 1)]
    for label in res["tplower"]:
        for variant in ("tplower", "dtensor"):
            g = res[variant].get(label)
            if g is None:
                continue
            near = sum(n for _, n in g["around"])
            lines.append(f"| {label} | {variant} | " + " | ".join(str(g["counts"][c]) for c in CATEGORIES)
                         + f" | {near} |")
    return "\n".join(lines)


def differences(res: dict[str, Any]) -> str:
    """Per graph, the operators whose counts differ between tplower and dtensor."""
    lines = []
    for label in res["tplower"]:
        a, b = res["tplower"][label]["names"], res["dtensor"].get(label, {}).get("names", {})
        diff = {k: (a.get(k, 0), b.get(k, 0)) for k in sorted(set(a) | set(b)) if a.get(k, 0) != b.get(k, 0)}
        lines.append(f"{label}: " + (", ".join(f"{k} {x} vs {y}" for k, (x, y) in diff.items()) or "same operators"))
    return "\n".join(lines)


def main() -> None:
    """Parse the options, run the two ranks, print the table (and the graphs with ``--show``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-tiny", choices=("llama-tiny", "all-minilm-l6-v2"))
    p.add_argument("--inductor", action="store_true", help="inductor's post-grad graphs (default: aot_eager's)")
    p.add_argument("--show", action="store_true", help="print each graph's code")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = run_processes(2, _rank, args.model, args.inductor, timeout=1800)[0]
    print(f"{args.model}, tp=2, {'inductor post-grad' if args.inductor else 'aot_eager'} graphs of one train step")
    print(table(res))
    print("\noperators whose counts differ (tplower vs dtensor):")
    print(differences(res))
    if args.show:
        for variant in ("tplower", "dtensor"):
            for label, g in res[variant].items():
                print(f"\n### {variant} {label}: collectives {g['around']}\n{g['code']}")


if __name__ == "__main__":
    main()
