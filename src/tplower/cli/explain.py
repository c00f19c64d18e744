"""``tplower explain``: the collectives a transition lowers to, forward and backward, with bytes per rank."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from ..core.support.errors import TPLowerError
from ..core.support.words import count

if TYPE_CHECKING:
    import torch

#: ``--dtype`` names -> torch dtype names (torch is imported when a command runs, not for ``--help``)
DTYPES: dict[str, str] = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
                          "fp16": "float16", "float16": "float16", "fp64": "float64", "float64": "float64"}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a ``--dtype`` name (a key of :data:`DTYPES`)."""
    import torch

    dtype: torch.dtype = getattr(torch, DTYPES[name])
    return dtype


#: The global shape ``tplower explain`` plans for when ``--shape`` is not given.
DEFAULT_SHAPE = "8,16"


def parse_mesh(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``"dp=2,tp=4"`` -> ``(("dp", "tp"), (2, 4))``.

    Raises:
        TPLowerError: an item that is not ``name=size``, a size that is not
            a positive integer, or a repeated name; the message quotes
            ``--mesh`` and the item.
    """
    names, sizes = [], []
    for item in text.split(","):
        name, sep, size = (part.strip() for part in item.strip().partition("="))
        if not sep or not name:
            raise TPLowerError(f"--mesh {text!r}: {item.strip()!r} is not name=size; write each axis as its name, "
                               "'=' and its number of ranks, e.g. dp=2,tp=4")
        if not size.isdigit() or int(size) < 1:
            raise TPLowerError(f"--mesh {text!r}: axis {name!r} has size {size!r}; a size is a whole number of "
                               "ranks, at least 1 (e.g. tp=2)")
        if name in names:
            raise TPLowerError(f"--mesh {text!r}: axis {name!r} appears twice")
        names.append(name)
        sizes.append(int(size))
    return tuple(names), tuple(sizes)


def _ints(option: str, text: str, what: str, example: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    if not text.strip():
        raise TPLowerError(f"{option} {text!r} is empty; give {what} as comma-separated integers, e.g. {example}")
    for p in parts:
        if not p.isdigit():
            raise TPLowerError(f"{option} {text!r}: {p!r} is not a non-negative integer; give {what} as "
                               f"comma-separated integers, e.g. {example}")
    return tuple(int(p) for p in parts)


def parse_shape(text: str, example: str = "8,1024,4096") -> tuple[int, ...]:
    """``"8,1024,4096"`` -> ``(8, 1024, 4096)``: the global shape of ``--shape``.

    Raises:
        TPLowerError: an empty text or an item that is not a non-negative integer; the message names
            ``--shape`` and shows ``example``.
    """
    return _ints("--shape", text, "the global shape", example)


def parse_coord(text: str, names: tuple[str, ...], sizes: tuple[int, ...]) -> tuple[int, ...]:
    """``"1,0"`` -> ``(1, 0)``: the mesh coordinate of ``--coord``, one index per axis of the mesh.

    Raises:
        TPLowerError: a non-integer, a count unlike the mesh's axes, or an
            index outside its axis; the message names ``--coord`` and the mesh.
    """
    mesh = ",".join(f"{n}={s}" for n, s in zip(names, sizes, strict=True))
    coord = _ints("--coord", text, "one index per mesh axis", ",".join("0" for _ in names))
    if len(coord) != len(names):
        raise TPLowerError(f"--coord {text!r} has {count(len(coord), 'index', 'indices')} but --mesh {mesh} has "
                           f"{count(len(names), 'axis', 'axes')} ({', '.join(names)}); give one index per axis")
    for c, name, size in zip(coord, names, sizes, strict=True):
        if c >= size:
            raise TPLowerError(f"--coord {text!r}: index {c} on axis {name!r} is outside 0..{size - 1} "
                               f"(--mesh {mesh})")
    return coord


def check_dims(placements: dict[str, str | None], names: tuple[str, ...], shape: tuple[int, ...],
               shape_option: str) -> None:
    """Each shard dim of ``placements`` (``{"SRC": text, ...}``; ``None`` skipped) is a dim of ``shape``.

    ``shape_option`` says where the shape came from, e.g. ``"--shape 8,16"`` or ``"--shape's default 8,16"``.

    Raises:
        TPLowerError: a placement that does not parse (as :func:`tplower.core.language.placements.parse_placements`), or
            ``S(d)`` on a tensor of ``d`` dims or fewer; the message names the placement, the dims it needs and
            ``shape_option``.
    """
    from ..core.language.placement_text import SHARD_RE, check_placements_text

    nd = len(shape)
    for option, text in placements.items():
        if text is None:
            continue
        for p in check_placements_text(text, arg=option, ndim=len(names)):  # no torch: refused in a blink
            if (m := SHARD_RE.fullmatch(p)) and not -nd <= (dim := int(m.group(1))) < nd:
                need = dim + 1 if dim >= 0 else -dim
                example = ",".join(map(str, shape + (8,) * (need - nd)))
                dims = f"{nd} dim{'s' if nd != 1 else ''}"
                raise TPLowerError(f"{option} {text!r}: dim {dim} is out of range: S({dim}) needs a tensor of at "
                                   f"least {need} dims; the shape is {shape_option} ({dims}); pass --shape with "
                                   f"{need} or more sizes, e.g. --shape {example}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """SRC DST placements, ``--mesh``, ``--shape``, ``--dtype``, ``--grad``, ``--coord``, ``--json``, ``--plan``."""
    parser.add_argument("src", nargs="?", help='source placements, e.g. "S(0),P(sum)"')
    parser.add_argument("dst", nargs="?", help='target placements, e.g. "R,S(1)"')
    parser.add_argument("--mesh", default="tp=2", help="mesh axes, e.g. dp=2,tp=4 (default tp=2)")
    parser.add_argument("--shape", default=None,
                        help=f"global shape of the tensor, e.g. 8,1024,4096 (default {DEFAULT_SHAPE})")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="element type (default fp32)")
    parser.add_argument("--grad", default=None, help="placement of the gradient at the output (default: dst, P as R)")
    parser.add_argument("--coord", default=None,
                        help="mesh coordinate of the rank to explain, one index per axis (default 0,...,0: the rank "
                             "with the largest pieces)")
    parser.add_argument("--plan", default=None, help="a module plan file (YAML/JSON): explain its boundary forms; "
                        "'derive' (with --model): the derived plan, each rule that matched, then its forms")
    parser.add_argument("--model", default=None, help="with --plan: resolve it on this model, module by module "
                        "(with --plan derive: the plan derived from it); a model of tplower run or a family of "
                        "tplower.run.derive_table")
    parser.add_argument("--moe", default=None, metavar="tokens=T,hidden=H,top_k=K,experts=E",
                        help="explain one mixture-of-experts block instead: the collectives and bytes per rank per "
                             "step of tensor parallelism inside the experts and of expert parallelism, over the "
                             "--mesh axis (e.g. tokens=4096,hidden=2048,top_k=8,experts=128)")
    parser.add_argument("--context", default=None, metavar="batch=B,seq=S,hidden=H,heads=A,kv_heads=K[,layers=L]",
                        help="context parallelism (--mesh cp=N[,tp=M]): the collectives and bytes per rank of a "
                             "train step in each mode (ulysses, allgather, hybrid); params=P adds the gradient sums "
                             "(tensors=T: P's parameter tensors, one flag each), ulysses=U sets the hybrid's "
                             "Ulysses degree (default: from the heads), window=W a causal sliding window on "
                             "window_layers=N of the layers (default: all)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


_MOE_KEYS = ("tokens", "hidden", "top_k", "experts")
_CONTEXT_KEYS = ("batch", "seq", "hidden", "heads", "kv_heads")
_CONTEXT_OPTIONAL = ("layers", "head_dim", "params", "tensors", "ulysses", "window", "window_layers")


def parse_sizes(option: str, text: str, keys: tuple[str, ...], optional: tuple[str, ...], example: str, *,
                zero_ok: tuple[str, ...] = ()) -> dict[str, int]:
    """``"k1=v1,k2=v2"`` -> the sizes of ``option``: every key of ``keys``, any of ``optional``; each at least 1
    (0 allowed for the keys of ``zero_ok``).

    Raises:
        TPLowerError: an item that is not ``key=integer``, an unknown or missing key, or a 0 where a size must be
            at least 1; the message names ``option``.
    """
    out: dict[str, int] = {}
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.strip().partition("="))
        if not sep or key not in keys + optional or not value.isdigit():
            raise TPLowerError(f"{option} {text!r}: {item.strip()!r} is not key=integer with key one of "
                               f"{', '.join(keys + optional)} (e.g. {example})")
        if int(value) < 1 and key not in zero_ok:
            raise TPLowerError(f"{option} {text!r}: {key}={value}; each size is a whole number of at least 1")
        out[key] = int(value)
    if missing := [k for k in keys if k not in out]:
        raise TPLowerError(f"{option} {text!r}: missing {', '.join(missing)}; give all of {', '.join(keys)}")
    return out


def parse_moe(text: str) -> dict[str, int]:
    """``"tokens=256,hidden=64,top_k=2,experts=8"`` -> the four sizes of ``--moe``.

    Raises:
        TPLowerError: an item that is not ``key=integer``, an unknown or missing key, a size below 1; the message
            names ``--moe``.
    """
    return parse_sizes("--moe", text, _MOE_KEYS, (), "tokens=4096,hidden=2048,top_k=8,experts=128")


def _explain_context(args: argparse.Namespace, names: tuple[str, ...], sizes: tuple[int, ...]) -> int:
    from ..context.explain import context_to_table, explain_context, head_problem

    if "cp" not in names:
        raise TPLowerError(f"--context needs a cp axis in --mesh (e.g. cp=2,tp=2); --mesh {args.mesh} has "
                           f"{', '.join(names)}")
    c = parse_sizes("--context", args.context, _CONTEXT_KEYS, _CONTEXT_OPTIONAL,
                    "batch=1,seq=8192,hidden=4096,heads=32,kv_heads=8,layers=32",
                    zero_ok=("params", "tensors", "window_layers"))
    tp = sizes[names.index("tp")] if "tp" in names else 1
    if problem := head_problem(c["hidden"], c["heads"], c["kv_heads"], tp, c.get("head_dim")):
        raise TPLowerError(f"--context {args.context!r}" + (f" with --mesh {args.mesh}" if tp > 1 else "") +
                           f": {problem}")
    try:
        info = explain_context(c["batch"], c["seq"], c["hidden"], c["heads"], c["kv_heads"],
                               sizes[names.index("cp")], tp, layers=c.get("layers", 1), head_dim=c.get("head_dim"),
                               params=c.get("params", 0), tensors=c.get("tensors", 0), dtype=dtype_of(args.dtype),
                               ulysses=c.get("ulysses"), window=c.get("window"),
                               window_layers=c.get("window_layers"))
    except ValueError as exc:
        raise TPLowerError(f"--context {args.context!r}: {exc}") from None
    print(json.dumps(info, indent=2) if args.json else context_to_table(info))
    return 0


def _explain_moe(args: argparse.Namespace, names: tuple[str, ...], sizes: tuple[int, ...]) -> int:
    from ..core.language.explain import explain_moe, moe_to_table

    if len(names) != 1:
        raise TPLowerError(f"--moe explains one block over one axis; --mesh {args.mesh} has {len(names)} axes")
    m = parse_moe(args.moe)
    if m["top_k"] > m["experts"]:
        raise TPLowerError(f"--moe {args.moe!r}: top_k={m['top_k']} exceeds experts={m['experts']}; each token "
                           f"picks top_k of the experts, so top_k is at most {m['experts']}")
    info = explain_moe(m["tokens"], m["hidden"], m["top_k"], m["experts"], sizes[0], dtype_of(args.dtype))
    print(json.dumps(info, indent=2) if args.json else moe_to_table(info))
    return 0


def resolved_lines(model_name: str, plan: Any, names: tuple[str, ...], sizes: tuple[int, ...]) -> list[str]:
    """``plan`` resolved on ``model_name``'s skeleton, one block of lines per planned module
    (:meth:`tplower.nn.resolve.ResolvedPlan.lines`), on a ``fake`` process group of the mesh's size, rank 0.

    Raises:
        TPLowerError: an unknown model, a plan key naming no module (with the closest names), or any refusal
            ``parallelize`` would make (named the same way).
    """
    from ..nn.resolve import resolve_plan
    from .plan import skeleton_for
    from .target import check_keys, fake_mesh

    model = skeleton_for(model_name)
    check_keys(model, plan)
    with fake_mesh(names, sizes, "explain") as mesh:
        return resolve_plan(model, mesh, plan, axis="tp").lines()


def _modes(args: argparse.Namespace) -> list[str]:
    """What ``args`` asks to explain: some of ``SRC DST``, ``--plan``, ``--moe``, ``--context`` (one is allowed)."""
    given = [("SRC DST", bool(args.src or args.dst)), ("--plan", args.plan is not None),
             ("--moe", args.moe is not None), ("--context", args.context is not None)]
    return [name for name, on in given if on]


def _explain_plan(args: argparse.Namespace, names: tuple[str, ...], sizes: tuple[int, ...]) -> int:
    from .target import plan_value

    plan: Any = plan_value(args.plan)  # before torch is imported: a --plan file that is not there
    from ..plans.forms import explain_plan_lines

    if "tp" not in names:  # a plan's styles shard over the axis named tp; without one every boundary is identity
        raise TPLowerError(f"--plan shards over the mesh axis named tp, and --mesh {args.mesh} has none (axes: "
                           f"{', '.join(names)}), so the plan would do nothing; add a tp axis, e.g. --mesh "
                           f"{','.join(f'{n}={s}' for n, s in zip(names, sizes, strict=True))},tp=2")
    if plan in ("auto", "derive") and not args.model:
        raise TPLowerError(f"--plan {plan} reads a model: add --model NAME (a model of tplower run or a family of "
                           "tplower.run.derive_table)")
    if plan == "derive":
        from .plan import derive_for

        derived = derive_for(args.model)
        print(derived.explain() + "\n")
        plan = derived.plan
    if args.model:  # the plan resolved on the model, module by module (what parallelize installs)
        print("\n".join(resolved_lines(args.model, plan, names, sizes)))
    else:
        print("\n".join(explain_plan_lines(plan, names)))
    return 0


def main(args: argparse.Namespace) -> int:
    """Print the explanation; exit 2 with one error line on bad input.

    Raises:
        TPLowerError: bad input (the caller prints it as one line; see :mod:`tplower.cli.errors`).
    """
    modes = _modes(args)
    if len(modes) > 1:
        raise TPLowerError(f"{' and '.join(modes)} ask for different explanations; give one of SRC DST (a "
                           "transition), --plan, --moe or --context per call")
    if args.model and args.plan is None:
        raise TPLowerError("--model is read with --plan (e.g. --plan auto --model llama-tiny); add --plan")
    try:
        names, sizes = parse_mesh(args.mesh)
        if args.moe is not None:
            return _explain_moe(args, names, sizes)
        if args.context is not None:
            return _explain_context(args, names, sizes)
        if args.plan is not None:
            return _explain_plan(args, names, sizes)
        if not args.src or not args.dst:
            raise TPLowerError("explain needs SRC and DST placements, e.g. tplower explain 'S(0)' R (or --plan "
                               "FILE, --moe or --context)")
        shape = parse_shape(args.shape if args.shape is not None else DEFAULT_SHAPE)
        coord = parse_coord(args.coord, names, sizes) if args.coord is not None else None
        check_dims({"SRC": args.src, "DST": args.dst, "--grad": args.grad}, names, shape,
                   f"--shape {args.shape}" if args.shape is not None else f"--shape's default {DEFAULT_SHAPE}")
        from ..core.language.explain import explain_transition  # torch: after every check of the arguments

        plan = explain_transition(args.src, args.dst, names, sizes, shape, grad=args.grad, coord=coord)
    except ValueError as exc:  # TPLowerError, and the library's own checks of placements and sizes
        raise TPLowerError(str(exc)) from None
    from ..core.language.explain import plan_to_dict, plan_to_table

    info = plan_to_dict(plan, names, dtype_of(args.dtype))
    info["mesh"] = dict(zip(names, sizes, strict=True))
    print(json.dumps(info, indent=2) if args.json else plan_to_table(info))
    return 0
