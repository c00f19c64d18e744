"""``tplower codegen``: write a model's parallelized forwards out as a Python file (see :mod:`tplower.codegen.emit`).

No process is started and no weight is read: a ``--model`` is built on the
meta device, and the mesh lives on PyTorch's ``fake`` process group in this
process (rank 0; nothing communicates while emitting). The file is the same
on every rank and for every run with the same model, plan and mesh::

    tplower codegen --model all-minilm-l6-v2 --mesh tp=2 -o minilm_tp2.py
    tplower codegen --model llama-tiny --plan auto --mesh tp=4 -o llama_tp4.py
    tplower codegen --module mypkg.models:build --plan plan.yaml --mesh tp=2 -o out.py
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from ..core.errors import TPLowerError
from .explain import parse_mesh
from .verify import _import, add_model_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tplower codegen``."""
    add_model_arguments(parser, "a model tplower run knows (built without weights)")
    parser.add_argument("--mesh", default="tp=2", help="mesh axes, e.g. tp=4 or dp=2,tp=2 (default tp=2)")
    parser.add_argument("--axis", default="tp", help="the tensor-parallel mesh axis HF styles shard on (default tp)")
    parser.add_argument("-o", "--out", metavar="FILE.py", help="where to write the file (default: standard output)")


def _model_and_plan(args: argparse.Namespace, tp: int) -> tuple[nn.Module, Any]:
    if args.model is not None:
        from ..run.models import check_tp, model_spec, skeleton

        check_tp(args.model, tp, f"--mesh {args.axis}=")
        plan = args.plan if args.plan is not None else dict(model_spec(args.model).plan)
        return skeleton(args.model), plan
    factory, _ = _import(args.module)
    if args.plan is None:
        raise TPLowerError("--module needs --plan FILE or --plan auto")
    try:
        model = factory() if callable(factory) and not isinstance(factory, nn.Module) else factory
    except Exception as exc:
        raise TPLowerError(f"--module {args.module!r}: calling it raised {type(exc).__name__}: {exc} (it must build "
                           "the model with no arguments)") from None
    if not isinstance(model, nn.Module):
        raise TPLowerError(f"--module {args.module!r} gave a {type(model).__name__}, not a torch.nn.Module")
    return model, args.plan


def emit_file(args: argparse.Namespace) -> str:
    """The generated source for parsed ``args`` (on a ``fake`` process group of the mesh's size, rank 0).

    Raises:
        TPLowerError: a bad ``--mesh``, ``--plan`` or ``--module``, or as :func:`tplower.codegen.emit`.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..codegen.emit import emit

    names, sizes = parse_mesh(args.mesh)
    if args.axis not in names:
        raise TPLowerError(f"--axis {args.axis!r} is not an axis of --mesh {args.mesh} (axes: {', '.join(names)})")
    if args.plan not in (None, "auto") and not Path(args.plan).is_file():
        raise TPLowerError(f"--plan {args.plan!r}: no such file (or write 'auto')")
    tp = sizes[names.index(args.axis)] if args.axis in names else 1
    model, plan = _model_and_plan(args, tp)
    if dist.is_initialized():
        raise TPLowerError("tplower codegen runs without a process group of its own; call tplower.codegen.emit "
                           "from a program that has one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(sizes))
    try:
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
        return emit(model, mesh, plan, axis=args.axis, experts=args.experts)
    finally:
        dist.destroy_process_group()


def main(args: argparse.Namespace) -> int:
    """Write the file; exit 0, or 2 on an error (printed on standard error)."""
    try:
        source = emit_file(args)
        if args.out is not None:
            Path(args.out).write_text(source)
    except (TPLowerError, ValueError, TypeError, OSError) as exc:
        print(f"tplower codegen: error: {exc}", file=sys.stderr)
        return 2
    if args.out is None:
        sys.stdout.write(source)
        return 0
    lines = source.count("\n")
    forwards = source.count("\ndef forward_")
    print(f"tplower codegen: wrote {args.out} ({forwards} forwards, {lines} lines); install it with "
          f"tplower.codegen.install(model, mesh, {args.out!r})", file=sys.stderr)
    return 0
