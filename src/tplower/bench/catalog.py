"""The names ``tplower bench`` measures, as plain data (no torch): transitions, sizes, implementations, modes.

:mod:`~tplower.bench.cases` builds the timed callables from them; the
command line reads them for its choices and ``--help``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CASES", "IMPLS", "MODES", "SIZES", "Case"]

#: Modes of one call (see the module docstring).
MODES: tuple[str, ...] = ("fwd", "fwd_grad", "fwd_bwd")
#: Global tensor sizes in bytes (float32).
SIZES: tuple[int, ...] = (1 << 10, 64 << 10, 4 << 20, 64 << 20)
#: Every implementation name, in table order.
IMPLS: tuple[str, ...] = ("raw", "raw_packed", "tplower", "seed_op", "megatron", "funcol", "dtensor")


@dataclass(frozen=True)
class Case:
    """One transition on one mesh shape.

    Attributes:
        src, dst: canonical placement strings, one per mesh axis (``"S(0),R"``).
        mesh: ranks per mesh axis; ``None`` means one axis of the whole world.
        seed: ``(kind, tensor_dim, dst_dim)`` of the seed-compatible op, or
            ``None`` when it has none (no-communication and multi-axis moves).
    """

    src: str
    dst: str
    mesh: tuple[int, ...] | None = None
    seed: tuple[str, int | None, int | None] | None = None

    @property
    def name(self) -> str:
        """``S(0)->R``, with ``@2x2`` for a fixed mesh."""
        where = "" if self.mesh is None else "@" + "x".join(map(str, self.mesh))
        return f"{self.src}->{self.dst}{where}"

    def mesh_shape(self, world: int) -> tuple[int, ...]:
        """Ranks per axis on ``world`` ranks."""
        return (world,) if self.mesh is None else self.mesh


#: The transitions timed: five on one axis, one 2-axis move on a 2x2 mesh.
CASES: tuple[Case, ...] = (
    Case("S(0)", "R", seed=("all_gather", 0, None)),
    Case("P(sum)", "R", seed=("all_reduce", None, None)),
    Case("P(sum)", "S(0)", seed=("reduce_scatter", 0, None)),
    Case("S(0)", "S(1)", seed=("all_to_all", 0, 1)),
    Case("R", "S(0)"),
    Case("S(0),S(1)", "R,R", mesh=(2, 2)),
)
