"""What a rank can do: its matmul rate and each link's latency and bandwidth, from a datasheet or measured here.

A :class:`DeviceProfile` feeds the planner's time model (:func:`tplower.planner.search.predict_seconds`): a step's
FLOPs at :attr:`DeviceProfile.flops`, each collective at its axis's :class:`Link` (``intra``: the ranks of the
group share a node; ``inter``: they do not), and each operator call at :attr:`DeviceProfile.op_seconds` (the
per-call cost of the framework, which a small model on a CPU is made of, and which a GPU hides behind its queue).

Presets (:data:`PRESETS`) take their rates and bandwidths from the vendors' public datasheets: peak figures, not
measurements; their latencies are assumptions, labelled so. ``tplower bench --calibrate`` measures this machine
(:mod:`tplower.planner.calibrate`) and writes a profile file (YAML) that :func:`load_profile` reads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.support.errors import TPLowerError

__all__ = ["PRESETS", "DeviceProfile", "Link", "load_profile", "save_profile"]


@dataclass(frozen=True)
class Link:
    """One kind of link between two ranks.

    Attributes:
        latency_s: seconds a collective pays per step of its ring (``n - 1`` steps; ``2(n - 1)`` for all_reduce).
        bandwidth: bytes per second one rank sends (one direction).
    """

    latency_s: float
    bandwidth: float


@dataclass(frozen=True)
class DeviceProfile:
    """A rank's rates (see the module docstring).

    Attributes:
        name: a label.
        flops: floating-point operations per second of a 16-bit (bf16/fp16) matmul, per rank.
        flops_fp32: the same for float32.
        intra: the link inside a node; inter: between nodes.
        op_seconds: seconds per operator call beyond its arithmetic (0 for a preset).
        device: the device type (``"cuda"``: the optimizer is traced with ``foreach=True``, as it runs there).
        memory: bytes of memory per rank (``None``: unknown; ``plan_layout``'s ``memory_per_rank`` defaults to it).
        source: where the figures come from (``"datasheet: ..."``, ``"measured: ..."``).
    """

    name: str
    flops: float
    flops_fp32: float
    intra: Link
    inter: Link
    op_seconds: float = 0.0
    device: str = "cuda"
    memory: int | None = None
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def rate(self, dtype: torch.dtype) -> float:
        """FLOP/s for a matmul of ``dtype``."""
        return self.flops_fp32 if dtype == torch.float32 else self.flops


_GB = 10**9
_LAT = "latencies assumed (5 us in a node, 10 us between nodes), not a datasheet figure"

#: datasheet presets by name
PRESETS: dict[str, DeviceProfile] = {
    "h100": DeviceProfile(
        "h100", 989e12, 67e12, Link(5e-6, 450 * _GB), Link(10e-6, 50 * _GB), memory=80 * 2**30,
        source="datasheet: NVIDIA H100 SXM5 80GB, 989 TFLOP/s dense BF16, 67 TFLOP/s FP32; NVLink 4 900 GB/s "
               f"both ways (450 GB/s each way); ConnectX-7 NDR 400 Gb/s (50 GB/s) per GPU between nodes; {_LAT}"),
    "h200": DeviceProfile(
        "h200", 989e12, 67e12, Link(5e-6, 450 * _GB), Link(10e-6, 50 * _GB), memory=141 * _GB,
        source="datasheet: NVIDIA H200 SXM 141GB, 989 TFLOP/s dense BF16, 67 TFLOP/s FP32; NVLink 4 900 GB/s "
               f"both ways; NDR 400 Gb/s per GPU between nodes; {_LAT}"),
    "a100": DeviceProfile(
        "a100", 312e12, 19.5e12, Link(5e-6, 300 * _GB), Link(10e-6, 25 * _GB), memory=80 * 2**30,
        source="datasheet: NVIDIA A100 SXM4 80GB, 312 TFLOP/s dense BF16, 19.5 TFLOP/s FP32; NVLink 3 600 GB/s "
               f"both ways (300 GB/s each way); HDR 200 Gb/s (25 GB/s) per GPU between nodes; {_LAT}"),
}


def save_profile(profile: DeviceProfile, path: str | Path) -> None:
    """Write ``profile`` as YAML to ``path``."""
    import yaml  # type: ignore[import-untyped]

    Path(path).write_text(yaml.safe_dump(asdict(profile), sort_keys=False))


def load_profile(spec: str | Path | DeviceProfile) -> DeviceProfile:
    """A profile: a :class:`DeviceProfile` as it is, a preset's name (:data:`PRESETS`), or a YAML file's path
    (what ``tplower bench --calibrate`` writes).

    Raises:
        TPLowerError: an unknown name, a missing file, or a file without the fields.
    """
    if isinstance(spec, DeviceProfile):
        return spec
    text = str(spec)
    if text.lower() in PRESETS:
        return PRESETS[text.lower()]
    path = Path(text)
    if not path.is_file():
        raise TPLowerError(f"device={text!r}: not a preset ({', '.join(PRESETS)}) nor a profile file")
    import yaml  # type: ignore[import-untyped]

    data = yaml.safe_load(path.read_text()) or {}
    try:
        data["intra"], data["inter"] = Link(**data["intra"]), Link(**data["inter"])
        return DeviceProfile(**data)
    except (KeyError, TypeError) as exc:
        raise TPLowerError(f"device={text!r}: not a profile file ({exc}); write one with tplower bench "
                           "--calibrate") from exc
