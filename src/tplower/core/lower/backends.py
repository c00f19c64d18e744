"""What each process-group backend does natively, per device type: the table the step binding reads.

:func:`backend_caps` gives a backend's native collectives and reduce ops
(an unknown backend gets the safe minimum); :func:`check_device` refuses a
tensor whose device the backend does not carry; :func:`backend_for_device`
picks the backend of a ``cpu:gloo,cuda:nccl`` group that carries a device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["EXCHANGE_ENV", "BackendCaps", "backend_caps", "backend_for_device", "backend_name_for", "check_device"]


@dataclass(frozen=True)
class BackendCaps:
    """What one backend does natively for tensors of one device type.

    Attributes:
        name: backend name (``gloo``, ``nccl``, ``threaded``, ...).
        reduce_scatter_ops: reduce ops with a native ``reduce_scatter``.
        all_reduce_ops: reduce ops with a native ``all_reduce``.
        all_to_all: whether ``all_to_all_single`` exists.
        exchange_bytes: an ``all_reduce`` of a CPU tensor whose every rank's copy together (group size times its
            bytes) is at most this many bytes runs as one ``all_to_all`` that hands each rank every copy, reduced
            locally (:func:`tplower.core.lower.collectives.all_reduce`); ``0``: never.
    """

    name: str
    reduce_scatter_ops: frozenset[str]
    all_reduce_ops: frozenset[str]
    all_to_all: bool
    exchange_bytes: int = 0


_ALL = frozenset(("sum", "avg", "max", "min"))
_NO_AVG = frozenset(("sum", "max", "min"))
# gloo on torch >= 2.13 has reduce_scatter_single for sum/avg/max/min and
# all_reduce with AVG (checked on 2 gloo processes); the threaded test group only
# reduce-scatters sum/avg; mpi lacks the tensor form of reduce_scatter.
_CAPS: dict[str, BackendCaps] = {
    "nccl": BackendCaps("nccl", _ALL, _ALL, True),
    "gloo": BackendCaps("gloo", _ALL, _ALL, True),
    "threaded": BackendCaps("threaded", frozenset(("sum", "avg")), _ALL, True),
    "fake": BackendCaps("fake", _ALL, _ALL, True),
    "ucc": BackendCaps("ucc", _NO_AVG, _NO_AVG, True),
    "mpi": BackendCaps("mpi", frozenset(), _NO_AVG, True),
}


#: Environment variable: gloo's ``exchange_bytes`` (default 1 MiB; ``0`` turns the exchange off). It must be the
#: same on every rank: it decides which collective each rank calls.
EXCHANGE_ENV = "TPLOWER_GLOO_EXCHANGE_BYTES"
# Measured on 2 and 4 gloo processes sharing 2 CPU cores (medians, per all_reduce of float32, in microseconds):
# a native all_reduce took 1,550-2,100 at 64-512 KiB a rank (2 ranks) where one all_to_all of the copies plus
# the local sum took 370-1,010; the two meet between 768 KiB and 1 MiB a rank at 2 ranks, between 384 KiB and
# 1 MiB at 4 (5,480-6,040 against 2,860-3,880 below). docs/design.md, "Which collective carries a step".
_EXCHANGE_DEFAULT = 1 << 20


def _exchange_bytes() -> int:
    from ..support.errors import TPLowerError

    raw = os.environ.get(EXCHANGE_ENV, "").strip()
    if not raw:
        return _EXCHANGE_DEFAULT
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise TPLowerError(f"{EXCHANGE_ENV}={raw!r}: expected a whole number of bytes, 0 or more (0: off)")
    return value


def backend_caps(name: str) -> BackendCaps:
    """Capabilities of a backend by name; an unknown name gets the safe minimum.

    The safe minimum (``all_reduce`` of sum/max/min only, no native
    ``reduce_scatter`` or ``all_to_all``) is correct on any backend that
    has ``all_reduce`` and ``all_gather``. gloo's ``exchange_bytes`` is read
    from ``TPLOWER_GLOO_EXCHANGE_BYTES`` at each call (default 1 MiB).

    Raises:
        TPLowerError: ``TPLOWER_GLOO_EXCHANGE_BYTES`` is not a whole number of bytes, 0 or more.
    """
    caps = _CAPS.get(name.lower())
    if caps is None:
        return BackendCaps(name, frozenset(), _NO_AVG, False)
    return replace(caps, exchange_bytes=_exchange_bytes()) if caps.name == "gloo" else caps


def backend_name_for(group: ProcessGroup, device_type: str) -> str:
    """Name of the backend that carries tensors of ``device_type`` on ``group``.

    A ``cpu:gloo,cuda:nccl`` group carries CUDA tensors on NCCL and CPU
    tensors on gloo; a single-backend group carries everything on its one
    backend.
    """
    return backend_for_device(str(dist.get_backend(group)), device_type)


#: device types each backend carries (``None``: any); backends not listed are not checked.
_DEVICES: dict[str, frozenset[str] | None] = {
    "nccl": frozenset({"cuda"}), "gloo": frozenset({"cpu", "cuda"}), "mpi": frozenset({"cpu"}),
    "ucc": frozenset({"cpu", "cuda"}), "threaded": None, "fake": None,
}


def check_device(backend: str, device_type: str, where: str = "the process group") -> None:
    """Raise unless ``backend`` (possibly ``cpu:gloo,cuda:nccl``) carries ``device_type`` tensors.

    Raises:
        TPLowerError: the backend carries no tensors of that device type;
            the message names the backend and the device types it carries.
    """
    from ..support.errors import TPLowerError

    if ":" in backend:
        table = dict(part.split(":", 1) for part in backend.split(","))
        if device_type not in table:
            raise TPLowerError(f"the tensor is on {device_type!r} but {where} has backends for "
                               f"{sorted(table)} only ({backend!r}); move the tensor or add a backend for it")
        backend = table[device_type]
    devices = _DEVICES.get(backend.lower())
    if devices is not None and device_type not in devices:
        raise TPLowerError(f"the tensor is on {device_type!r} but {where} runs on {backend!r}, which carries "
                           f"{sorted(devices)} tensors; move the tensor or use a group with a "
                           f"{device_type} backend")


def backend_for_device(backend: str, device_type: str) -> str:
    """The single backend of ``backend`` that carries ``device_type`` tensors.

    ``backend_for_device("cpu:gloo,cuda:nccl", "cuda") == "nccl"``; a plain
    name is returned as it is.
    """
    if ":" not in backend:
        return backend
    table = dict(part.split(":", 1) for part in backend.split(","))
    return table.get(device_type, table.get("cpu", backend))
