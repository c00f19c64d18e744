"""``tplower verify``: check a plan on a model against one process and name the first boundary that is wrong.

``--model NAME`` takes a model ``tplower run`` knows (its plan is the
default); ``--module PKG:ATTR`` imports ``ATTR`` from ``PKG``, a callable
that returns the full model (a class or a factory). Inputs: ``--input FILE``
(for ``--module``: a file of ``torch.save`` holding a tensor, a tuple of
positional inputs or a dict of keyword inputs; for ``--model``: sentences,
one a line), else ``PKG:example_inputs`` (a tensor, tuple or dict, or a
function returning one), else the built-in sentences for ``--model``. The
ranks are local gloo processes (``--nproc``); rank 0 prints.

``--context CP`` checks context parallelism too: the mesh is ``(cp, tp)`` of
``CP x --nproc`` processes, the model is parallelized with ``context="cp"``
and checked by :func:`tplower.verification.context.verify_context` (each
attention module's exchanges, the loss, logits and every gradient); the
inputs need ``input_ids`` (for a causal LM of ``--model``, ``labels`` are
the ids, padding ignored; a model without a loss gets verify's default loss
on its gathered output).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core.support.errors import TPLowerError
from ..core.support.words import count
from .errors import non_negative_float, positive_float, positive_int
from .target import add_model_arguments, build_module, check_plan, import_attr, plan_value

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["add_arguments", "main"]

_DEFAULT_TEXTS = 4  # sentences of the built-in list verify embeds
_LLAMA_TOKENS = 16  # bytes of each sentence llama-tiny reads
#: ``--context-mode``'s choices, the first the default: :data:`tplower.context.attention.MODES`, named here without
#: importing torch
_MODES = ("ulysses", "allgather", "hybrid")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tplower verify``."""
    add_model_arguments(parser)
    parser.add_argument("--nproc", type=positive_int, default=2,
                        help="local gloo processes, one per tp rank (default 2)")
    parser.add_argument("--input", metavar="FILE", help="inputs: a file of torch.save (.pt) for --module, sentences "
                        "(one a line) for --model; default: PKG:example_inputs, or built-in sentences")
    parser.add_argument("--input-placement", action="append", default=[], metavar="KEY=PLACEMENT",
                        help="an input the parallel model takes sharded, named by keyword or position: e.g. 0=S(1) "
                             "for a --module whose plan takes its first input split on dim 1 (repeatable; default "
                             "R, whole on every rank, as --model's plans take input_ids and the rest)")
    parser.add_argument("--output-placement", default=None, metavar="PLACEMENT",
                        help="placement of the parallel model's output tensor, e.g. S(1) (default R)")
    parser.add_argument("--steps", type=positive_int, default=1,
                        help="passes; above 1 each is followed by an SGD step")
    parser.add_argument("--atol", type=non_negative_float, default=None, help="absolute tolerance (default by dtype)")
    parser.add_argument("--rtol", type=non_negative_float, default=None, help="relative tolerance (default by dtype)")
    parser.add_argument("--context", type=positive_int, default=None, metavar="CP",
                        help="also split the sequence over CP ranks (context parallelism; CP x --nproc processes)")
    parser.add_argument("--context-mode", default=None, choices=_MODES,
                        help="with --context: all_to_all of heads (ulysses, default), gathered keys and values "
                             "(allgather), or Ulysses inside groups of the CP ranks and gathered across (hybrid)")
    parser.add_argument("--timeout", type=positive_float, default=600.0, help="seconds before the run is ended")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


#: the placements an input of the 1-D ``tp`` mesh may take (a Partial input has no meaning for a model's input)
_INPUT_FORMS = "R (whole on every rank) or S(d) (split along tensor dim d), e.g. 0=S(1) or input_ids=R"


def _placements(items: list[str]) -> dict[int | str, str]:
    """``["0=S(1)", "mask=R"]`` -> ``{0: "S(1)", "mask": "R"}``: the inputs of ``--input-placement``.

    Raises:
        TPLowerError: an item that is not ``KEY=PLACEMENT``, a placement that does not parse or is a Partial; the
            message names ``--input-placement``, the item, the bad part and the allowed forms.
    """
    out: dict[int | str, str] = {}
    for item in items:
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key or not value:
            raise TPLowerError(f"--input-placement {item!r}: write it as KEY=PLACEMENT (KEY an input's position or "
                               f"keyword, PLACEMENT {_INPUT_FORMS})")
        if _placement(f"--input-placement {item!r}", value, _INPUT_FORMS).startswith("P("):
            raise TPLowerError(f"--input-placement {item!r}: an input cannot be partial ({value!r}); PLACEMENT is "
                               f"{_INPUT_FORMS}")
        out[int(key) if key.isdigit() else key] = value
    return out


