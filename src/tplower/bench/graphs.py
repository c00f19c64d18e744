"""What ``torch.compile`` makes of a step: capture its ATen graphs and count collectives, copies and the rest.

Once a step is compiled, per-call Python overhead is traced away; what is
left is what the graph holds. :class:`GraphCapture` is a ``torch.compile``
backend that keeps the forward and backward graphs AOT autograd produces
(``aot_eager``'s graphs: functionalized ATen) and runs them as they are;
:func:`inductor_post_grad_capture` keeps inductor's post-grad graphs instead.
:func:`op_counts` sorts every call of a graph into one of:

* ``collective``: an ``_c10d_functional`` / ``c10d`` operator (``wait_tensor``
  apart, as ``wait``);
* ``copy``: an operator that writes a new buffer from another one
  (``clone``, ``copy``/``copy_``, ``_to_copy``, ``cat``, ``constant_pad_nd``,
  ``*_scatter``, ``*_copy``, ``new_zeros``/``zeros``/``full`` that a pad
  fills, ``index_select`` of blocks);
* ``view``: an operator that returns a view (``view``, ``permute``,
  ``slice``, ...: free);
* ``other``: the model's own compute.

:func:`copies_around_collectives` counts, for each collective, the copies
that feed it or read its result (directly or through views): the overhead a
lowering adds around the collective itself.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

__all__ = ["GraphCapture", "copies_around_collectives", "inductor_post_grad_capture", "op_category", "op_counts",
           "op_name"]

_COPY_OPS = frozenset((
    "clone", "copy", "copy_", "_to_copy", "cat", "constant_pad_nd", "contiguous", "new_zeros", "new_empty",
    "new_full", "zeros", "zeros_like", "empty", "empty_like", "full", "full_like", "index_select", "fill_",
    "fill", "stack", "pad", "index_copy",
))
_VIEW_OPS = frozenset((
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "slice", "select", "narrow", "unsqueeze",
    "squeeze", "expand", "as_strided", "alias", "split", "split_with_sizes", "chunk", "unflatten", "flatten",
    "movedim", "view_as", "unbind", "detach", "_reshape_alias", "lift_fresh", "getitem",
))


def op_name(node: fx.Node) -> str:
    """``namespace.name`` of a ``call_function`` node's target (``aten.clone``, ``_c10d_functional.all_reduce``).

    Overload names are dropped; a Python callable gives its ``__name__`` (``getitem``).
    """
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"{target._qualified_op_name.replace('::', '.')}"
    return getattr(target, "__name__", str(target))


def op_category(node: fx.Node) -> str | None:
    """``collective``, ``wait``, ``copy``, ``view`` or ``other`` for a ``call_function`` node; ``None`` otherwise."""
    if node.op != "call_function":
        return None
    name = op_name(node)
    ns, _, op = name.rpartition(".")
    if ns in ("_c10d_functional", "c10d", "_c10d_functional_autograd", "c10d_functional"):
        return "wait" if op == "wait_tensor" else "collective"
    if op in _COPY_OPS or op.endswith("_scatter") or (op.endswith("_copy") and op != "index_copy"):
        return "copy"
    if op in _VIEW_OPS:
        return "view"
    return "other"


def _graph(g: fx.GraphModule | fx.Graph) -> fx.Graph:
    return g.graph if isinstance(g, fx.GraphModule) else g


def op_counts(g: fx.GraphModule | fx.Graph) -> dict[str, int]:
    """How many calls of each category (:func:`op_category`) a graph holds; every category present."""
    counts = Counter({"collective": 0, "wait": 0, "copy": 0, "view": 0, "other": 0})
    for node in _graph(g).nodes:
        cat = op_category(node)
        if cat is not None:
            counts[cat] += 1
    return dict(counts)


def _through_views(node: fx.Node, *, up: bool) -> Iterator[fx.Node]:
    """Nodes that feed ``node`` (``up``) or read it (not ``up``), looking through views and waits."""
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes if up else node.users)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if op_category(n) in ("view", "wait"):
            stack.extend(n.all_input_nodes if up else n.users)
        else:
            yield n


def copies_around_collectives(g: fx.GraphModule | fx.Graph) -> list[tuple[str, int]]:
    """For each collective of a graph in graph order: its op name and the copies next to it.

    A copy is next to a collective when it produces one of its inputs or
    reads its result, directly or through views and ``wait_tensor`` (a
    ``copy_`` writing the result back into a buffer counts). The ideal
    lowering has 0 for every collective.
    """
    out: list[tuple[str, int]] = []
    for node in _graph(g).nodes:
        if op_category(node) != "collective":
            continue
        near = {n for n in _through_views(node, up=True) if op_category(n) == "copy"}
        near |= {n for n in _through_views(node, up=False) if op_category(n) == "copy"}
        out.append((op_name(node), len(near)))
    return out


@dataclass
class GraphCapture:
    """A ``torch.compile`` backend that keeps AOT autograd's forward and backward graphs and runs them as is.

    ``torch.compile(fn, backend=GraphCapture())``: each compiled frame adds
    its forward graph to :attr:`forward` and, at its first backward, its
    backward graph to :attr:`backward`; :attr:`frames` counts the frames
    compiled (a recompile adds one).
    """

    forward: list[fx.GraphModule] = field(default_factory=list)
    backward: list[fx.GraphModule] = field(default_factory=list)
    frames: int = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        """The backend entry ``torch.compile`` calls once per compiled frame."""
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func  # type: ignore[attr-defined]

        self.frames += 1

        def keep(into: list[fx.GraphModule]) -> Any:
            def compiler(g: fx.GraphModule, _inputs: list[Any]) -> Any:
                into.append(g)
                return make_boxed_func(g.forward)
            return compiler

        return aot_autograd(fw_compiler=keep(self.forward), bw_compiler=keep(self.backward))(gm, example_inputs)


@contextlib.contextmanager
def inductor_post_grad_capture() -> Iterator[list[fx.Graph]]:
    """Within the block, every graph inductor compiles is copied, post-grad, into the yielded list.

    A compiled train step adds its forward graph first, then its backward.
    The FX graph cache is off inside the block (a cache hit would skip the
    passes that capture).
    """
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    graphs: list[fx.Graph] = []

    class _Keep(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            copy = fx.Graph()
            copy.graph_copy(graph, {})
            graphs.append(copy)

        def uuid(self) -> Any:
            return None

    with config.patch(post_grad_custom_post_pass=_Keep(), fx_graph_cache=False):
        yield graphs
