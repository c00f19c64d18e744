"""``tplower plan``: derive a tensor-parallel plan from a model's module structure and write it out for editing.

    tplower plan --model all-minilm-l6-v2 -o minilm_plan.yaml
    tplower plan --model t5_encoder            # a tiny family of tplower.run.derive_table, printed
    tplower plan --model gpt2 --verify -o gpt2_plan.yaml
    tplower plan --model llama-tiny --ranks 4 --memory 2GiB --seq 512 --global-batch 8   # the layout planner

The plan (YAML for ``-o`` ending ``.yaml``/``.yml``, JSON for ``.json``;
another suffix is refused, so the file is always what its name says) is what ``parallelize(model,
mesh, "derive")`` and ``tplower run --plan derive`` apply; each rule that
matched is printed to stderr (``tplower.plans.derive``). ``--verify`` first
runs the derived plan against one process on ``--nproc`` local gloo ranks
(:func:`tplower.verification.derived.verify_derived`: a tiny random input of the
model's own kind, output, every boundary and every gradient) and writes
nothing when it does not match (exit 1, the first divergence printed).

With ``--ranks N`` it plans the layout instead (:mod:`tplower.cli.layout`): which mesh, checkpointing and loss
chunking fit and train fastest on N ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..core.support.errors import TPLowerError
from ..core.support.words import closest, count
from .errors import axis_name, positive_float, positive_int

__all__ = ["add_arguments", "derive_for", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``-o``, ``--embeddings``, ``--axis``."""
    parser.add_argument("--model", required=True,
                        help="a model of tplower run (all-minilm-l6-v2, llama-tiny) or a family of "
                             "tplower.run.derive_table (bert, t5_encoder, ...)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the plan here, YAML for .yaml/.yml, JSON for "
                        ".json (other suffixes are refused); default: print YAML")
    parser.add_argument("--embeddings", action="store_true",
                        help="also shard word embeddings (vocabulary-parallel) and an output head of the vocabulary")
    parser.add_argument("--axis", type=axis_name, default="tp", help="the tensor-parallel mesh axis (default tp)")
    parser.add_argument("--verify", action="store_true",
                        help="check the derived plan against one process first (a tiny random input of the model's "
                             "kind, every gradient); refuse it (exit 1, nothing written) when it does not match")
    parser.add_argument("--nproc", type=positive_int, default=None,
                        help="with --verify: local gloo ranks (default 2)")
    parser.add_argument("--timeout", type=positive_float, default=None,
                        help="with --verify: seconds for the whole run (default 600)")
    from . import layout

    layout.add_arguments(parser)


def skeleton_for(name: str) -> Any:
    """A ``tplower run`` model's meta skeleton, or a tiny family's random model.

    Raises:
        TPLowerError: an unknown name (the message lists the known ones).
    """
    from ..run.derive_table import FAMILIES, tiny_family
    from ..run.models import MODELS, skeleton
    from ..run.quiet import quiet_transformers

    with quiet_transformers():
        if name in MODELS:
            return skeleton(name)
        if name in FAMILIES:
            return tiny_family(name)[0]
    raise TPLowerError(f"--model {name!r} is neither a model of tplower run ({', '.join(sorted(MODELS))}) "
                       f"nor a family ({', '.join(FAMILIES)}){closest(name, [*MODELS, *FAMILIES])}")


def derive_for(name: str, *, embeddings: bool = False, axis: str = "tp") -> Any:
    """The :class:`tplower.plans.derive.DerivedPlan` of a ``tplower run`` model (its meta skeleton) or a tiny family.

    Raises:
        TPLowerError: an unknown name (the message lists the known ones), or no rule matched.
    """
    from ..plans.derive import derive_plan

    return derive_plan(skeleton_for(name), embeddings=embeddings, axis=axis)


def _full_model(name: str) -> Any:
    """The model ``name`` with values: ``tplower run``'s loaded model, or a tiny family's random one."""
    from ..run.derive_table import FAMILIES, tiny_family
    from ..run.models import MODELS, load_model
    from ..run.quiet import quiet_transformers

    with quiet_transformers():
        if name in MODELS:
            return load_model(name)[0]
        if name in FAMILIES:
            return tiny_family(name)[0]
    raise TPLowerError(f"--model {name!r} is not known")


