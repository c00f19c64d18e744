"""Type checks at the public boundary: a wrong type raises ``TypeError`` naming the argument, before any collective.

Each check takes the value, the argument's name and the function's name, and
returns the value (narrowed) or raises ``TypeError`` whose message reads
``func: arg must be <what is allowed>, got <type> <value>``. The checks are
local and deterministic: ranks that pass the same value raise alike, and
none of them has started a collective. The hot paths call them only on a
cache miss or after a failure, so a correct call pays nothing for them.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "check_bool",
    "check_int",
    "check_local_tensor",
    "check_mesh",
    "check_names",
    "check_placement",
    "check_placement_seq",
    "check_shape",
    "describe",
]


def describe(value: Any) -> str:
    """``type value`` for a message, the value's repr cut to 80 characters (a tensor by shape and dtype)."""
    if isinstance(value, DTensor):
        return f"a DTensor (placements {tuple(value.placements)}, shape {tuple(value.shape)})"
    if isinstance(value, torch.Tensor):
        return f"a {type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{type(value).__name__} {text}" if value is not None else "None"


def _fail(func: str, arg: str, allowed: str, value: Any, hint: str = "") -> TypeError:
    return TypeError(f"{func}: {arg} must be {allowed}, got {describe(value)}" + (f"; {hint}" if hint else ""))


def check_local_tensor(value: Any, arg: str, func: str) -> torch.Tensor:
    """``value`` if it is a plain ``torch.Tensor`` (a ``Parameter`` too), not a DTensor.

    Raises:
        TypeError: anything else; a DTensor's message says to pass its local
            tensor or to redistribute the DTensor itself.
    """
    if isinstance(value, DTensor):
        hint = f"pass {arg}.to_local()" + (f" with its placements as src, or call {arg}.redistribute(mesh, dst) on "
                                           "the DTensor itself" if func == "redistribute_local" else "")
        raise _fail(func, arg, "this rank's local torch.Tensor", value, hint)
    if not isinstance(value, torch.Tensor):
        hint = "convert it with torch.as_tensor(...)" if isinstance(value, Sequence | int | float) or \
            hasattr(value, "__array__") else ""
        raise _fail(func, arg, "a torch.Tensor", value, hint)
    return value


def check_mesh(value: Any, arg: str, func: str) -> DeviceMesh:
    """``value`` if it is a ``DeviceMesh``.

    Raises:
        TypeError: anything else (make one with ``init_device_mesh``).
    """
    if not isinstance(value, DeviceMesh):
        raise _fail(func, arg, "a torch.distributed.device_mesh.DeviceMesh", value,
                    "make one with torch.distributed.device_mesh.init_device_mesh")
    return value


def check_int(value: Any, arg: str, func: str, *, optional: bool = False) -> int | None:
    """``value`` as an ``int`` (any integer type, not ``bool``); ``None`` passes when ``optional``.

    Raises:
        TypeError: a float, a string, a bool, or ``None`` when not ``optional``.
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dim() != 0):
        raise _fail(func, arg, "an int" + (" or None" if optional else ""), value)
    try:
        return operator.index(value)
    except TypeError:
        raise _fail(func, arg, "an int" + (" or None" if optional else ""), value) from None


def check_bool(value: Any, arg: str, func: str, *, optional: bool = False) -> bool | None:
    """``value`` if it is a ``bool`` (or ``None`` when ``optional``).

    Raises:
        TypeError: anything else (``0``/``1``, strings).
    """
    if (value is None and optional) or isinstance(value, bool):
        return value
    raise _fail(func, arg, "True, False or None" if optional else "True or False", value)


def check_shape(value: Any, arg: str, func: str) -> tuple[int, ...]:
    """``value`` as a tuple of non-negative ints (a tuple, list or ``torch.Size``).

    Raises:
        TypeError: not a sequence of ints (a string, a NumPy array, ``None``,
            floats); a negative size raises ``ValueError``.
    """
    allowed = "a sequence of non-negative ints (tuple, list or torch.Size)"
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        hint = f"pass tuple({arg}.tolist())" if hasattr(value, "tolist") and not isinstance(value, DTensor) else ""
        raise _fail(func, arg, allowed, value, hint)
    out = []
    for s in value:
        if isinstance(s, bool):
            raise _fail(func, arg, allowed, value)
        try:
            out.append(operator.index(s))
        except TypeError:
            raise _fail(func, arg, allowed, value) from None
    if any(s < 0 for s in out):
        raise ValueError(f"{func}: {arg}={tuple(out)} has a negative size; sizes must be >= 0")
    return tuple(out)


def check_names(value: Any, arg: str, func: str) -> tuple[str, ...]:
    """``value`` as a tuple of axis-name strings (a string alone is refused: ``"tp"`` is not ``("tp",)``).

    Raises:
        TypeError: not a sequence of strings.
    """
    allowed = "a sequence of mesh axis names (str), e.g. ('dp', 'tp')"
    if isinstance(value, str):
        raise _fail(func, arg, allowed, value, f"write ({value!r},) for a one-axis mesh")
    if not isinstance(value, Sequence) or not all(isinstance(n, str) for n in value):
        raise _fail(func, arg, allowed, value)
    return tuple(value)


def check_placement(value: Any, arg: str, func: str) -> Placement:
    """``value`` if it is a ``Placement`` object (``Shard``, ``Replicate``, ``Partial`` or another).

    Raises:
        TypeError: anything else; a string's message points to
            :func:`~tplower.parse_placement`.
    """
    if not isinstance(value, Placement):
        hint = f"parse it with tplower.parse_placement({value!r})" if isinstance(value, str) else ""
        raise _fail(func, arg, "a Placement (Shard(d), Replicate() or Partial(op))", value, hint)
    return value


def check_placement_seq(value: Any, arg: str, func: str) -> tuple[Placement, ...]:
    """``value`` as a tuple of ``Placement`` objects, one per mesh axis.

    Raises:
        TypeError: not a sequence of placements (a string's message points to
            :func:`~tplower.parse_placements`).
    """
    allowed = "a sequence of Placement objects (one per mesh axis)"
    if isinstance(value, str) or isinstance(value, Mapping):
        raise _fail(func, arg, allowed, value, f"parse it with tplower.parse_placements({value!r}, mesh_dim_names)")
    if not isinstance(value, Sequence) or not all(isinstance(p, Placement) for p in value):
        raise _fail(func, arg, allowed, value)
    return tuple(value)
