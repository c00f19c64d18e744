"""What :func:`tplower.verify` found: one check per compared tensor, one verdict per boundary, the first divergence.

Kept apart from the comparison itself so ``tplower run``, ``tplower verify``
and tests format the same objects the same way (a table, or plain data for
JSON).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..core.support.words import count

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
        allowed: the largest difference this tensor may have (``atol + rtol * max|one process|``; ``None``:
            not a comparison).
        error: the exception the module's forward raised (``"RuntimeError: ..."``), when the parallel model
            could not run there; ``None`` for a comparison.
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
    allowed: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class BoundaryVerdict:
    """One row of the table: a parallelized module, worst differences forward and backward (``None``: no tensor
    of that direction was compared there, e.g. the forward of a boundary that moves nothing), ``ok``."""

    module: str
    form: str
    forward_max_diff: float | None
    backward_max_diff: float | None
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
        """One paragraph: ``all N boundaries match``, the forward that raised, or the first divergence, with its
        cause and fix."""
        first = self.first_divergence
        if first is None:
            n_params = sum(c.phase == "param_grad" for c in self.checks)
            return (f"OK: {count(len(self.boundaries), 'boundary', 'boundaries')} and "
                    f"{count(n_params, 'parameter gradient', 'parameter gradients')} match one process (each "
                    f"tensor within atol={self.atol:g} + rtol={self.rtol:g} x its largest |value|, "
                    f"{count(self.world, 'rank', 'ranks')})")
        if first.error is not None:
            lines = [f"FAILS at module {first.module!r} ({first.phase}): {first.error}",
                     f"  {first.tensor}"]
        else:
            allowed = f" (allowed {first.allowed:.3g})" if first.allowed is not None else ""
            lines = [f"DIVERGES first at module {first.module!r} ({first.phase}): {first.tensor}, read as "
                     f"{first.placement}, max |diff| {first.max_diff:.3g}{allowed}"]
        if first.cause:
            lines.append(f"  likely cause: {first.cause}")
        if first.suggestion:
            lines.append(f"  suggested plan change: {first.suggestion}")
        return "\n".join(lines)

    def table(self) -> str:
        """The boundary table and the summary.

        Each row: a boundary (then the parameter gradients, and the parameters after the training steps),
        and per direction the compared tensor nearest its own tolerance: its max ``|parallel - one
        process|`` and, in brackets, the most it may be (``atol + rtol * max|one process|`` of that tensor),
        so a verdict never stands beside a number above the bound it was judged by.
        """
        rows = []
        for b in self.boundaries:
            own = [c for c in self.checks if c.module == b.module]
            raised = any(c.error is not None for c in own)
            rows.append((b.module, b.form, _worst(own, ("forward",)), _worst(own, ("backward", "param_grad",
                         "param_after_steps")), "RAISED" if raised else "ok" if b.ok else "DIVERGES"))
        for phase, name in (("param_grad", "(parameter gradients)"), ("param_after_steps", "(parameters after the "
                                                                                            "steps)")):
            params = [c for c in self.checks if c.phase == phase]
            if params:
                rows.append((name, "", "", _worst(params, (phase,)), "ok" if all(c.ok for c in params) else
                             "DIVERGES"))
        head = ("boundary", "form", "forward |diff| (allowed)", "backward |diff| (allowed)", "verdict")
        widths = [max(len(r[i]) for r in (head, *rows)) for i in range(5)]
        fmt = "  ".join(f"{{:{w}}}" for w in widths)
        note = (f"each cell: the tensor nearest its tolerance, forward the values at the boundary, backward the "
                f"gradients arriving there; allowed = atol {self.atol:g} + rtol {self.rtol:g} x that tensor's "
                "largest |value| in one process")
        out = [note, fmt.format(*head).rstrip(), fmt.format(*("-" * w for w in widths))]
        out += [fmt.format(*r).rstrip() for r in rows]
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


def _worst(checks: list[Check], phases: tuple[str, ...]) -> str:
    """``"1.95e-03 (4.10e-03)"``: the check of ``phases`` nearest its own bound (``"none compared"`` for none)."""
    mine = [c for c in checks if c.phase in phases and c.error is None]
    if not mine:
        return "none compared"
    c = max(mine, key=lambda c: _ratio(c.max_diff, c.allowed))
    return f"{c.max_diff:.2e}" + (f" ({c.allowed:.2e})" if c.allowed is not None else "")


def _ratio(diff: float, allowed: float | None) -> float:
    if not math.isfinite(diff):
        return math.inf
    return diff / allowed if allowed else diff


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
