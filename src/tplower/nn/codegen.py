"""Write a parallelized model's forwards out as straight-line Python, and install them in place of the hooks.

:func:`emit` runs :func:`tplower.parallelize` on a weightless (meta) copy of
the model, reads back what it installed on each module, and writes one
``forward`` per module as plain code over the named bare operators of
:class:`~tplower.nn.codegen_ops.GeneratedOps`:

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
  vocabulary-parallel lookup writes its masking; ``partial_tail`` its split;
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
import dataclasses
import functools
import hashlib
import inspect
import itertools
import json
import pprint
import re
import sys
import textwrap
import types
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .. import __version__
from ..core.argcheck import check_mesh
from ..core.errors import TPLowerError
from ..core.placements import format_placements
from ..core.redistribute import mesh_lowerer
from .codegen_ops import GeneratedOps, operator_name
from .codegen_text import move_comment
from .hf_plans import resolve_model_plan
from .parallelize import REPLACED, _Boundary, _Move, parallelize
from .params import check_plain_parameter
from .plans import PlanValue

__all__ = ["GeneratedOps", "emit", "install"]

#: names the generated code uses for its own values; a forward whose signature uses one is not written out
_RESERVED = frozenset({"ops", "torch", "tplower", "type", "self", "out", "outs", "saved", "weight", "bias", "head",
                       "tail", "mine", "ids", "first", "rows", "padding_idx"})


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
             str(b.info.deferred_bias), str(b.lookup is not None), str(b.tail), str(type(b.compute).__name__),
             str("forward" in original.__dict__), str(inspect.signature(type(module).forward))]
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


def _literal(value: Any) -> str | None:
    text = repr(value)
    try:
        back = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    return text if type(back) is type(value) and back == value else None


class _Signature:
    """A forward's parameters as definition text and as call text (annotations dropped)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        params = list(inspect.signature(fn).parameters.values())[1:]  # drop self
        self.names = [p.name for p in params]
        self.params = params
        self.problem: str | None = None
        defs: list[str] = []
        call: list[str] = []
        star = False
        for i, p in enumerate(params):
            text = p.name
            if p.default is not p.empty:
                lit = _literal(p.default)
                if lit is None:
                    self.problem = f"the default of {p.name!r} is not a literal"
                text += f"={lit}"
            if p.kind == p.VAR_POSITIONAL:
                text, star = f"*{p.name}", True
                call.append(text)
            elif p.kind == p.VAR_KEYWORD:
                text = f"**{p.name}"
                call.append(text)
            elif p.kind == p.KEYWORD_ONLY:
                if not star:
                    defs.append("*")
                    star = True
                call.append(f"{p.name}={p.name}")
            else:
                call.append(p.name)
            defs.append(text)
            if p.kind == p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind != p.POSITIONAL_ONLY):
                defs.append("/")
        self.defs, self.call = ", ".join(["self", *defs]), ", ".join(call)
        if clash := sorted(_RESERVED.intersection(self.names)):
            self.problem = f"its forward has parameters named {clash}, which the generated code uses"


def _fn_name(qual: str, taken: set[str]) -> str:
    base = "forward_" + (re.sub(r"\W", "_", qual) or "root")
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def _q(text: str) -> str:
    """``text`` as a double-quoted Python string literal."""
    return json.dumps(text)


def _wrap(indent: str, head: str, args: list[str]) -> list[str]:
    """``head(args)`` on one line when it fits in 120 columns, else arguments on continuation lines."""
    one = f"{indent}{head}({', '.join(args)})"
    if len(one) <= 120:
        return [one]
    inner, lines = indent + "    ", [f"{indent}{head}("]
    line = ""
    for a in args:  # fill each continuation line up to 120 columns
        if line and len(inner) + len(line) + len(a) + 2 > 120:
            lines.append(f"{inner}{line.rstrip()}")
            line = ""
        line += f"{a}, "
    return [*lines, f"{inner}{line.rstrip(', ')},", f"{indent})"]


def _call(var: str, mv: _Move, mode: str, n: Mapping[str, int], indent: str) -> list[str]:
    """The comment lines and the operator call that move ``var`` by ``mv``."""
    op = "dtensor" if mode == "dtensor" else operator_name(mv.src, mv.dst)
    args = [var, _q(format_placements(mv.src)), _q(format_placements(mv.dst)), f"grad={_q(format_placements(mv.grad))}",
            f"where={_q(mv.where)}"] + (["uneven=True"] if mv.uneven else [])
    label = mv.name if not (mv.name.isdigit() or mv.name == "out") or var.startswith("outs[") else var
    lines = [f"{indent}# {c}" for c in move_comment(dataclasses.replace(mv, name=label), n)]
    return [*lines, *_wrap(indent, f"{var} = ops.{op}", args)]