def _placement(option: str, value: str, forms: str = "R, S(d) (split along tensor dim d) or P(sum|avg|max|min)"
               ) -> str:
    """Check the syntax of one placement of the 1-D ``tp`` mesh here, not in every rank; its canonical text.

    Raises:
        TPLowerError: ``value`` is not one placement; the message names ``option``, ``value`` and ``forms``.
    """
    from ..core.language.placement_text import check_placement_text  # no torch: a typo is refused at once

    try:
        return check_placement_text(value, arg=option)
    except TPLowerError:
        raise TPLowerError(f"{option}: {value!r} is not a placement of the one tp axis; write {forms}") from None


def _input_keys(inputs: Any) -> list[int | str] | None:
    """The keys ``verify`` names inputs by (as the ranks split them): a mapping's keywords, a tuple's or list's
    positions, ``[0]`` for one tensor; ``None`` when the inputs are not at hand (``None``, a function)."""
    from collections.abc import Mapping

    if inputs is None or callable(inputs):
        return None
    if isinstance(inputs, Mapping):
        return list(inputs)
    return list(range(len(inputs))) if isinstance(inputs, tuple | list) else [0]


def _input(inputs: Any, key: int | str) -> Any:
    """The input ``key`` names in ``inputs`` (a dict by name or position, a list or tuple by position, else one
    tensor: position 0); ``None`` where it names none."""
    if isinstance(inputs, dict):
        return inputs.get(key)
    if isinstance(inputs, list | tuple):
        return inputs[key] if isinstance(key, int) and -len(inputs) <= key < len(inputs) else None
    return inputs if key == 0 else None


def _check_input_dims(placements: dict[int | str, str], inputs: Any) -> None:
    """Each ``S(d)`` of ``--input-placement`` splits a dim its input has (``inputs`` read here; ``None`` checks
    nothing): torch.chunk's dims, ``-ndim .. ndim - 1``.

    Raises:
        TPLowerError: a dim past the input's, naming the input and its shape.
    """
    import re

    from ..core.language.placement_text import SHARD_RE

    if inputs is None or callable(inputs):
        return
    for key, text in placements.items():
        found = re.fullmatch(SHARD_RE, text.strip())
        value: Any = _input(inputs, key)
        ndim = getattr(value, "ndim", None)
        if found is None or ndim is None:
            continue
        dim = int(found.group(1))
        if not -ndim <= dim < ndim:
            raise TPLowerError(f"--input-placement {key}={text}: dim {dim} is out of range for input {key!r} of "
                               f"shape {tuple(value.shape)} ({ndim} dims); use S(d) with d in {-ndim}..{ndim - 1}")


def _check_input_keys(placements: dict[int | str, str], keys: list[int | str] | None, where: str) -> None:
    """Each key of ``--input-placement`` names one of ``keys`` (the inputs of ``where``); ``None`` checks nothing.

    Raises:
        TPLowerError: a key that names no input; the message lists the inputs and an example with the first.
    """
    if keys is None or not (unknown := [k for k in placements if k not in keys]):
        return
    kind = "keyword" if all(isinstance(k, str) for k in keys) else "position"
    raise TPLowerError(f"--input-placement names {unknown[0]!r}, which is not an input of {where}; its inputs are "
                       f"{', '.join(map(str, keys))} (by {kind}): write KEY=PLACEMENT with KEY one of them, e.g. "
                       f"--input-placement {keys[0]}=R" if keys else f"--input-placement: {where} takes no inputs")


def _model_input_names(name: str, texts: list[str]) -> list[int | str]:
    """The keys of the inputs the ranks build for ``--model name`` (:func:`_builder`: the tokenizer's output)."""
    from ..run.models import MINILM, minilm_folder

    tokenizer = None
    if name == MINILM:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(minilm_folder(), local_files_only=True)
    return list(_model_inputs(name, tokenizer, texts))


