"""Write a parallelized model's forwards out as straight-line Python, and install them in place of the hooks.

:func:`emit` runs :func:`tplower.parallelize` on a weightless (meta) copy of
the model, reads back what it installed on each module, and writes one
``forward`` per module as plain code over the named bare operators of
:class:`~tplower.codegen.ops.GeneratedOps`:

* an identity boundary writes nothing (the module keeps its class forward);
* each moved input or output is one call (``ops.all_gather``,
  ``ops.all_reduce``, ``ops.reduce_scatter``, ``ops.all_to_all``,
  ``ops.chunk``, ``ops.identity`` for a move of the gradient only,
  ``ops.transition`` for several axes at once), under a comment giving the
  transition, its backward, the local shapes it assumes and the share of
  the tensor each rank moves;
* parameters are taken as local tensors (``ops.param``); ``nn.Linear`` and
  ``nn.Embedding`` are written as ``torch.nn.functional.linear`` /
  ``embedding`` calls, other modules call their class ``forward`` (or the
  plan's ``local_compute``) with local parameters swapped in;
* the deferred row-parallel bias is an explicit line after the reduction; a
  vocabulary-parallel lookup writes its masking; ``partial_tail`` its split; ``share`` its division;
* a generic boundary calls ``ops.dtensor`` (DTensor's ``redistribute``) with
  a comment saying why; a module whose forward cannot be written out (a
  signature default that is not a literal, a name the code needs, an
  instance ``forward``) calls ``ops.hooked``, the installed boundary.

The file imports only ``torch`` and ``tplower``, holds the plan, the axis and
the mesh shape it was written for, and is deterministic: the same model,
plan and mesh give the same bytes. :func:`install` parallelizes a model as
:func:`tplower.parallelize` does and binds the generated forwards in place of
the hooks; outputs and gradients are bit-identical (the same cached programs
run on the same local tensors).
"""

from __future__ import annotations

import ast
import copy
import hashlib
import inspect
import itertools
import json
import pprint
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._version import __version__
from ..core.language.placements import format_placements
from ..core.lower.redistribute import mesh_lowerer
from ..core.support.argcheck import check_mesh
from ..core.support.errors import TPLowerError
from ..nn.parallelize import parallelize
from ..plans.entries import PlanValue
from ..plans.hf import resolve_model_plan
from ..runtime.boundary import REPLACED, _Boundary
from ..runtime.params import check_plain_parameter
from .ops import GeneratedOps
from .writer import Writer, fn_name, quote

__all__ = ["GeneratedOps", "emit", "install"]


