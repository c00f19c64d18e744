"""``tplower verify``: check a plan on a model against one process and name the first boundary that is wrong.

``--model NAME`` takes a model ``tplower run`` knows (its plan is the
default); ``--module PKG:ATTR`` imports ``ATTR`` from ``PKG``, a callable
that returns the full model (a class or a factory). Inputs: ``--input FILE``
(for ``--module``: a file of ``torch.save`` holding a tensor, a tuple of
positional inputs or a dict of keyword inputs; for ``--model``: sentences,
one a line), else ``PKG:example_inputs`` (a tensor, tuple or dict, or a
function returning one), else the built-in sentences for ``--model``. The
ranks are local gloo processes (``--nproc``); rank 0 prints.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..core.errors import TPLowerError
from ..testing import RankFailure, run_processes

__all__ = ["add_arguments", "main"]

_DEFAULT_TEXTS = 4  # sentences of the built-in list verify embeds
_LLAMA_TOKENS = 16  # bytes of each sentence llama-tiny reads


def add_model_arguments(parser: argparse.ArgumentParser, model_help: str = "a model tplower run knows") -> None:
    """``--model NAME`` or ``--module PKG:ATTR`` (one required), and ``--plan FILE|auto``: a model and its plan."""
    from ..run.models import MODELS

    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=sorted(MODELS), help=model_help)
    src.add_argument("--module", metavar="PKG:ATTR", help="import ATTR from PKG: a callable returning the model")
    parser.add_argument("--plan", metavar="FILE|auto", help="plan file (YAML/JSON) or 'auto' (a transformers "
                        "model's own plan); default for --model: its plan")
    parser.add_argument("--experts", default="tp", choices=("tp", "ep"),
                        help="with --plan auto, how mixture-of-experts blocks are parallelized: tp (tensor "
                             "parallelism inside the experts, default) or ep (expert parallelism: experts sharded "
                             "by index, tokens dispatched to them)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tplower verify``."""
    add_model_arguments(parser)
    parser.add_argument("--nproc", type=int, default=2, help="local gloo processes, one per tp rank (default 2)")
    parser.add_argument("--input", metavar="FILE", help="inputs: torch.save file (--module) or sentences (--model)")
    parser.add_argument("--input-placement", action="append", default=[], metavar="KEY=PLACEMENT",
                        help="an input the parallel model takes sharded, e.g. 0=S(1) (repeatable; default R)")
    parser.add_argument("--output-placement", default=None, metavar="PLACEMENT",
                        help="placement of the parallel model's output tensor, e.g. S(1) (default R)")
    parser.add_argument("--steps", type=int, default=1, help="passes; above 1 each is followed by an SGD step")
    parser.add_argument("--atol", type=float, default=None, help="absolute tolerance (default by dtype)")
    parser.add_argument("--rtol", type=float, default=None, help="relative tolerance (default by dtype)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is ended")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _import(path: str) -> tuple[Any, Any]:
    """``PKG:ATTR`` -> (the attribute, the module)."""
    mod_name, sep, attr = path.partition(":")
    if not sep or not mod_name or not attr:
        raise TPLowerError(f"--module {path!r}: write it as PKG:ATTR, e.g. mypkg.models:build")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise TPLowerError(f"--module {path!r}: cannot import {mod_name!r}: {exc}") from None
    if not hasattr(mod, attr):
        raise TPLowerError(f"--module {path!r}: {mod_name!r} has no attribute {attr!r}")
    return getattr(mod, attr), mod


