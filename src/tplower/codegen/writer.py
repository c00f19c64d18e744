"""The text of one generated forward (:mod:`tplower.codegen.emit`): signature, moves, compute, outputs.

:class:`Writer` turns what :func:`tplower.parallelize` installed on one
module (its :class:`~tplower.runtime.boundary._Boundary`) into the lines
of a ``forward``; a module it cannot write out (a signature default that is
not a literal, an input in ``*args``, a name the code needs, an instance
``forward``) gets a forward that calls the installed boundary, with the
reason as a comment.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import re
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ..core.language.placements import format_placements
from ..runtime.boundary import _Boundary
from ..runtime.experts import ExpertDispatch
from ..runtime.movers import _Move
from .ops import operator_name
from .text import move_comment

__all__ = ["Writer", "fn_name", "quote"]

#: names the generated code uses for its own values; a forward whose signature uses one is not written out
_RESERVED = frozenset({"ops", "torch", "tplower", "type", "self", "out", "outs", "saved", "weight", "bias", "head",
                       "tail", "mine", "ids", "first", "rows", "padding_idx", "route", "ones"})


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


def fn_name(qual: str, taken: set[str]) -> str:
    base = "forward_" + (re.sub(r"\W", "_", qual) or "root")
    name, k = base, 2
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def quote(text: str) -> str:
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


def _call(var: str, mv: _Move, mode: str, n: Mapping[str, int], indent: str, fan: str | None = None) -> list[str]:
    """The comment lines and the operator call that move ``var`` by ``mv`` (``fan``: its sibling group's key)."""
    op = "dtensor" if mode == "dtensor" else operator_name(mv.src, mv.dst)
    src, dst, grad = (quote(format_placements(p)) for p in (mv.src, mv.dst, mv.grad))
    args = [var, src, dst, f"grad={grad}", f"where={quote(mv.where)}"] + (["uneven=True"] if mv.uneven else [])
    args += ["sized=True"] if mv.sized else []
    args += [f"fan={quote(fan)}"] if fan is not None else []
    label = mv.name if not (mv.name.isdigit() or mv.name == "out") or var.startswith("outs[") else var
    lines = [f"{indent}# {c}" for c in move_comment(dataclasses.replace(mv, name=label), n)]
    return [*lines, *_wrap(indent, f"{var} = ops.{op}", args)]


class Writer:
    """One module's generated forward."""

    def __init__(self, qual: str, module: nn.Module, b: _Boundary, n: Mapping[str, int], original: nn.Module) -> None:
        self.qual, self.module, self.b, self.n = qual, module, b, n
        self.sig = _Signature(type(module).forward)
        self.reason = self.sig.problem
        if "forward" in original.__dict__:
            self.reason = "it has an instance forward of its own"
        elif b.lookup is not None and type(module) is not nn.Embedding:
            self.reason = "its masked_lookup is written out for nn.Embedding only"
        self.experts = isinstance(b.compute, ExpertDispatch)
        if self.experts and (len(self.sig.names) < 3 or self.sig.call.split(", ")[:3] != self.sig.names[:3]):
            self.reason = "its expert dispatch needs forward(hidden_states, top_k_index, top_k_weights, ...)"
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
        self.moved: list[str] = []  # the moved inputs, as expressions (for the tie)
        for mv, fan in zip(self.b.ins, self.b.fan, strict=True):
            if mv.slot >= 0 or mv.keyword in self.sig.names:
                var = mv.keyword if mv.keyword in self.sig.names else self.sig.names[mv.slot]
                lines += _call(var, mv, self.b.info.mode, self.n, "    ", fan)
                self.moved.append(var)
            else:  # arrives in **kwargs
                kw = self.sig.names[-1]
                key = quote(mv.keyword or mv.name)
                lines += [f"    if {key} in {kw}:",
                          *_call(f"{kw}[{key}]", mv, self.b.info.mode, self.n, "        ", fan)]
                self.moved.append(f"{kw}.get({key})")
        return lines

    def _tie(self) -> list[str]:
        """The lines that join the moved inputs and local parameters to ``out`` (``ops.tie``), as the runtime does."""
        if not self.b.tie:
            return []
        moved = "(" + ", ".join(self.moved) + ("," if len(self.moved) == 1 else "") + ")"
        return ["# every backward collective runs on every rank, even where out leaves an input or parameter out",
                f"out = ops.tie(self, out, {moved})"]

    def _deferred(self) -> str | None:
        return self.b.info.deferred_bias

    def _compute(self) -> list[str]:
        b, m = self.b, self.module
        bias = self._deferred()
        lines: list[str] = []
        if bias is not None:
            lines.append(f"    bias = ops.param(self, {quote(bias)})  # deferred: added once after the output moves")
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
        after: list[str] = []
        if isinstance(b.compute, functools.partial):  # the plan's local_compute, bound to the module
            fn, args = "ops.compute(self)", self.sig.call
        elif self.experts:  # expert parallelism: the module's own forward on the rows its experts take
            h, ids, w = self.sig.names[:3]
            rest = self.sig.call.split(", ")[3:]
            lines += ["    # expert parallelism: plan the exchange (all_gather of per-expert counts), send each slot's",
                      "    # token to the rank holding its expert (all_to_all), run the local experts, send back",
                      f"    route = ops.expert_route(self, {ids})",
                      f"    rows = ops.dispatch_tokens({h}, route)",
                      f"    ones = torch.ones(rows.shape[0], 1, dtype={w}.dtype, device=rows.device)"]
            fn = "type(self).forward"
            args = ", ".join(["self", "rows", "route.local_experts[:, None]", "ones", *rest])
            after = [f"    out = ops.combine_tokens(out, route, {w}, dispatched=rows)  # all_to_all back, weighted sum"]
        else:
            fn, args = "type(self).forward", ", ".join(["self", self.sig.call] if self.sig.call else ["self"])
        if not names and bias is None:
            return [*lines, f"    out = {fn}({args})", *("    " + t for t in self._tie()), *after]
        names_text = "(" + ", ".join(quote(x) for x in names) + ("," if len(names) == 1 else "") + ")"
        drop = f", drop=({quote(bias)},)" if bias is not None else ""
        lines += [f"    saved = ops.local_params(self, {names_text}{drop})", "    try:",
                  f"        out = {fn}({args})", *("        " + t for t in self._tie()), "    finally:",
                  "        ops.restore_params(self, saved)", *after]
        return lines

    def _region(self) -> list[str]:
        """The line that switches dropout streams where the outputs open or close a sharded region, as the runtime."""
        if self.b.region is None or self.b.streams is None:
            return []
        what = "sharded: this rank's own dropout stream" if self.b.region else "whole: the common dropout stream"
        return [f"    ops.dropout_region(self)  # the outputs are {what}"]

    def _outputs(self) -> list[str]:
        b = self.b
        bias = self._deferred()
        if not b.outs and bias is None and not b.tail and not b.share:
            return [*self._region(), "    return out"]
        lines: list[str] = []
        if self.direct:
            var = "out"
        else:
            need = max([mv.slot for mv in b.outs] + list(b.share) + [0]) + 1
            lines.append(f"    outs = ops.outputs(out, {need}, {quote('module ' + repr(b.info.module))})")
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
        for slot in b.share:
            var = "out" if self.direct else f"outs[{slot}]"
            lines.append(f"    {var} = {var} / {b.share_n}  # share: this rank's 1/{b.share_n} of a sum, "
                         "its gradient divided alike")
        lines += self._region()
        lines.append("    return out" if self.direct else "    return ops.pack(out, outs)")
        return lines