def _meta_copy(model: nn.Module, func: str) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (no weights copied).

    Raises:
        TPLowerError: a parameter is already a DTensor, or the model cannot be deep-copied.
    """
    memo: dict[int, Any] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        check_plain_parameter(p, f"{func}: parameter {name!r}")
        memo.setdefault(id(p), nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
    for _, b in model.named_buffers(remove_duplicate=False):
        memo.setdefault(id(b), torch.empty_like(b, device="meta"))
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:  # e.g. a lock or a process group held by a module
        raise TPLowerError(f"{func}: the model cannot be deep-copied ({type(exc).__name__}: {exc}); {func} works "
                           "on a weightless copy of it") from None


def _boundaries(model: nn.Module, mesh: DeviceMesh, plan: Mapping[str, PlanValue], axis: str, func: str,
                quiet: bool) -> tuple[nn.Module, dict[str, tuple[nn.Module, _Boundary]]]:
    """Parallelize a meta copy of ``model``: the copy and, per planned module, (module, its installed boundary)."""
    shadow = _meta_copy(model, func)
    with warnings.catch_warnings():
        if quiet:  # the warnings come again when the live model is parallelized
            warnings.simplefilter("ignore")
        parallelize(shadow, mesh, plan, axis=axis)
    found = {}
    for qual, module in shadow.named_modules():
        b = module.__dict__.get("forward")
        if isinstance(b, _Boundary):
            found[qual] = (module, b)
    return shadow, found


def _fingerprint(module: nn.Module, b: _Boundary, original: nn.Module) -> str:
    """What a generated forward assumes about its module: class, parameters and placements, moves, extras."""
    layouts = dict(b.params)
    parts = [f"{type(module).__module__}.{type(module).__qualname__}", b.info.form.form, b.info.mode,
             str(b.info.deferred_bias), str(b.lookup is not None), str(b.tail), str((b.share, b.share_n)),
             str(type(b.compute).__name__),
             str("forward" in original.__dict__),
             # names and kinds only: a default's or an annotation's repr may hold a memory address
             str([(p.name, p.kind.name) for p in inspect.signature(type(module).forward).parameters.values()])]
    for name, p in module._parameters.items():
        layout = layouts.get(name)
        parts.append(f"{name}:{None if p is None else tuple(p.shape)}:"
                     f"{None if layout is None else (format_placements(layout.placements), layout.grad)}")
    for mv in b.ins + b.outs:
        parts.append(repr((mv.slot, mv.keyword, mv.name, format_placements(mv.src), format_placements(mv.dst),
                           format_placements(mv.grad), mv.uneven)))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _mesh_axes(mesh: DeviceMesh) -> list[list[Any]]:
    """``[[axis name, size], ...]`` in mesh order (unnamed axes as tplower names them: ``dim0``, ...)."""
    lowerer = mesh_lowerer(mesh)
    return [[name, size] for name, size in zip(lowerer.names, lowerer.shape, strict=True)]


def _plan_text(plan: Mapping[str, PlanValue]) -> str:
    text = pprint.pformat(dict(plan), width=110, sort_dicts=False)
    try:
        same = ast.literal_eval(text) == dict(plan)
    except (ValueError, SyntaxError):
        same = False
    if not same:
        raise TPLowerError("codegen: the plan holds values that are not Python literals (str, int, dict, list); "
                           "give it as a mapping of literals or a YAML/JSON file")
    return text


def emit(model: nn.Module, mesh: DeviceMesh, plan: Mapping[str, PlanValue] | str | Path, *,
         axis: str = "tp", experts: str = "tp") -> str:
    """Python source of ``model``'s forwards as :func:`tplower.parallelize` would install them on ``mesh``.

    Args:
        model: the unparallelized model (not modified; its weights are not
            read or copied: the work happens on a meta-device copy).
        mesh: a live device mesh this rank is in (a ``fake`` process group
            will do: nothing communicates); its axis names and sizes are
            written into the file.
        plan: as :func:`tplower.parallelize` (a mapping, a YAML/JSON path, ``"auto"`` or ``"derive"``).
        axis: the tensor-parallel axis HF styles shard on.
        experts: as :func:`tplower.parallelize`: with ``"auto"``, ``"tp"``
            (tensor parallelism inside the experts) or ``"ep"`` (expert
            parallelism); the file's ``PLAN`` is the plan it resolves to, so
            :func:`install` needs no such argument.

    Returns:
        The source of a Python module (see :mod:`tplower.codegen.emit`), the
        same bytes for the same model, plan and mesh.

    Raises:
        TypeError: as :func:`tplower.parallelize`.
        ValueError: ``experts`` is neither ``"tp"`` nor ``"ep"``.
        TPLowerError: as :func:`tplower.parallelize`, or a plan whose values
            are not Python literals.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"emit: model must be a torch.nn.Module, got {type(model).__name__}")
    check_mesh(mesh, "mesh", "emit")
    if experts not in ("tp", "ep"):
        raise ValueError(f"emit: experts={experts!r}; allowed: 'tp' (tensor parallelism inside the experts), "
                         "'ep' (expert parallelism)")
    names = tuple(mesh.mesh_dim_names or ())
    resolved = resolve_model_plan(plan, model, experts=experts, axis=axis,
                                  tp=mesh.size(names.index(axis)) if axis in names else None)
    plan_text = _plan_text(resolved)
    _, found = _boundaries(model, mesh, resolved, axis, "emit", quiet=False)
    axes = _mesh_axes(mesh)
    n = {name: size for name, size in axes}
    originals = dict(model.named_modules())
    taken: set[str] = set()
    bodies: list[str] = []
    table: list[tuple[str, str, str]] = []
    for qual, (module, b) in found.items():
        name = fn_name(qual, taken)
        bodies.append("\n".join(Writer(qual, module, b, n, originals[qual]).lines(name)))
        table.append((qual, name, _fingerprint(module, b, originals[qual])))
    mesh_text = ", ".join(f"{k}={v}" for k, v in n.items())
    uses_torch = any("torch." in body for body in bodies)
    head = [
        f'"""Forwards of {type(model).__name__} parallelized by tplower on mesh {mesh_text}, written out.',
        "",
        f"Generated by tplower.codegen.emit (tplower {__version__}); do not edit: emit again. Install with",
        "tplower.codegen.install(model, mesh, this_file), which shards the parameters as tplower.parallelize",
        "does and binds these forwards in place of its hooks. Every ops call moves a local tensor through",
        "tplower's lowered collectives; comments give the transition, its backward and what it moves.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        # one import block: where the file lives, torch and tplower are both third-party (ruff's isort, I001)
        *(["import torch"] if uses_torch else []),
        "import tplower.codegen",
        "",
        f"AXIS = {quote(axis)}",
        "#: the mesh's axes and sizes, in order",
        f"MESH = {json.dumps(axes)}",
        f"PLAN = {plan_text}",
        "",
        "#: bound to the live mesh by tplower.codegen.install",
        "ops = tplower.codegen.GeneratedOps.unbound()",
    ]
    forwards = ["FORWARDS = {", *(f"    {quote(q)}: {f}," for q, f, _ in table), "}",
                "#: what each forward assumes of its module (class, parameters, placements, moves); install checks it",
                "FINGERPRINTS = {", *(f"    {quote(q)}: {quote(h)}," for q, _, h in table), "}"]
    return "\n".join(head) + "\n\n\n" + "\n\n\n".join(bodies) + "\n\n\n" + "\n".join(forwards) + "\n"