def _placements(items: list[str]) -> dict[int | str, str]:
    out: dict[int | str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise TPLowerError(f"--input-placement {item!r}: write it as KEY=PLACEMENT, e.g. 0=S(1)")
        out[int(key) if key.isdigit() else key] = value
    return out


def _texts(path: str | None) -> list[str]:
    from ..run.models import read_sentences, sentences

    return read_sentences(path) if path else sentences()[:_DEFAULT_TEXTS]


def _model_inputs(name: str, tokenizer: Any, texts: list[str]) -> dict[str, torch.Tensor]:
    from ..run.models import LLAMA_TINY, LLAMA_TINY_CONFIG

    if name == LLAMA_TINY:
        pad = LLAMA_TINY_CONFIG["pad_token_id"]
        rows = [list(t.encode()[:_LLAMA_TOKENS]) for t in texts]
        rows = [r + [pad] * (_LLAMA_TOKENS - len(r)) for r in rows]
        return {"input_ids": torch.tensor(rows)}
    enc = tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    return dict(enc)


def _builder(spec: dict[str, Any]) -> tuple[Callable[[], nn.Module], Any]:
    """(build_model, inputs) for a spec made by :func:`_spec`, in a rank."""
    if spec["model"] is not None:
        from ..run.models import load_model

        name = spec["model"]
        tokenizer = load_model(name)[1]
        return (lambda: load_model(name)[0]), _model_inputs(name, tokenizer, spec["texts"])
    factory, mod = _import(spec["module"])
    inputs = spec["inputs"]
    if inputs is None:
        inputs = getattr(mod, "example_inputs", None)
        inputs = inputs() if callable(inputs) else inputs
    return factory, inputs


def _bar(done: int, total: int) -> None:
    if done < total and not sys.stderr.isatty():  # a log, not a terminal: the last line only
        return
    width = 30
    filled = width * done // max(total, 1)
    end = "\n" if done >= total else ""
    print(f"\rtplower verify: comparing [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end=end,
          file=sys.stderr, flush=True)


def _rank_body(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any] | None:
    from ..verification.verifier import verify

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    build, inputs = _builder(spec)
    report = verify(build, spec["plan"], mesh, inputs, steps=spec["steps"], atol=spec["atol"], rtol=spec["rtol"],
                    input_placements=spec["input_placements"], output_placement=spec["output_placement"],
                    progress=_bar if rank == 0 and spec["progress"] else None, experts=spec["experts"])
    return {**report.to_dict(), "table": report.table()} if rank == 0 else None


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    if args.nproc < 1:
        raise TPLowerError(f"--nproc {args.nproc}: at least 1")
    plan: Any = args.plan
    if args.model is not None:
        from ..run.models import check_tp, model_spec

        check_tp(args.model, args.nproc)
        if plan is None:
            plan = dict(model_spec(args.model).plan)
        return {"model": args.model, "module": None, "texts": _texts(args.input), "inputs": None,
                **_common(args, plan)}
    _import(args.module)  # fail here, not in every rank
    if plan is None:
        raise TPLowerError("--module needs --plan FILE or --plan auto")
    inputs = torch.load(args.input, weights_only=True) if args.input else None
    return {"model": None, "module": args.module, "texts": None, "inputs": inputs, **_common(args, plan)}


def _common(args: argparse.Namespace, plan: Any) -> dict[str, Any]:
    if isinstance(plan, str) and plan != "auto" and not Path(plan).is_file():
        raise TPLowerError(f"--plan {plan!r}: no such file (or write 'auto')")
    return {"plan": plan, "experts": args.experts, "steps": args.steps, "atol": args.atol, "rtol": args.rtol,
            "input_placements": _placements(args.input_placement), "output_placement": args.output_placement,
            "progress": not args.no_progress and not args.json}


def main(args: argparse.Namespace) -> int:
    """Run; exit 0 when the plan matches one process, 1 on a divergence, 2 on an error."""
    try:
        spec = _spec(args)
        if spec["progress"]:
            print(f"tplower verify: starting {args.nproc} processes ...", file=sys.stderr, flush=True)
        results = run_processes(args.nproc, _rank_body, spec, timeout=args.timeout)
    except (TPLowerError, ValueError, TypeError, OSError) as exc:
        print(f"tplower verify: error: {exc}", file=sys.stderr)
        return 2
    except RankFailure as exc:
        print(f"tplower verify: error: {exc}", file=sys.stderr)
        return 2
    report = results[0]
    assert report is not None
    table = report.pop("table")
    print(json.dumps(report, indent=2) if args.json else table)
    return 0 if report["ok"] else 1