def _texts(path: str | None) -> list[str]:
    from ..run.models import read_sentences, sentences

    return read_sentences(path) if path else sentences()[:_DEFAULT_TEXTS]


def _model_inputs(name: str, tokenizer: Any, texts: list[str]) -> dict[str, torch.Tensor]:
    import torch

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
    factory, mod = import_attr(spec["module"])
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
    from torch.distributed.device_mesh import init_device_mesh

    from ..verification.verifier import verify

    build, inputs = _builder(spec)
    if spec["context"] is not None:
        mesh = init_device_mesh("cpu", (spec["context"], world // spec["context"]), mesh_dim_names=("cp", "tp"))
        batch = _with_labels(inputs, spec["pad"]) if spec["causal_lm"] else inputs
        report = verify(build, spec["plan"], mesh, batch, atol=spec["atol"],
                        rtol=spec["rtol"], experts=spec["experts"], context="cp", context_mode=spec["context_mode"])
        return {**report.to_dict(), "table": report.table()} if rank == 0 else None
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    report = verify(build, spec["plan"], mesh, inputs, steps=spec["steps"], atol=spec["atol"], rtol=spec["rtol"],
                    input_placements=spec["input_placements"], output_placement=spec["output_placement"],
                    progress=_bar if rank == 0 and spec["progress"] else None, experts=spec["experts"])
    return {**report.to_dict(), "table": report.table()} if rank == 0 else None


def _with_labels(inputs: Any, pad: int | None) -> dict[str, Any]:
    """A causal LM's batch for ``--context``: ``inputs`` with ``labels`` (the ids, ``-100`` at padding) if absent."""
    if not isinstance(inputs, dict) or "input_ids" not in inputs:
        raise TPLowerError("--context needs keyword inputs with 'input_ids' [batch, sequence] (and optionally "
                           f"'labels'); got {type(inputs).__name__}")
    if "labels" in inputs:
        return inputs
    labels = inputs["input_ids"].clone()
    if pad is not None:
        labels[labels == pad] = -100
    return {**inputs, "labels": labels}


def _module_inputs(args: argparse.Namespace, mod: Any) -> Any:
    """The inputs of ``--module``: ``--input FILE`` read here, else ``None`` (the ranks read ``PKG:example_inputs``).

    Raises:
        TPLowerError: an ``--input`` that is not a readable ``torch.save`` file (a ``PKG:ATTR`` there is named
            as such), or neither ``--input`` nor ``PKG:example_inputs``.
    """
    from pathlib import Path

    pkg = args.module.partition(":")[0]
    if args.input is None:
        if getattr(mod, "example_inputs", None) is None:
            raise TPLowerError(f"--module {args.module!r} needs example inputs: {pkg!r} has no example_inputs and no "
                               "--input was given; pass --input FILE.pt (torch.save of a tensor, a tuple of "
                               f"positional inputs or a dict of keyword inputs) or define example_inputs in {pkg!r} "
                               "(one of those, or a function returning one)")
        return None
    if not Path(args.input).is_file():
        code = ":" in args.input and not Path(args.input.partition(":")[0]).exists()
        hint = (f"; inputs defined in code come from example_inputs in the --module's package ({pkg}:example_inputs "
                "is read when --input is not given)") if code else ""
        raise TPLowerError(f"--input {args.input!r} is not a file: --input takes a file path (.pt, written by "
                           f"torch.save){hint}")
    import torch

    try:
        return torch.load(args.input, weights_only=True)
    except Exception as exc:
        raise TPLowerError(f"--input {args.input!r} cannot be read as a torch.save file of tensors "
                           f"({_load_cause(exc)}); write it with torch.save(inputs, path) (a tensor, tuple or dict of "
                           "tensors)") from None


def _load_cause(exc: Exception) -> str:
    """What ``torch.load(weights_only=True)`` found wrong, without its advice to load untrusted files unchecked."""
    text = str(exc)
    found = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|Check the documentation|$)", text, re.S)
    cause = found.group(1) if found else (text.strip().splitlines() or [""])[0]
    cause = " ".join(cause.split())
    return f"{type(exc).__name__}: {cause[:160]}"


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the ranks need, checked here: the model, the plan resolved on it at ``--nproc``, the inputs.

    Raises:
        TPLowerError: any bad input (one line), before a rank starts.
    """
    plan: Any = plan_value(args.plan)
    mesh: tuple[tuple[str, ...], tuple[int, ...]] = (("tp",), (args.nproc,))
    mode: str = args.context_mode or _MODES[0]
    context: dict[str, Any] = {"context": None, "context_mode": mode}
    if args.context is not None:
        if args.input_placement or args.output_placement is not None or args.steps != 1:
            raise TPLowerError("--context checks the model's own loss on one pass of the whole batch; drop "
                               "--input-placement, --output-placement and --steps")
        mesh = (("cp", "tp"), (args.context, args.nproc))
        context = {"context": "cp", "context_mode": mode}
    if args.output_placement is not None:
        _placement("--output-placement", args.output_placement)
    placements = _placements(args.input_placement)
    if args.model is not None:
        from ..run.models import check_tp, model_spec, skeleton

        check_tp(args.model, args.nproc, "--nproc")
        if plan is None:
            plan = dict(model_spec(args.model).plan)
        texts = _texts(args.input)
        if placements:
            _check_input_keys(placements, _model_input_names(args.model, texts), args.model)
        check_plan(skeleton(args.model), plan, *mesh, experts=args.experts, command="verify", **context)
        return {"model": args.model, "module": None, "texts": texts, "inputs": None,
                **_common(args, plan, placements)}
    _, mod = import_attr(args.module)
    if plan is None and args.context is None:
        raise TPLowerError("--module needs --plan FILE, --plan auto or --plan derive")
    inputs = _module_inputs(args, mod)
    _check_input_keys(placements, _input_keys(inputs if inputs is not None else getattr(mod, "example_inputs", None)),
                      f"--module {args.module}")
    if placements:  # the shapes the placements split, here, before any rank (a function is called for them)
        given = inputs if inputs is not None else getattr(mod, "example_inputs", None)
        if callable(given):
            try:
                given = given()
            except Exception:  # the ranks call it too and report what it raises
                given = None
        _check_input_dims(placements, given)
    check_plan(build_module(args.module, meta=True), plan, *mesh, experts=args.experts, command="verify", **context)
    return {"model": None, "module": args.module, "texts": None, "inputs": inputs, **_common(args, plan, placements)}


def _common(args: argparse.Namespace, plan: Any, placements: dict[int | str, str]) -> dict[str, Any]:
    pad, causal_lm = None, False
    if args.model is not None:
        from ..run.models import LLAMA_TINY, LLAMA_TINY_CONFIG, model_spec

        pad = LLAMA_TINY_CONFIG["pad_token_id"] if args.model == LLAMA_TINY else None
        causal_lm = model_spec(args.model).task == "causal_lm"
    return {"plan": plan, "experts": args.experts, "steps": args.steps, "atol": args.atol, "rtol": args.rtol,
            "context": args.context, "context_mode": args.context_mode or _MODES[0], "pad": pad, "causal_lm": causal_lm,
            "input_placements": placements, "output_placement": args.output_placement,
            "progress": not args.no_progress and not args.json}


def main(args: argparse.Namespace) -> int:
    """Run; exit 0 when the plan matches one process, 1 on a divergence, 2 on an error.

    Raises:
        TPLowerError: bad input, found before any rank starts (printed as one line by :mod:`tplower.cli.errors`).
        tplower.testing.RankFailure: a rank died or raised (printed as one line naming the cause).
    """
    if args.context is None and args.context_mode is not None:
        raise TPLowerError(f"--context-mode {args.context_mode} chooses how context parallelism exchanges, but "
                           "--context is not given (without it the plan is verified with tensor parallelism alone); "
                           "add --context CP, e.g. --context 2")
    from ..run.checks import check_local_world

    world = args.nproc * (args.context or 1)
    check_local_world("--nproc", world, f"--nproc {args.nproc} x --context {args.context}" if args.context else None)
    spec = _spec(args)
    from ..testing import run_processes

    if spec["progress"]:
        procs = count(world, "process", "processes")
        print(f"tplower verify: starting {procs} ...", file=sys.stderr, flush=True)
    results = run_processes(world, _rank_body, spec, timeout=args.timeout)
    report = results[0]
    assert report is not None
    table = report.pop("table")
    print(json.dumps(report, indent=2) if args.json else table)
    return 0 if report["ok"] else 1
