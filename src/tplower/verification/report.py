"""What :func:`tplower.verify` found: one check per compared tensor, one verdict per boundary, the first divergence.

Kept apart from the comparison itself so ``tplower run``, ``tplower verify``
and tests format the same objects the same way (a table, or plain data for
JSON).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["BoundaryVerdict", "Check", "VerifyReport"]

#: Phases of a check, in the order they run.
PHASES: tuple[str, ...] = ("forward", "backward", "param_grad", "param_after_steps")


@dataclass(frozen=True)
class Check:
    """One tensor of the parallel model compared with the same tensor of the one-process model.

    Attributes:
        phase: one of :data:`PHASES`.
        module: the module's qualified name (``""``: the model itself).
        tensor: what was compared, e.g. ``grad of input '0' (after the move)``.
        placement: the declared placement the local tensors were read back by (``S(1)``, ``P(sum)``).
        max_diff: the largest absolute difference from the one-process value (``inf``: shapes differ
            or one side has no gradient).
        ok: within the tolerances (``|par - ref| <= atol + rtol * max|ref|`` everywhere, ``max|ref|``
            the largest magnitude of that tensor: gradients are sums whose small entries carry the
            rounding of the large ones).
        cause: the likely cause, where the numbers say it, else ``None``.
        suggestion: the plan change that fixes it, in plan syntax, else ``None``.
        order: when the tensor was produced (forward, then backward, in execution order).
    """

    phase: str
    module: str
    tensor: str
    placement: str
    max_diff: float
    ok: bool
    cause: str | None = None
    suggestion: str | None = None
    order: int = 0


@dataclass(frozen=True)
class BoundaryVerdict:
    """One row of the table: a parallelized module, worst differences forward and backward, ``ok``."""

    module: str
    form: str
    forward_max_diff: float
    backward_max_diff: float
    ok: bool


@dataclass(frozen=True)
class VerifyReport:
    """The result of :func:`tplower.verify` (the same on every rank).

    Attributes:
        boundaries: one verdict per parallelized module, in forward execution order.
        checks: every comparison, forward and backward in execution order, then parameters.
        atol, rtol: the tolerances used.
        world: the number of ranks of the mesh.
    """

    boundaries: tuple[BoundaryVerdict, ...]
    checks: tuple[Check, ...]
    atol: float
    rtol: float
    world: int

    @property
    def ok(self) -> bool:
        """Every check within the tolerances."""
        return all(c.ok for c in self.checks)

    @property
    def first_divergence(self) -> Check | None:
        """The first failed check: forward in execution order, then backward, then parameters; ``None`` if none."""
        failed = [c for c in self.checks if not c.ok]
        return min(failed, key=lambda c: (PHASES.index(c.phase), c.order)) if failed else None

    def summary(self) -> str:
        """One paragraph: ``all N boundaries match`` or the first divergence with its cause and fix."""
        first = self.first_divergence
        if first is None:
            return (f"OK: {len(self.boundaries)} boundaries and {sum(c.phase == 'param_grad' for c in self.checks)} "
                    f"parameter gradients match one process (atol={self.atol:g}, rtol={self.rtol:g}, "
                    f"{self.world} ranks)")
        lines = [f"DIVERGES first at module {first.module!r} ({first.phase}): {first.tensor}, read as "
                 f"{first.placement}, max |diff| {first.max_diff:.3g}"]
        if first.cause:
            lines.append(f"  likely cause: {first.cause}")
        if first.suggestion:
            lines.append(f"  suggested plan change: {first.suggestion}")
        return "\n".join(lines)

    def table(self) -> str:
        """The boundary table (boundary, form, forward max diff, backward max diff, verdict) and the summary."""
        rows = [(b.module, b.form, f"{b.forward_max_diff:.2e}", f"{b.backward_max_diff:.2e}",
                 "ok" if b.ok else "DIVERGES") for b in self.boundaries]
        params = [c for c in self.checks if c.phase in ("param_grad", "param_after_steps")]
        worst = max((c.max_diff for c in params), default=0.0)
        rows.append(("(parameters)", "", "", f"{worst:.2e}", "ok" if all(c.ok for c in params) else "DIVERGES"))
        head = ("boundary", "form", "forward max diff", "backward max diff", "verdict")
        widths = [max(len(r[i]) for r in (head, *rows)) for i in range(5)]
        fmt = "  ".join(f"{{:{w}}}" for w in widths)
        out = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        out += [fmt.format(*r) for r in rows]
        return "\n".join(out) + "\n" + self.summary()

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON: ``ok``, tolerances, boundaries, the first divergence and every check.

        A difference that is not finite (shapes differ, a gradient missing) is ``None``, so the
        result is strict JSON.
        """
        first = self.first_divergence
        return {"ok": self.ok, "atol": self.atol, "rtol": self.rtol, "world": self.world,
                "boundaries": [_finite(asdict(b)) for b in self.boundaries],
                "first_divergence": _finite(asdict(first)) if first is not None else None,
                "checks": [_finite(asdict(c)) for c in self.checks]}


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
