"""What each process-group backend does natively, per device type: the table the step binding reads.

:func:`backend_caps` gives a backend's native collectives and reduce ops
(an unknown backend gets the safe minimum); :func:`check_device` refuses a
tensor whose device the backend does not carry; :func:`backend_for_device`
picks the backend of a ``cpu:gloo,cuda:nccl`` group that carries a device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["BackendCaps", "backend_caps", "backend_for_device", "backend_name_for", "check_device"]


@dataclass(frozen=True)
class BackendCaps:
    """What one backend does natively for tensors of one device type.

    Attributes:
        name: backend name (``gloo``, ``nccl``, ``threaded``, ...).
        reduce_scatter_ops: reduce ops with a native ``reduce_scatter``.
        all_reduce_ops: reduce ops with a native ``all_reduce``.
        all_to_all: whether ``all_to_all_single`` exists.
    """

    name: str
    reduce_scatter_ops: frozenset[str]
    all_reduce_ops: frozenset[str]
    all_to_all: bool


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


def backend_caps(name: str) -> BackendCaps:
    """Capabilities of a backend by name; an unknown name gets the safe minimum.

    The safe minimum (``all_reduce`` of sum/max/min only, no native
    ``reduce_scatter`` or ``all_to_all``) is correct on any backend that
    has ``all_reduce`` and ``all_gather``.
    """
    caps = _CAPS.get(name.lower())
    return caps if caps is not None else BackendCaps(name, frozenset(), _NO_AVG, False)


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
