"""``tplower explain``: the collectives a transition lowers to, forward and backward, with bytes per rank."""

from __future__ import annotations

import argparse
import json

import torch

from .errors import TPLowerError
from .explain import explain_transition, plan_to_dict, plan_to_table

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16, "fp64": torch.float64, "float64": torch.float64}


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``"dp=2,tp=4"`` -> ``(("dp", "tp"), (2, 4))``.

    Raises:
        TPLowerError: an item that is not ``name=size`` with a positive size, or a repeated name.
    """
    names, sizes = [], []
    for item in text.split(","):
        name, sep, size = item.strip().partition("=")
        if not sep or not name or not size.strip().isdigit() or int(size) < 1:
            raise TPLowerError(f"--mesh {text!r}: {item!r} is not name=size (e.g. dp=2,tp=4)")
        if name in names:
            raise TPLowerError(f"--mesh {text!r}: axis {name!r} appears twice")
        names.append(name)
        sizes.append(int(size))
    return tuple(names), tuple(sizes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """SRC DST placements, ``--mesh``, ``--shape``, ``--dtype``, ``--grad``, ``--coord``, ``--json``, ``--plan``."""
    parser.add_argument("src", nargs="?", help='source placements, e.g. "S(0),P(sum)"')
    parser.add_argument("dst", nargs="?", help='target placements, e.g. "R,S(1)"')
    parser.add_argument("--mesh", default="tp=2", help="mesh axes, e.g. dp=2,tp=4 (default tp=2)")
    parser.add_argument("--shape", default="8,16", help="global shape, e.g. 8,1024,4096")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="element type (default fp32)")
    parser.add_argument("--grad", default=None, help="placement of the gradient at the output (default: dst, P as R)")
    parser.add_argument("--coord", default=None, help="mesh coordinate of the rank to explain (default 0,...)")
    parser.add_argument("--plan", default=None, help="a module plan file (YAML/JSON): explain its boundary forms")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    """Print the explanation; exit 2 with the error on bad input."""
    try:
        names, sizes = parse_mesh(args.mesh)
        if args.plan:
            from .boundaries import explain_plan_lines

            print("\n".join(explain_plan_lines(args.plan, names)))
            return 0
        if not args.src or not args.dst:
            raise TPLowerError("explain needs SRC and DST placements (or --plan FILE)")
        shape = tuple(int(s) for s in args.shape.split(","))
        coord = tuple(int(c) for c in args.coord.split(",")) if args.coord else None
        plan = explain_transition(args.src, args.dst, names, sizes, shape, grad=args.grad, coord=coord)
    except (TPLowerError, ValueError) as exc:
        print(f"tplower explain: error: {exc}")
        return 2
    info = plan_to_dict(plan, names, DTYPES[args.dtype])
    info["mesh"] = dict(zip(names, sizes, strict=True))
    print(json.dumps(info, indent=2) if args.json else plan_to_table(info))
    return 0