class _Writer:
    """One module's generated forward."""

    def __init__(self, qual: str, module: nn.Module, b: _Boundary, n: Mapping[str, int], original: nn.Module) -> None:
        self.qual, self.module, self.b, self.n = qual, module, b, n
        self.sig = _Signature(type(module).forward)
        self.reason = self.sig.problem
        if "forward" in original.__dict__:
            self.reason = "it has an instance forward of its own"
        elif b.lookup is not None and type(module) is not nn.Embedding:
            self.reason = "its masked_lookup is written out for nn.Embedding only"
        # nn.Linear and nn.Embedding are written out unless the plan injects their local compute
        self.direct = type(module) in (nn.Linear, nn.Embedding) and not isinstance(b.compute, functools.partial)
        if self.direct and any(mv.slot > 0 for mv in b.outs):
            self.reason = f"{type(module).__name__} returns one tensor but the plan moves output {b.outs[0].slot}"
        for mv in b.ins:
            p = self.sig.params[mv.slot] if 0 <= mv.slot < len(self.sig.params) else None
            if p is None and mv.keyword in self.sig.names:
                p = self.sig.params[self.sig.names.index(mv.keyword)]
            if p is not None and p.kind == p.VAR_POSITIONAL:
                self.reason = f"input {mv.name!r} it moves arrives in *{p.name}"
            elif p is not None and p.default is not p.empty and p.default is not None:
                self.reason = (f"input {mv.name!r} it moves has a default ({p.default!r}) that is not a tensor, "
                               "and only a call shows whether it was given")

    def _header(self, name: str) -> list[str]:
        info = self.b.info
        why = f", {info.reason}" if info.reason else ""
        doc = f"{self.qual or '(root)'} ({type(self.module).__name__}): {info.form.form} boundary, {info.mode}{why}."
        doc = doc.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')  # a module name is any string
        return [f"def {name}({self.sig.defs}):", f'    """{doc}"""']

    def lines(self, name: str) -> list[str]:
        if self.reason is not None:  # the boundary's own calling convention: every argument passes as given
            self.sig.defs = "self, *args, **kwargs"
            note = textwrap.wrap(f"not written out: {self.reason}; the installed boundary runs it", 110)
            return [*self._header(name), *(f"    # {line}" for line in note),
                    "    return ops.hooked(self, *args, **kwargs)"]
        out = self._header(name)
        out += self._inputs()
        out += self._compute()
        out += self._outputs()
        return out

    def _inputs(self) -> list[str]:
        lines: list[str] = []
        for mv in self.b.ins:
            if mv.slot >= 0 or mv.keyword in self.sig.names:
                var = mv.keyword if mv.keyword in self.sig.names else self.sig.names[mv.slot]
                lines += _call(var, mv, self.b.info.mode, self.n, "    ")
            else:  # arrives in **kwargs
                kw = self.sig.names[-1]
                key = _q(mv.keyword or mv.name)
                lines += [f"    if {key} in {kw}:", *_call(f"{kw}[{key}]", mv, self.b.info.mode, self.n, "        ")]
        return lines

    def _deferred(self) -> str | None:
        return self.b.info.deferred_bias

    def _compute(self) -> list[str]:
        b, m = self.b, self.module
        bias = self._deferred()
        lines: list[str] = []
        if bias is not None:
            lines.append(f"    bias = ops.param(self, {_q(bias)})  # deferred: added once after the output moves")
        if self.direct and isinstance(m, nn.Linear):
            lines.append('    weight = ops.param(self, "weight")')
            if m._parameters.get("bias") is not None and bias is None:
                lines += ['    bias = ops.param(self, "bias")',
                          f"    out = torch.nn.functional.linear({self.sig.names[0]}, weight, bias)"]
            else:
                lines.append(f"    out = torch.nn.functional.linear({self.sig.names[0]}, weight)")
            return lines
        if self.direct and isinstance(m, nn.Embedding):
            ids, pad = self.sig.names[0], "self.padding_idx"
            lines.append('    weight = ops.param(self, "weight")')
            if b.lookup is not None:
                lines += ["    # vocabulary-parallel lookup: ids outside this rank's rows look up row 0, then give 0",
                          "    first, rows, padding_idx = ops.lookup_rows(self)",
                          f"    ids = {ids} - first", "    mine = (ids >= 0) & (ids < rows)",
                          "    ids = ids.masked_fill(~mine, 0)"]
                ids, pad = "ids", "padding_idx"
            lines += _wrap("    ", "out = torch.nn.functional.embedding",
                           [ids, "weight", pad, "self.max_norm", "self.norm_type", "self.scale_grad_by_freq",
                            "self.sparse"])
            if b.lookup is not None:
                lines.append("    out = out.masked_fill(~mine.unsqueeze(-1), 0)")
            return lines
        names = tuple(n for n, _ in b.params if n != bias)
        if isinstance(b.compute, functools.partial):  # the plan's local_compute, bound to the module
            fn, args = "ops.compute(self)", self.sig.call
        else:
            fn, args = "type(self).forward", ", ".join(["self", self.sig.call] if self.sig.call else ["self"])
        if not names and bias is None:
            return [*lines, f"    out = {fn}({args})"]
        names_text = "(" + ", ".join(_q(x) for x in names) + ("," if len(names) == 1 else "") + ")"
        drop = f", drop=({_q(bias)},)" if bias is not None else ""
        lines += [f"    saved = ops.local_params(self, {names_text}{drop})", "    try:",
                  f"        out = {fn}({args})", "    finally:", "        ops.restore_params(self, saved)"]
        return lines

    def _outputs(self) -> list[str]:
        b = self.b
        bias = self._deferred()
        if not b.outs and bias is None and not b.tail:
            return ["    return out"]
        lines: list[str] = []
        if self.direct:
            var = "out"
        else:
            need = max([mv.slot for mv in b.outs] + [0]) + 1
            lines.append(f"    outs = ops.outputs(out, {need}, {_q('module ' + repr(b.info.module))})")
        for mv in b.outs:
            var = "out" if self.direct else f"outs[{mv.slot}]"
            lines += _call(var, mv, b.info.mode, self.n, "    ")
        first = "out" if self.direct else "outs[0]"
        if bias is not None:
            lines.append(f"    {first} = {first} + bias.to({first}.dtype)  # the deferred bias, in the output's dtype")
        if b.tail:
            tail_mv = _Move(0, None, "tail", b.tail_rep, b.tail_rep, b.tail_grad, f"module {b.info.module!r}, "
                            "partial_tail", False)
            lines += [f"    # partial_tail: the last {b.tail} features pass unchanged; their gradient is partial",
                      f"    head, tail = {first}.split([{first}.shape[-1] - {b.tail}, {b.tail}], dim=-1)",
                      *_call("tail", tail_mv, "lowered", self.n, "    "),
                      f"    {first} = torch.cat([head, tail], dim=-1)"]
        lines.append("    return out" if self.direct else "    return ops.pack(out, outs)")
        return lines


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
         axis: str = "tp") -> str:
    """Python source of ``model``'s forwards as :func:`tplower.parallelize` would install them on ``mesh``.

    Args:
        model: the unparallelized model (not modified; its weights are not
            read or copied: the work happens on a meta-device copy).
        mesh: a live device mesh this rank is in (a ``fake`` process group
            will do: nothing communicates); its axis names and sizes are
            written into the file.
        plan: as :func:`tplower.parallelize` (a mapping, a YAML/JSON path or ``"auto"``).
        axis: the tensor-parallel axis HF styles shard on.

    Returns:
        The source of a Python module (see :mod:`tplower.nn.codegen`), the
        same bytes for the same model, plan and mesh.

    Raises:
        TypeError: as :func:`tplower.parallelize`.
        TPLowerError: as :func:`tplower.parallelize`, or a plan whose values
            are not Python literals.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"emit: model must be a torch.nn.Module, got {type(model).__name__}")
    check_mesh(mesh, "mesh", "emit")
    resolved = resolve_model_plan(plan, model)
    plan_text = _plan_text(resolved)
    _, found = _boundaries(model, mesh, resolved, axis, "emit", quiet=False)
    axes = _mesh_axes(mesh)
    n = {name: size for name, size in axes}
    originals = dict(model.named_modules())
    taken: set[str] = set()
    bodies: list[str] = []
    table: list[tuple[str, str, str]] = []
    for qual, (module, b) in found.items():
        name = _fn_name(qual, taken)
        bodies.append("\n".join(_Writer(qual, module, b, n, originals[qual]).lines(name)))
        table.append((qual, name, _fingerprint(module, b, originals[qual])))
    mesh_text = ", ".join(f"{k}={v}" for k, v in n.items())
    uses_torch = any("torch." in body for body in bodies)
    head = [
        f'"""Forwards of {type(model).__name__} parallelized by tplower on mesh {mesh_text}, written out.',
        "",
        f"Generated by tplower.nn.codegen.emit (tplower {__version__}); do not edit: emit again. Install with",
        "tplower.nn.codegen.install(model, mesh, this_file), which shards the parameters as tplower.parallelize",
        "does and binds these forwards in place of its hooks. Every ops call moves a local tensor through",
        "tplower's lowered collectives; comments give the transition, its backward and what it moves.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        *(["import torch", ""] if uses_torch else []),
        "import tplower.nn.codegen",
        "",
        f"AXIS = {_q(axis)}",
        "#: the mesh's axes and sizes, in order",
        f"MESH = {json.dumps(axes)}",
        f"PLAN = {plan_text}",
        "",
        "#: bound to the live mesh by tplower.nn.codegen.install",
        "ops = tplower.nn.codegen.GeneratedOps.unbound()",
    ]
    forwards = ["FORWARDS = {", *(f"    {_q(q)}: {f}," for q, f, _ in table), "}",
                "#: what each forward assumes of its module (class, parameters, placements, moves); install checks it",
                "FINGERPRINTS = {", *(f"    {_q(q)}: {_q(h)}," for q, _, h in table), "}"]
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
            raise TPLowerError(f"install: {filename} defines no {key}; it is not a file tplower.nn.codegen.emit wrote")
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
