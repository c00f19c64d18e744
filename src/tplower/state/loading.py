"""Fill a parallelized model from a Hugging Face safetensors folder, reading only this rank's slices.

The way to start a model bigger than one rank: build it without data, parallelize it, then read each
rank's shards straight from the files::

    with accelerate.init_empty_weights():            # parameters on meta, buffers real
        model = AutoModelForCausalLM.from_config(config)
    tplower.parallelize(model, mesh, "auto")          # DTensor parameters, still on meta: no data touched
    tplower.load_safetensors(model, folder)           # each rank reads its boxes with get_slice

:func:`load_safetensors` opens ``model.safetensors`` or the files a ``model.safetensors.index.json`` names,
and for every parameter and persistent buffer reads, with safetensors' ``get_slice``, only the boxes of the
global tensor this rank holds (:func:`tplower.state.full_state.local_boxes`: ``torch.chunk`` pieces, uneven
ones and packed parameters' parts too). A parameter still on the meta device is materialized as a fresh
local tensor of its local shape on ``device`` (the same ``nn.Parameter`` object, its data swapped with
``torch.utils.swap_tensors``, so ties and references stay); a real one is written in place. No collective
runs: each rank reads its own slices, so peak memory per rank is its shards plus one slice.

Keys are the model's own ``state_dict`` keys (what ``save_pretrained`` of the same class writes, tied
weights written once). Checkpoints whose tensors transformers converts on load (per-expert weights that a
model stacks, renamed keys) are not converted here: such a key is reported missing, with the fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..core.support.errors import TPLowerError
from .full_state import fill_local, local_boxes

__all__ = ["LoadReport", "load_safetensors", "materialize"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


@dataclass
class LoadReport:
    """What :func:`load_safetensors` did on this rank.

    Attributes:
        loaded: state-dict keys filled (one per distinct tensor; a tie's other names are in ``tied``).
        tied: ``{key: the key it was filled under}`` for tensors shared between several names.
        missing: model keys the checkpoint lacks (left as they were; with ``strict`` an error instead).
        unexpected: checkpoint keys the model has no tensor for.
        bytes_read: bytes this rank read from the files (its boxes only).
        materialized: keys whose tensor was on the meta device and is now real.
    """

    loaded: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    bytes_read: int = 0
    materialized: list[str] = field(default_factory=list)


def _weight_map(path: Path) -> dict[str, Path]:
    """``{tensor key: file}`` of a safetensors folder (index or single file) or of one file."""
    if path.is_file():
        files = [path]
        index = None
    elif (path / _INDEX).is_file():
        index = json.loads((path / _INDEX).read_text())
        files = []
    elif (path / _SINGLE).is_file():
        files, index = [path / _SINGLE], None
    else:
        raise TPLowerError(f"load_safetensors: path {str(path)!r} holds neither {_SINGLE!r} nor {_INDEX!r} "
                           "(a Hugging Face safetensors folder), nor is it a .safetensors file")
    if index is not None:
        return {k: path / v for k, v in index["weight_map"].items()}
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            out.update(dict.fromkeys(h.keys(), f))
    return out


def _tensors(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor, bool]]:
    """``(key, owner, name, tensor, is_param)`` of every parameter and persistent buffer, ties repeated."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None:
                yield dot + name, module, name, p, True
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                yield dot + name, module, name, b, False


def _materialize(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real tensor of ``t``'s layout on ``device`` (uninitialized): a DTensor keeps its spec."""
    if isinstance(t, DTensor):
        local = torch.empty(t._local_tensor.shape, dtype=t.dtype, device=device)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    return torch.empty(t.shape, dtype=t.dtype, device=device)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    if isinstance(a, DTensor) != isinstance(b, DTensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not isinstance(a, DTensor) or not isinstance(b, DTensor):
        return True
    return a.device_mesh == b.device_mesh and a.placements == b.placements


def _tie(model: nn.Module) -> None:
    """Make the model's declared ties (transformers' ``all_tied_weights_keys``, ``{target: source}``) where the
    two parameters have one layout; a model built under ``init_empty_weights`` has not tied them yet."""
    ties = getattr(model, "all_tied_weights_keys", None) or {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for target, source in ties.items():
        a, b = params.get(target), params.get(source)
        if a is None or b is None or a is b or not _same_layout(a, b):
            continue
        owner_name, _, name = target.rpartition(".")
        owner = model.get_submodule(owner_name)
        owner._parameters[name] = b


def _ignored(model: nn.Module, key: str) -> bool:
    """A checkpoint key the model's class says to ignore on load (transformers'
    ``_keys_to_ignore_on_load_unexpected``, regular expressions)."""
    import re

    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    return any(re.search(p, key) for p in patterns)


def _mismatch(path: str | Path, missing: list[str], unexpected: list[str]) -> str:
    def few(keys: list[str]) -> str:
        return f"{keys[:8]}{' ...' if len(keys) > 8 else ''}"

    parts = []
    if missing:
        parts.append(f"{len(missing)} model keys are not in it: {few(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} of its keys name no tensor of the model: {few(unexpected)}")
    if missing and unexpected:
        fix = ("it looks like a checkpoint of another architecture or configuration; or one whose tensors "
               "transformers converts on load (stacked experts, renamed keys): save that in the model's own "
               "layout (save_pretrained(..., save_original_format=False)) or load it with "
               "torch.distributed.checkpoint")
    elif missing:
        fix = "a checkpoint of fewer layers or another configuration; strict=False leaves those tensors as they are"
    else:
        fix = "strict=False skips them (they are listed in the report's unexpected)"
    return f"load_safetensors: {str(path)!r} does not fit the model: " + "; ".join(parts) + f"; {fix}"


def _make_real(items: list[tuple[str, nn.Module, str, torch.Tensor, bool]], device: torch.device) -> torch.Tensor:
    """Materialize one meta tensor (all its names): a parameter keeps its object (``swap_tensors``)."""
    _, _, _, t, is_param = items[0]
    fresh = _materialize(t, device)
    if is_param:
        torch.utils.swap_tensors(t, nn.Parameter(fresh, requires_grad=t.requires_grad))
        return t
    for _, owner, name, _, _ in items:
        owner._buffers[name] = fresh
    return fresh


def _meta_buffers(model: nn.Module) -> list[str]:
    return [f"{p}.{n}" if p else n for p, m in model.named_modules() for n, b in m._buffers.items()
            if b is not None and b.is_meta]


def materialize(model: nn.Module, device: str | torch.device = "cpu") -> list[str]:
    """Give every meta parameter and persistent buffer of ``model`` real, uninitialized storage on ``device``.

    For loaders that write into existing tensors (``torch.distributed.checkpoint.load``): a parallelized
    model built on meta gets each DTensor's local shape only. Parameters keep their objects (ties stay).

    Returns:
        The keys materialized.

    Raises:
        TPLowerError: a non-persistent buffer still on meta (no checkpoint holds it: build the model under
            ``accelerate.init_empty_weights()``, which keeps buffers real).
    """
    groups: dict[int, list[tuple[str, nn.Module, str, torch.Tensor, bool]]] = {}
    for item in _tensors(model):
        groups.setdefault(id(item[3]), []).append(item)
    done = []
    for items in groups.values():
        if items[0][3].is_meta:
            _make_real(items, torch.device(device))
            done.append(items[0][0])
    _refuse_meta_buffers(model)
    return done


def _refuse_meta_buffers(model: nn.Module) -> None:
    meta = _meta_buffers(model)
    if meta:
        raise TPLowerError(f"buffers {meta[:8]} are still on the meta device and are in no checkpoint; build the "
                           "model under accelerate.init_empty_weights() (it keeps buffers real) instead of "
                           "torch.device('meta')")


def _fill(t: torch.Tensor, h: Any, key: str) -> int:
    """Copy this rank's boxes of checkpoint tensor ``key`` (open file ``h``) into ``t``; bytes read."""
    sl = h.get_slice(key)
    global_shape = tuple(int(s) for s in sl.get_shape())
    if tuple(t.shape) != global_shape:
        raise TPLowerError(f"shape {global_shape} in the checkpoint, {tuple(t.shape)} in the model")
    local = t._local_tensor if isinstance(t, DTensor) else t
    boxes = local_boxes(t) if isinstance(t, DTensor) else [((0,) * t.ndim, tuple(t.shape), (0,) * t.ndim)]
    read = 0

    def box(off: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
        nonlocal read
        part: torch.Tensor = (sl[tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))] if off
                              else h.get_tensor(key))
        read += part.numel() * part.element_size()
        return part

    with torch.no_grad():
        fill_local(local, boxes, box)
    return read


def load_safetensors(model: nn.Module, path: str | Path, *, strict: bool = True,
                     device: str | torch.device | None = None) -> LoadReport:
    """Fill ``model``'s parameters and persistent buffers from safetensors files, this rank's slices only.

    Args:
        model: a model after :func:`tplower.parallelize` (DTensor parameters; on the meta device or real),
            or any model (plain tensors are read whole).
        path: a Hugging Face model folder (``model.safetensors``, or ``model.safetensors.index.json`` and the
            files it names) or one ``.safetensors`` file.
        strict: raise, before reading anything, when a model key is missing from the checkpoint (ties count
            as present under any of their names) or a checkpoint key names no tensor of the model (keys the
            model's class ignores on load, ``_keys_to_ignore_on_load_unexpected``, aside), as
            ``load_state_dict(strict=True)``.
        device: where a meta tensor is materialized (default: CPU, or the device of the model's first real
            parameter).

    Returns:
        A :class:`LoadReport` (keys loaded, missing, unexpected, bytes read on this rank).

    Raises:
        TPLowerError: ``path`` is no safetensors folder or file; a key's global shape differs between model
            and checkpoint (naming the key); with ``strict``, keys missing or unexpected (naming them and the
            likely cause); a
            non-persistent buffer still on the meta device (it is not in any checkpoint: build the model
            under ``accelerate.init_empty_weights()``, which keeps buffers real).
    """
    from safetensors import safe_open

    if not isinstance(model, nn.Module):
        raise TypeError(f"load_safetensors: model must be a torch.nn.Module, got {type(model).__name__}")
    where = _weight_map(Path(path))
    if device is None:
        real = next((p for p in model.parameters() if not p.is_meta), None)
        device = real.device if real is not None else torch.device("cpu")
    dev = torch.device(device)
    report = LoadReport()
    _tie(model)
    ties: dict[str, str] = dict(getattr(model, "all_tied_weights_keys", None) or {})
    first: dict[int, str] = {}
    groups: dict[int, list[tuple[str, nn.Module, str, torch.Tensor, bool]]] = {}
    for item in _tensors(model):
        groups.setdefault(id(item[3]), []).append(item)
        first.setdefault(id(item[3]), item[0])
    known = {k for items in groups.values() for k, *_ in items}
    report.unexpected = sorted(k for k in where if k not in known and not _ignored(model, k))
    missing = [first[i] for i, items in groups.items()
               if not any(k in where or ties.get(k) in where for k, *_ in items)]
    if strict and (missing or report.unexpected):  # before reading anything
        raise TPLowerError(_mismatch(path, missing, report.unexpected))
    handles: dict[Path, Any] = {}
    try:
        for key_id, items in groups.items():
            found = next((it for it in items if it[0] in where), None)
            source = None if found is None else found[0]
            if found is None:  # a tie the model did not make (layouts differ): read the source's tensor
                found = next((it for it in items if ties.get(it[0]) in where), None)
                source = None if found is None else ties[found[0]]
            if found is None or source is None:
                report.missing.append(first[key_id])
                continue
            key, _, _, t, _ = found
            h = handles.get(where[source])
            if h is None:
                h = handles[where[source]] = safe_open(str(where[source]), framework="pt").__enter__()
            if t.is_meta:
                t = _make_real(items, dev)
                report.materialized.append(key)
            try:
                report.bytes_read += _fill(t, h, source)
            except TPLowerError as e:
                raise TPLowerError(f"load_safetensors: {key!r}: {e}") from None
            report.loaded.append(key)
            report.tied.update({k: key for k, *_ in items if k != key})
            if source != key:
                report.tied[key] = source
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    _refuse_meta_buffers(model)
    return report
