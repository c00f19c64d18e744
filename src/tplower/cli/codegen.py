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
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.support.errors import TPLowerError
from ..core.support.words import count
from .explain import parse_mesh
from .target import add_model_arguments, build_module, check_keys, fake_mesh, plan_value

if TYPE_CHECKING:
    from torch import nn


#: ``--mesh`` by default: ``tplower run``'s mesh (it always builds ``dp`` x ``tp``, ``--dp`` 1 and ``--tp`` 2 unless
#: given) for a ``--model``; one ``tp`` axis for a ``--module``
RUN_MESH, MODULE_MESH = "dp=1,tp=2", "tp=2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tplower codegen``."""
    add_model_arguments(parser, "a model tplower run knows (built without weights)")
    parser.add_argument("--mesh", default=None,
                        help=f"mesh axes, e.g. tp=4 or dp=2,tp=2 (default: {RUN_MESH} with --model, the mesh tplower "
                             f"run builds, so that run --codegen takes the file; {MODULE_MESH} with --module)")
    parser.add_argument("--axis", default="tp", help="the tensor-parallel mesh axis HF styles shard on (default tp)")
    parser.add_argument("-o", "--out", "--output", dest="out", metavar="FILE.py",
                        help="where to write the file (default: standard output)")


def _model_and_plan(args: argparse.Namespace, tp: int) -> tuple[nn.Module, Any]:
    plan = plan_value(args.plan)
    if args.model is not None:
        from ..run.models import check_tp, model_spec, skeleton

        check_tp(args.model, tp, f"--mesh {args.axis}=")
        return skeleton(args.model), plan if plan is not None else dict(model_spec(args.model).plan)
    if plan is None:
        raise TPLowerError("--module needs --plan FILE, --plan auto or --plan derive")
    return build_module(args.module), plan


def emit_file(args: argparse.Namespace) -> str:
    """The generated source for parsed ``args`` (on a ``fake`` process group of the mesh's size, rank 0).

    Raises:
        TPLowerError: a bad ``--mesh``, ``--plan`` (a key naming no module is named with the closest module
            names) or ``--module``, or as :func:`tplower.codegen.emit`.
    """
    mesh_text = args.mesh or (RUN_MESH if args.model is not None else MODULE_MESH)
    names, sizes = parse_mesh(mesh_text)  # before torch is imported: a bad --mesh is refused at once
    if args.axis not in names:
        raise TPLowerError(f"--axis {args.axis!r} is not an axis of --mesh {mesh_text} (axes: {', '.join(names)})")
    from ..codegen.emit import emit

    model, plan = _model_and_plan(args, sizes[names.index(args.axis)])
    check_keys(model, plan, args.experts)
    with fake_mesh(names, sizes, "codegen") as mesh:
        return emit(model, mesh, plan, axis=args.axis, experts=args.experts)


def main(args: argparse.Namespace) -> int:
    """Write the file; exit 0, or 2 on an error (one line on standard error).

    Raises:
        TPLowerError: bad input, a refused plan, or a file that cannot be written.
    """
    from ..run.checks import check_writable, writing

    plan_value(args.plan)  # before torch is imported: a --plan file that is not there
    if args.out is not None:
        if not args.out.endswith(("/", os.sep)) and Path(args.out).suffix != ".py" and not Path(args.out).is_dir():
            raise TPLowerError(f"-o {args.out!r}: codegen writes Python; give a file name ending in .py, e.g. "
                               f"{str(Path(args.out).with_suffix('.py'))!r}")
        check_writable("-o", args.out, ".py")
    try:
        source = emit_file(args)
    except (ValueError, TypeError, OSError) as exc:  # TPLowerError, and the library's own checks
        raise TPLowerError(str(exc)) from None
    if args.out is not None:
        with writing("-o", args.out):
            Path(args.out).write_text(source)
    if args.out is None:
        sys.stdout.write(source)
        return 0
    lines = source.count("\n")
    forwards = source.count("\ndef forward_")
    print(f"tplower codegen: wrote {args.out} ({count(forwards, 'forward')}, {count(lines, 'line')}); install it with "
          f"tplower.codegen.install(model, mesh, {args.out!r})", file=sys.stderr)
    return 0
