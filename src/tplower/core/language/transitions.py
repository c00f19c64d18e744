"""Pure planning of placement transitions: no process group, no tensors.

One table (:func:`classify_axis`) says which collective moves a tensor from
one placement to another on a single mesh axis. :func:`plan_transition`
orders those single-axis steps for a whole mesh, forward and backward. The
backward of a transition is itself a transition, from the gradient's
placement back to the source with every ``Partial`` read as ``Replicate``
(DTensor's ``Redistribute.backward`` rule), so the same table serves both.
The module is one idea, the planner (the table, the step order, the shapes
and bytes of each step), kept whole so that the table reads in one place.

Step order follows DTensor's greedy planner (torch 2.13,
``DTensorRedistributePlanner.generate_greedy_transform_infos``): when the
source has any shard, axes are first visited inner to outer, replicating a
shard whose nesting on the same tensor dim differs between source and
target; then outer to inner for what is left. Then local chunks and
``all_reduce`` steps move ahead of collectives on other axes that they
commute with (a chunk of another tensor dim; a reduction past a gather), so
those collectives move less data. The logical shape an axis
shards from is the global shape cut by the source's shards on the axes
before it, as DTensor computes it, so uneven shards pad and unpad alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..support.argcheck import check_placement, check_placement_seq, check_shape
from ..support.errors import TPLowerError
from ..support.words import count
from .placements import REDUCE_OPS, check_reduce_ops, format_placement, format_placements, replicate_partials

__all__ = [
    "KINDS",
    "Step",
    "TransitionPlan",
    "chunk_size_and_offset",
    "classify_axis",
    "global_shape_from_local",
    "local_shape",
    "plan_steps",
    "plan_transition",
]

#: Every kind of single-axis step, named after the collective it issues.
KINDS: tuple[str, ...] = (
    "identity",
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "chunk",
    "partition",
    "zero_fill",
)

Shape = tuple[int, ...]
Move = tuple[int, Placement, Placement]  # (mesh axis, src, dst)


def chunk_size_and_offset(size: int, n: int, index: int) -> tuple[int, int]:
    """Size and offset of piece ``index`` of ``size`` elements cut in ``n``.

    ``torch.chunk`` semantics, as DTensor's ``Shard``: every piece has
    ``ceil(size / n)`` elements except the last non-empty one; trailing
    pieces may be empty. Returns ``(length, offset)``; an empty piece has
    offset ``size``.
    """
    c = -(-size // n) if n > 0 else 0
    start = min(c * index, size)
    return min(c, size - start), start


def local_shape(global_shape: Sequence[int], placements: Sequence[Placement],
                mesh_shape: Sequence[int], coord: Sequence[int]) -> Shape:
    """Local shape of a tensor on the rank at mesh coordinate ``coord``.

    Shards apply in mesh-axis order (axis 0 cuts first), each with
    ``torch.chunk`` semantics, as DTensor's ``compute_local_shape``.
    """
    shape = list(global_shape)
    for p, n, c in zip(placements, mesh_shape, coord, strict=True):
        if isinstance(p, Shard):
            shape[p.dim] = chunk_size_and_offset(shape[p.dim], n, c)[0]
    return tuple(shape)


def global_shape_from_local(local: Sequence[int], placements: Sequence[Placement],
                            mesh_shape: Sequence[int]) -> Shape:
    """Global shape implied by a local shape when every shard is even.

    Each sharded dim is multiplied by the sizes of the axes that shard it,
    as ``DTensor.from_local`` does without an explicit ``shape``.
    """
    shape = list(local)
    for p, n in zip(placements, mesh_shape, strict=True):
        if isinstance(p, Shard):
            shape[p.dim] *= n
    return tuple(shape)


@dataclass(frozen=True)
class Step:
    """One single-axis move of a plan; prints like ``S(0)->R on axis 1: all_gather(dim=0)``.

    Attributes:
        axis: mesh dim index the collective runs over.
        src, dst: placements on that axis before and after.
        kind: one of :data:`KINDS`.
        tensor_dim: dim gathered, scattered, chunked or zero-filled; for
            ``all_to_all`` the dim that was sharded.
        dst_dim: for ``all_to_all``, the dim that becomes sharded.
        reduce_op: for ``all_reduce``, ``reduce_scatter``, ``partition`` and
            ``zero_fill``.
        group_size: ranks on the axis.
        rank: this rank's index on the axis (its mesh coordinate).
        logical_shape: the tensor shape this axis shards from (DTensor's
            logical shape), used to pad and unpad uneven shards.
        in_shape, out_shape: this rank's local shape before and after.
        send_elems: elements this rank sends (ring algorithms: all_gather and
            reduce_scatter ``(n-1)`` padded chunks, all_reduce
            ``2(n-1)/n`` of the tensor, all_to_all ``(n-1)/n`` of it).
    """

    axis: int
    src: Placement
    dst: Placement
    kind: str
    group_size: int
    rank: int
    logical_shape: Shape
    in_shape: Shape
    out_shape: Shape
    tensor_dim: int | None = None
    dst_dim: int | None = None
    reduce_op: str | None = None
    send_elems: int = 0

    def op_str(self) -> str:
        """The collective with its arguments, e.g. ``reduce_scatter(dim=0, op=sum)``."""
        args = []
        if self.kind == "all_to_all":
            args.append(f"dim={self.tensor_dim}->{self.dst_dim}")
        elif self.tensor_dim is not None:
            args.append(f"dim={self.tensor_dim}")
        if self.reduce_op is not None:
            args.append(f"op={self.reduce_op}")
        return f"{self.kind}({', '.join(args)})"

    def __str__(self) -> str:
        return f"{format_placement(self.src)}->{format_placement(self.dst)} on axis {self.axis}: {self.op_str()}"


def classify_axis(src: Placement, dst: Placement) -> tuple[str, int | None, int | None, str | None]:
    """The single-axis table: ``(kind, tensor_dim, dst_dim, reduce_op)`` for ``src -> dst``.

    ==============  ==================  ===================================
    ``src -> dst``  kind                meaning on one device
    ==============  ==================  ===================================
    ``X -> X``      identity            nothing moves
    ``S(d) -> R``   all_gather(d)       concatenate the pieces along d
    ``P(op) -> R``  all_reduce(op)      reduce the partial values
    ``P(op)->S(d)`` reduce_scatter      reduce, keep this rank's piece
    ``R -> S(d)``   chunk(d)            keep this rank's piece, no traffic
    ``S(i)->S(j)``  all_to_all(i->j)    trade pieces of j for pieces of i
    ``R -> P(op)``  partition(op)       sum: value/n; avg/max/min: value
    ``S(d)->P(op)`` zero_fill(d, op)    place the piece, fill the rest with
                                        the reduce op's neutral element
    ==============  ==================  ===================================

    Raises:
        TPLowerError: ``P(x) -> P(y)`` with ``x != y``, a reduce op outside
            :data:`REDUCE_OPS`, or a placement that is not Shard, Replicate
            or Partial.
        TypeError: ``src`` or ``dst`` is not a ``Placement`` object (a
            string: parse it with :func:`~tplower.parse_placement`).
    """
    for name, p in (("src", src), ("dst", dst)):
        check_placement(p, name, "classify_axis")
        if not isinstance(p, Shard | Replicate | Partial):
            raise TPLowerError(f"placement {p!r} is not Shard, Replicate or Partial; tplower cannot lower it")
        if isinstance(p, Partial) and p.reduce_op not in REDUCE_OPS:
            raise TPLowerError(f"Partial({p.reduce_op!r}) is not lowerable; reduce ops: {', '.join(REDUCE_OPS)}")
    if src == dst:
        return "identity", None, None, None
    if isinstance(dst, Replicate):
        if isinstance(src, Shard):
            return "all_gather", src.dim, None, None
        assert isinstance(src, Partial)
        return "all_reduce", None, None, src.reduce_op
    if isinstance(dst, Shard):
        if isinstance(src, Partial):
            return "reduce_scatter", dst.dim, None, src.reduce_op
        if isinstance(src, Replicate):
            return "chunk", dst.dim, None, None
        assert isinstance(src, Shard)
        return "all_to_all", src.dim, dst.dim, None
    assert isinstance(dst, Partial)
    if isinstance(src, Replicate):
        return "partition", None, None, dst.reduce_op
    if isinstance(src, Shard):
        return "zero_fill", src.dim, None, dst.reduce_op
    raise TPLowerError(
        f"{format_placement(src)} -> {format_placement(dst)}: a Partial cannot change its reduce op; "
        "reduce to R first"
    )


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _send_elems(kind: str, n: int, in_shape: Shape, logical: Shape, tdim: int | None) -> int:
    if kind == "all_reduce":
        return 2 * (n - 1) * _numel(in_shape) // n
    if kind == "all_gather" and tdim is not None:
        c = -(-logical[tdim] // n)
        return (n - 1) * _numel(in_shape[:tdim] + (c,) + in_shape[tdim + 1:])
    if kind == "reduce_scatter" and tdim is not None:
        c = -(-in_shape[tdim] // n)
        return (n - 1) * _numel(in_shape[:tdim] + (c,) + in_shape[tdim + 1:])
    if kind == "all_to_all":
        return (n - 1) * _numel(in_shape) // n
    return 0


def _logical_shapes(global_shape: Shape, src: Sequence[Placement], mesh_shape: Sequence[int],
                    coord: Sequence[int]) -> list[Shape]:
    shapes = [global_shape]
    for p, n, c in zip(src, mesh_shape, coord, strict=True):
        cur = list(shapes[-1])
        if isinstance(p, Shard):
            cur[p.dim] = chunk_size_and_offset(cur[p.dim], n, c)[0]
        shapes.append(tuple(cur))
    return shapes


def _greedy_order(src: Sequence[Placement], dst: Sequence[Placement]) -> list[Move]:
    cur, moves = list(src), []
    if any(isinstance(p, Shard) for p in src):
        for i in reversed(range(len(cur))):
            target = dst[i]
            if isinstance(target, Shard):
                before_cur = [k for k in range(i) if cur[k] == Shard(target.dim)]
                before_dst = [k for k in range(i) if dst[k] == Shard(target.dim)]
                if before_cur != before_dst:
                    target = Replicate()
            if cur[i] != target:
                moves.append((i, cur[i], target))
                cur[i] = target
    for i, target in enumerate(dst):
        if cur[i] != target:
            moves.append((i, cur[i], target))
            cur[i] = target
    return _shrink_first(moves)



def _dims(move: Move) -> set[int]:
    return {p.dim for p in move[1:] if isinstance(p, Shard)}


def _commutes_after(move: Move, prev: Move) -> bool:
    """Whether ``move`` may run before ``prev`` (another axis) with the same result, and cheaper."""
    src, dst = move[1], move[2]
    prev_moves_data = isinstance(prev[1], Shard | Partial) and not isinstance(prev[2], Partial)
    if isinstance(src, Partial) and isinstance(dst, Replicate):
        # all_reduce is elementwise: it commutes with concatenation (all_gather, all_to_all).
        return isinstance(prev[1], Shard) and not isinstance(prev[2], Partial)
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        # a local chunk of dim d commutes with any collective on other dims of another axis.
        return prev_moves_data and not (_dims(prev) & _dims(move))
    return False


def _shrink_first(moves: list[Move]) -> list[Move]:
    # Local chunks and all_reduces move ahead of collectives on other axes they commute with,
    # so those run on the smaller tensor. Values, and every reduction's order, are unchanged.
    out: list[Move] = []
    for move in moves:
        i = len(out)
        while i and out[i - 1][0] != move[0] and _commutes_after(move, out[i - 1]):
            i -= 1
        out.insert(i, move)
    return out


def plan_steps(src: Sequence[Placement], dst: Sequence[Placement], global_shape: Sequence[int],
               mesh_shape: Sequence[int], coord: Sequence[int]) -> tuple[Step, ...]:
    """Ordered single-axis steps taking this rank's local tensor from ``src`` to ``dst``.

    Args:
        src, dst: one placement per mesh axis, shard dims non-negative.
        global_shape: the logical shape of the whole tensor.
        mesh_shape: ranks per mesh axis.
        coord: this rank's mesh coordinate.

    Returns:
        The steps in execution order (empty when ``src == dst``).

    Raises:
        TPLowerError: a pair the table has no lowering for (see :func:`classify_axis`).
        TypeError: placements that are not sequences of ``Placement``, or
            shapes and coordinates that are not sequences of ints.
    """
    src, dst = check_placement_seq(src, "src", "plan_steps"), check_placement_seq(dst, "dst", "plan_steps")
    gshape = check_shape(global_shape, "global_shape", "plan_steps")
    mesh_shape, coord = check_shape(mesh_shape, "mesh_shape", "plan_steps"), check_shape(coord, "coord", "plan_steps")
    logical = _logical_shapes(gshape, src, mesh_shape, coord)
    cur = list(src)
    shape = local_shape(gshape, cur, mesh_shape, coord)
    steps = []
    for axis, a, b in _greedy_order(src, dst):
        kind, tdim, ddim, op = classify_axis(a, b)
        cur[axis] = b
        out = local_shape(gshape, cur, mesh_shape, coord)
        n = mesh_shape[axis]
        if n == 1:  # one rank holds everything: nothing to do (DTensor's shortcut too)
            kind, tdim, ddim, op = "identity", None, None, None
        steps.append(Step(axis=axis, src=a, dst=b, kind=kind, group_size=n, rank=coord[axis],
                          logical_shape=logical[axis], in_shape=shape, out_shape=out, tensor_dim=tdim,
                          dst_dim=ddim, reduce_op=op,
                          send_elems=_send_elems(kind, n, shape, logical[axis], tdim)))
        shape = out
    return tuple(s for s in steps if s.kind != "identity")


@dataclass(frozen=True)
class TransitionPlan:
    """A whole transition on one rank: forward steps, and backward steps on the gradient.

    Attributes:
        src, dst: placements of the input and output, one per mesh axis.
        grad: placement of the gradient that arrives at the output.
        grad_dst: where backward moves it: ``src`` with ``Partial`` read as
            ``Replicate``.
        global_shape: logical shape of the whole tensor.
        in_shape, out_shape: this rank's local shapes of input and output.
        forward, backward: the ordered steps.
    """

    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    grad: tuple[Placement, ...]
    grad_dst: tuple[Placement, ...]
    global_shape: Shape
    in_shape: Shape
    out_shape: Shape
    forward: tuple[Step, ...]
    backward: tuple[Step, ...]

    def __str__(self) -> str:
        fwd = "; ".join(map(str, self.forward)) or "identity"
        bwd = "; ".join(map(str, self.backward)) or "identity"
        return (f"{format_placements(self.src)} -> {format_placements(self.dst)} "
                f"(grad {format_placements(self.grad)}): forward [{fwd}], backward [{bwd}]")


def plan_transition(src: Sequence[Placement], dst: Sequence[Placement], global_shape: Sequence[int],
                    mesh_shape: Sequence[int], coord: Sequence[int],
                    grad: Sequence[Placement] | None = None) -> TransitionPlan:
    """Plan ``src -> dst`` forward and ``grad -> replicate_partials(src)`` backward.

    Args:
        src, dst, grad: one placement per mesh axis with non-negative shard
            dims; ``grad`` defaults to ``replicate_partials(dst)``.
        global_shape, mesh_shape, coord: as :func:`plan_steps`.

    Raises:
        TPLowerError: an unlowerable pair, a shard dim outside ``global_shape``,
            a placement count unlike the mesh's, a ``coord`` outside the mesh,
            a tensor that mixes ``max``/``min`` Partials with other reduce ops
            (:func:`~tplower.core.language.placements.check_reduce_ops`), or a ``grad`` that
            shards other dims than the output (the gradient must have the
            output's local shape on every rank).
        TypeError: placements that are not sequences of ``Placement``, or
            shapes and coordinates that are not sequences of ints.
    """
    func = "plan_transition"
    src, dst = check_placement_seq(src, "src", func), check_placement_seq(dst, "dst", func)
    grad = replicate_partials(dst) if grad is None else check_placement_seq(grad, "grad", func)
    gshape = check_shape(global_shape, "global_shape", func)
    mesh_shape, coord = check_shape(mesh_shape, "mesh_shape", func), check_shape(coord, "coord", func)
    if len(coord) != len(mesh_shape) or any(c >= n for c, n in zip(coord, mesh_shape, strict=False)):
        raise TPLowerError(f"coord={coord} is not a coordinate of a mesh of shape {mesh_shape}: give one index "
                           f"per axis, each in 0..size-1")
    for name, ps in (("src", src), ("dst", dst), ("grad", grad)):
        if len(ps) != len(mesh_shape):
            raise TPLowerError(f"{name}={format_placements(ps)!r} has {count(len(ps), 'placement')} for a "
                               f"{len(mesh_shape)}-axis mesh")
        check_reduce_ops(ps, name)
        for p in ps:
            if isinstance(p, Shard) and not 0 <= p.dim < len(gshape):
                raise TPLowerError(f"{name}={format_placements(ps)!r}: shard dim {p.dim} is not in "
                                   f"0..{len(gshape) - 1} for global shape {gshape} (normalise negative dims "
                                   "with parse_placements(tensor_ndim=...))")
    if len(grad) != len(dst) or replicate_partials(grad) != replicate_partials(dst):
        raise TPLowerError(
            f"grad={format_placements(grad)!r} does not fit the output {format_placements(dst)!r}: on every "
            "axis the gradient must shard the dim the output shards (R and P(op) are interchangeable)"
        )
    out_shape = local_shape(gshape, dst, mesh_shape, coord)
    grad_dst = replicate_partials(src)
    return TransitionPlan(
        src=src, dst=dst, grad=grad, grad_dst=grad_dst, global_shape=gshape,
        in_shape=local_shape(gshape, src, mesh_shape, coord), out_shape=out_shape,
        forward=plan_steps(src, dst, gshape, mesh_shape, coord),
        backward=plan_steps(grad, grad_dst, gshape, mesh_shape, coord),
    )