_INSTALLS = itertools.count()


def _mesh_text(axes: list[list[Any]]) -> str:
    return ",".join(f"{name}={size}" for name, size in axes) if isinstance(axes, list) else repr(axes)


def _namespace(source: str | Path) -> dict[str, Any]:
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source):
        path = Path(source)
        if not path.is_file():
            raise TPLowerError(f"install: source {str(source)!r} is neither a file nor generated source text")
        text, filename = path.read_text(), str(path)
    elif isinstance(source, str):
        text, filename = source, "<tplower generated>"
    else:
        raise TypeError(f"install: source must be a path or source text, got {type(source).__name__}")
    # a real module in sys.modules, one per install: torch.compile looks the forwards' globals up by module name
    module = types.ModuleType(f"tplower_generated_{next(_INSTALLS)}")
    module.__file__ = filename
    sys.modules[module.__name__] = module
    ns: dict[str, Any] = module.__dict__
    exec(compile(text, filename, "exec"), ns)
    for key in ("AXIS", "MESH", "PLAN", "FORWARDS", "FINGERPRINTS", "ops"):
        if key not in ns:
            raise TPLowerError(f"install: {filename} defines no {key}; it is not a file tplower.codegen.emit wrote")
    return ns


def install(model: nn.Module, mesh: DeviceMesh, source: str | Path) -> nn.Module:
    """Parallelize ``model`` on ``mesh`` and run the generated forwards of ``source`` in place of the hooks.

    Args:
        model: the unparallelized model (as :func:`tplower.parallelize`).
        mesh: the live mesh; its axis names and sizes must be those the file was emitted for.
        source: a path to a file :func:`emit` wrote, or its text.

    Returns:
        ``model``, its parameters sharded exactly as :func:`tplower.parallelize`
        shards them and every planned module's ``forward`` the generated
        one; outputs and gradients are bit-identical to the hook-installed model's.

    Raises:
        TypeError: as :func:`tplower.parallelize`, or ``source`` of another type.
        TPLowerError: the file is not from :func:`emit`, was written for
            another mesh (axis names, order or sizes), or no longer matches
            the model (a planned module without a generated forward, a
            forward of no planned module, or a module whose class,
            parameters, placements or moves differ from those it was
            emitted for). Every check runs on a weightless copy before the
            model is touched: a refused install leaves ``model`` as it was.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"install: model must be a torch.nn.Module, got {type(model).__name__}")
    check_mesh(mesh, "mesh", "install")
    ns = _namespace(source)
    axes = _mesh_axes(mesh)
    if axes != ns["MESH"]:
        raise TPLowerError(f"install: the file was emitted for mesh {_mesh_text(ns['MESH'])}, this mesh is "
                           f"{_mesh_text(axes)}; emit it again")
    _, found = _boundaries(model, mesh, ns["PLAN"], ns["AXIS"], "install", quiet=True)
    forwards: dict[str, Callable[..., Any]] = ns["FORWARDS"]
    if set(forwards) != set(found):
        missing, extra = sorted(set(found) - set(forwards)), sorted(set(forwards) - set(found))
        raise TPLowerError(f"install: the file does not match the model: planned modules without a generated "
                           f"forward {missing}, generated forwards of no planned module {extra}; emit it again")
    originals = dict(model.named_modules())
    for qual, (module, b) in found.items():
        if _fingerprint(module, b, originals[qual]) != ns["FINGERPRINTS"].get(qual):
            raise TPLowerError(f"install: module {qual!r} ({type(module).__name__}) is not the one the file was "
                               "emitted for (its class, parameters, placements or moves differ); emit it again")
    parallelize(model, mesh, ns["PLAN"], axis=ns["AXIS"])
    ops = GeneratedOps(mesh)
    ns["ops"] = ops
    for qual in found:
        module = originals[qual]
        live: _Boundary = module.__dict__["forward"]
        ops.bind(module, live)
        module.__dict__[REPLACED] = live
        module.forward = types.MethodType(forwards[qual], module)
    return model