def _verify_rank(rank: int, world: int, name: str, embeddings: bool, axis: str) -> dict[str, Any] | None:
    """One rank of ``--verify``: derive, verify, and (rank 0) say what happened as plain data."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..run.quiet import quiet_transformers
    from ..verification.derived import DerivedPlanRefused, verify_derived

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
    model = _full_model(name)
    try:
        with quiet_transformers():
            _, report = verify_derived(model, mesh, embeddings=embeddings, axis=axis)
    except DerivedPlanRefused as exc:
        return {"ok": False, "text": str(exc)} if rank == 0 else None
    return {"ok": True, "text": report.summary()} if rank == 0 else None


def verify_in_processes(name: str, nproc: int, *, embeddings: bool = False, axis: str = "tp",
                        timeout: float = 600.0) -> tuple[bool, str]:
    """Run :func:`tplower.verification.derived.verify_derived` for ``name`` on ``nproc`` spawned gloo ranks.

    Returns:
        ``(ok, text)``: the report's summary, or the refusal with its first divergence.

    Raises:
        TPLowerError: ``nproc`` below 1, or an error other than a refusal in the derivation.
        tplower.testing.RankFailure: a rank died or the run outlived ``timeout``.
    """
    from ..testing import run_processes

    if nproc < 1:
        raise TPLowerError(f"--nproc {nproc}: at least 1")
    result = run_processes(nproc, _verify_rank, name, embeddings, axis, timeout=timeout)[0]
    assert result is not None
    return bool(result["ok"]), str(result["text"])


#: ``-o`` suffix -> the format written
SUFFIXES: dict[str, str] = {".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}


def check_output(path: str | None) -> None:
    """Check ``-o`` before anything is derived: a suffix of :data:`SUFFIXES`, in a folder that exists and is writable.

    Raises:
        TPLowerError: the folder is missing or not writable, the path is a folder, or the suffix is another (the
            message names the allowed ones).
    """
    from ..run.checks import check_writable

    if path is None:
        return
    out = Path(path)
    if out.suffix.lower() not in SUFFIXES:
        raise TPLowerError(f"-o {path!r}: the suffix {out.suffix or '(none)'!r} says no plan format; end the name "
                           "in .yaml or .yml (YAML) or .json (JSON)")
    if not out.parent.is_dir():
        raise TPLowerError(f"-o {path!r}: the folder {str(out.parent)!r} does not exist; create it or write "
                           "elsewhere")
    if out.is_dir():
        raise TPLowerError(f"-o {path!r} is a folder; give a file name ending in .yaml, .yml or .json")
    check_writable("-o", path)


def check_ranks(model: Any, plan: Any, nproc: int, axis: str = "tp") -> None:
    """Check, before ``--verify`` starts a rank, that ``plan`` resolves on ``model`` over ``nproc`` ranks of ``axis``.

    Raises:
        TPLowerError: a size the model refuses (e.g. heads that do not divide over ``nproc``), with the sizes
            that work.
    """
    from .target import check_plan

    try:
        check_plan(model, dict(plan), (axis,), (nproc,), axis=axis, command="plan")
    except TPLowerError as exc:
        raise TPLowerError(f"--nproc {nproc}: the derived plan cannot run on {nproc} ranks: {exc} (with --verify, "
                           "--nproc is that size)") from None


def main(args: argparse.Namespace) -> int:
    """Write (or print) the derived plan and print the rules to stderr; exit 1 when ``--verify`` refuses it, 2 on
    an error.

    Raises:
        TPLowerError: a bad ``-o`` or ``--model`` (checked before deriving or verifying), no rule matched, or
            (with ``--verify``) an ``--nproc`` the model's sizes do not divide or above what this machine spawns
            (checked before any rank starts).
        tplower.testing.RankFailure: a rank of ``--verify`` died or raised.
    """
    if args.ranks is not None:  # the layout planner: tplower plan --ranks N ...
        from . import layout

        return layout.main(args)
    unread = [opt for opt, value in (("--nproc", args.nproc), ("--timeout", args.timeout)) if value is not None]
    if unread and not args.verify:
        raise TPLowerError(f"{' and '.join(unread)} {'are' if len(unread) > 1 else 'is'} read with --verify only; "
                           f"add --verify, or drop {'them' if len(unread) > 1 else 'it'}")
    args.nproc = 2 if args.nproc is None else args.nproc
    args.timeout = 600.0 if args.timeout is None else args.timeout
    if args.verify:  # before torch is imported: a count this machine cannot spawn is refused at once
        from ..run.checks import check_local_world

        check_local_world("--nproc", args.nproc)
    check_output(args.output)  # before torch is imported
    from ..plans.derive import derive_plan

    model = skeleton_for(args.model)
    derived = derive_plan(model, embeddings=args.embeddings, axis=args.axis)
    if args.verify:
        check_ranks(model, derived.plan, args.nproc, args.axis)
        procs = count(args.nproc, "process", "processes")
        print(f"tplower plan: verifying on {procs} ...", file=sys.stderr, flush=True)
        ok, text = verify_in_processes(args.model, args.nproc, embeddings=args.embeddings, axis=args.axis,
                                       timeout=args.timeout)
        print(f"tplower plan: {text}", file=sys.stderr)
        if not ok:
            print("tplower plan: refused: the derived plan does not verify; nothing written", file=sys.stderr)
            return 1
    import importlib

    yaml: Any = importlib.import_module("yaml")
    print(derived.explain(), file=sys.stderr)
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in derived.plan.items()}
    if args.output and Path(args.output).suffix.lower() == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        text = f"# tplower plan --model {args.model}: derived from the module structure; edit freely\n" + \
            yaml.safe_dump(data, sort_keys=False)
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as exc:
            raise TPLowerError(f"-o {args.output!r} cannot be written: {exc}") from None
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
