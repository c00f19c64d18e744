"""``tplower run``: shard a real model tensor-parallel on N processes and prove it matches one process.

The default (no arguments) runs the pretrained all-MiniLM-L6-v2 sentence
encoder on 2 local gloo processes with tplower's shipped plan; under
``torchrun`` the launcher's ranks are used instead (NCCL on GPUs).
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.support.errors import TPLowerError
from ..core.support.words import count
from ..run.models import MINILM, MODELS
from .errors import plan_keyword

if TYPE_CHECKING:
    from ..run import RunConfig

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tplower run``."""
    parser.add_argument("--model", default=MINILM, choices=sorted(MODELS),
                        help=f"model to parallelize (default {MINILM}: pretrained, offline)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="local processes to spawn (default tp x dp, or 2); ignored under torchrun")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (default nproc / dp)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1; >1 makes a 2-D mesh)")
    parser.add_argument("--input", metavar="FILE", help="sentences, one a line (default: a built-in list)")
    parser.add_argument("--plan", metavar="FILE|auto|derive",
                        help="JSON/YAML mapping module name/glob -> colwise|rowwise (default: the model's plan), "
                             "'auto': the transformers model's own plan, or 'derive': a plan derived from the module "
                             "structure (tplower plan writes it out)")
    parser.add_argument("--steps", type=int, default=2,
                        help="training steps checked against one process (default 2, at least 1)")
    parser.add_argument("--batch-size", type=int, default=16, help="sentences per forward batch (default 16)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    parser.add_argument("--repeat", type=int, default=5, help="timed repeats; medians are reported (default 5)")
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="largest allowed max abs difference from one process (default 1e-5, float32)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds before a stuck run is ended (default 300; 1200 with --compile, since compiling "
                             "takes minutes on a few CPU cores)")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                        help="backend of spawned processes (default gloo; torchrun picks NCCL on GPUs)")
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="after training, save tplower's model to DIR with torch.distributed.checkpoint, reload "
                             "it into the unparallelized model in one process and compare outputs")
    parser.add_argument("--codegen", nargs="?", const="", default=None, metavar="FILE.py",
                        help="run tplower's copy through generated forwards (tplower codegen) instead of the hooks: "
                             "those in FILE.py if it exists (e.g. from tplower codegen, edited or not), else new "
                             "ones written there (default FILE: tplower_<model>_tp<N>.py here)")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="also torch.compile tplower's model and the one-process reference (backend, default "
                             "inductor), check the compiled forward against eager and report compiled step times")
    parser.add_argument("--json", metavar="FILE", help="also write the full report to FILE as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--kill-rank", type=int, default=-1, metavar="R",
                        help="debug: rank R (0..nproc-1) exits abruptly after loading, to see how a dying rank is "
                             "reported")


def _plan(option: str | None, model: str) -> dict[str, Any] | None:
    """``--plan`` as a mapping: a file, ``auto`` (transformers' own plan) or ``derive`` (any letter case).

    Raises:
        TPLowerError: a file that cannot be read or parsed, or ``auto`` on a model that ships no plan (the message
            points at ``derive``).
    """
    from ..run import load_plan

    plan = plan_keyword(option)
    if plan == "derive":
        from .plan import derive_for

        return dict(derive_for(model).plan)
    if plan == "auto":
        from ..plans.hf import model_tp_plan
        from ..run.models import skeleton

        built = skeleton(model)
        try:
            return dict(model_tp_plan(built))
        except TPLowerError:
            raise TPLowerError(f"--plan auto: {model} ({type(built).__name__}) ships no tensor-parallel plan; use "
                               "--plan derive (a plan derived from its module structure), its default plan (no "
                               "--plan) or --plan FILE") from None
    return load_plan(plan) if plan else None


def _codegen_mesh(path: str) -> list[list[Any]] | None:
    """The ``MESH`` a file of ``tplower codegen`` was emitted for, read without running it (``None``: none found)."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MESH" for t in node.targets):
            try:
                mesh = ast.literal_eval(node.value)
            except ValueError:
                return None
            return mesh if isinstance(mesh, list) else None
    return None


def _check_codegen(path: str | None, model: str, dp: int, tp: int, plan: str | None) -> None:
    """``--codegen FILE``: an existing file must parse and have been emitted for this run's mesh ``dp`` x ``tp``; a
    missing one must be writable (the run writes it).

    Raises:
        TPLowerError: a folder, a missing or read-only folder, a syntax error (file, line and column), or a file
            emitted for another mesh (the message gives the ``tplower codegen`` command that emits it for this one).
    """
    from ..run.checks import check_source_file, check_writable

    if path is None:
        return
    if not Path(path).is_file():
        check_writable("--codegen", path)
        return
    check_source_file("--codegen", path)
    want = [["dp", dp], ["tp", tp]]
    got = _codegen_mesh(path)
    if got is not None and got != want:
        text = ",".join(f"{n}={s}" for n, s in got if isinstance(n, str) and isinstance(s, int)) or repr(got)
        with_plan = f" --plan {plan}" if plan else ""
        raise TPLowerError(f"--codegen {path!r} was emitted for mesh {text}, this run's mesh is dp={dp},tp={tp}; emit "
                           f"it again with tplower codegen --model {model}{with_plan} --mesh dp={dp},tp={tp} -o {path} "
                           "(or remove the file and the run writes a new one)")


@dataclass(frozen=True)
class _Checked:
    """What :func:`_check_arguments` worked out: the sizes, the ``--codegen`` file, the sentences."""

    world: int
    tp: int
    codegen: str | None
    texts: tuple[str, ...]


def _check_arguments(args: argparse.Namespace) -> _Checked:
    """Every check of ``tplower run``'s options that needs no torch, made before torch is imported.

    Raises:
        TPLowerError: a count below 1 (named by its option), a ``--kill-rank`` the run does not have, a ``--json``
            or ``--codegen`` file or a ``--checkpoint`` folder that cannot be written, a ``--codegen`` file that
            does not parse or was emitted for another mesh, a missing ``--plan`` file, an unreadable ``--input``, a
            ``--tp`` the heads refuse, ``--backend nccl`` without a GPU per rank.
    """
    from ..run.checks import (
        RunError,
        check_backend,
        check_kill_rank,
        check_local_world,
        check_numbers,
        check_writable,
        torchrun_env,
    )
    from ..run.models import read_sentences, sentences
    from .target import plan_value

    timeout = args.timeout if args.timeout is not None else 1200.0 if args.compile else 300.0
    check_numbers(steps=args.steps, batch_size=args.batch_size, repeat=args.repeat,
                  tp=args.tp if args.tp is not None else 1, dp=args.dp, lr=args.lr, tolerance=args.tolerance,
                  timeout=timeout)
    env = torchrun_env()
    world = env[1] if env is not None else args.nproc if args.nproc is not None else (args.tp or 2) * args.dp
    if env is None:  # the processes this run spawns here (under torchrun the launcher started them)
        by_nproc = args.nproc is not None
        check_local_world("--nproc" if by_nproc else "--tp", world,
                          None if by_nproc else f"--tp {args.tp or 2} x --dp {args.dp}")
    tp = args.tp if args.tp is not None else max(world // args.dp, 1)
    if tp * args.dp != world:  # check_config's check, made here before torch is imported
        if args.tp is None:
            raise RunError(f"--nproc {world} is not a multiple of --dp {args.dp}; tp defaults to nproc / dp, so give "
                           f"an --nproc that --dp divides (e.g. --nproc {2 * args.dp}) or --tp")
        raise RunError(f"--tp {tp} x --dp {args.dp} = {tp * args.dp} ranks, but the run has {world} (--nproc or "
                       "torchrun's WORLD_SIZE); make tp x dp equal the number of processes")
    check_kill_rank(args.kill_rank, world)
    if args.json:
        check_writable("--json", args.json)
    if args.checkpoint:
        from ..run.checks import check_writable_folder

        check_writable_folder("--checkpoint", args.checkpoint)
    if args.codegen:  # as given: resolving drops a trailing '/'
        from ..run.checks import check_writable

        if args.codegen.endswith(("/", os.sep)):
            check_writable("--codegen", args.codegen)
    codegen = _codegen_path(args.codegen, args.model, tp)
    _check_codegen(codegen, args.model, args.dp, tp, args.plan)
    plan_value(args.plan)
    texts = tuple(read_sentences(args.input)) if args.input else tuple(sentences())
    _check_heads(args, tp, by_nproc=env is None and args.nproc is not None)
    if env is None:  # the one check that imports torch (nccl only): under torchrun the launcher picks the backend
        check_backend(args.backend, world)
    return _Checked(world, tp, codegen, texts)


def _check_heads(args: argparse.Namespace, tp: int, *, by_nproc: bool) -> None:
    """``tp`` splits the model's heads; the message names the option the user set (``--nproc`` when ``--tp``
    was not given: tp defaults to nproc / dp).

    Raises:
        TPLowerError: ``tp`` does not divide a head count (as :func:`tplower.run.models.check_tp`).
    """
    from ..run.models import check_tp

    if args.tp is not None or not by_nproc:
        check_tp(args.model, tp)
    elif args.dp == 1:
        check_tp(args.model, tp, "--nproc")
    else:
        try:
            check_tp(args.model, tp)
        except TPLowerError as exc:
            raise TPLowerError(f"--nproc {tp * args.dp} / --dp {args.dp} gives tp={tp} (--tp was not given): {exc}; "
                               "or give --tp and an --nproc of tp x dp") from None


def _config(args: argparse.Namespace, checked: _Checked) -> RunConfig:
    from ..run import RunConfig

    return RunConfig(model=args.model, world=checked.world, tp=checked.tp, dp=args.dp, texts=checked.texts,
                     plan=_plan(args.plan, args.model), steps=args.steps, batch_size=args.batch_size,
                     lr=args.lr, repeat=args.repeat, tolerance=args.tolerance,
                     timeout=args.timeout if args.timeout is not None else 1200.0 if args.compile else 300.0,
                     backend=args.backend, progress=not args.no_progress, kill_rank=args.kill_rank,
                     checkpoint=args.checkpoint, compile=args.compile,
                     codegen=checked.codegen)


def _codegen_path(value: str | None, model: str, tp: int) -> str | None:
    if value is None:
        return None
    return str(Path(value or f"tplower_{model.replace('-', '_')}_tp{tp}.py").resolve())


def main(args: argparse.Namespace) -> int:
    """Run; exit code 0 when every difference from one process is within the tolerance, 1 otherwise, 2 on error.

    Raises:
        TPLowerError: bad input or a failed rank (:class:`tplower.run.RunError`; printed as one line).
    """
    checked = _check_arguments(args)  # before torch: a wrong number is refused in a fraction of a second
    from ..run import check_config, format_report, run, torchrun_env, verdict, write_json
    from ..run.checks import writing

    cfg = _config(args, checked)
    spawn = torchrun_env() is None
    if spawn:  # under torchrun each rank checks as it joins
        check_config(cfg)
    if cfg.progress and spawn:
        procs = count(cfg.world, "process", "processes")
        print(f"tplower run: {cfg.model}: plan checked, starting {procs} ...", file=sys.stderr, flush=True)
    report = run(cfg, checked=spawn)
    if report is None:  # a torchrun rank other than 0: rank 0 prints
        return 0
    print(format_report(report, cfg))
    if args.json:
        with writing("--json", args.json):  # a disk filled during the run: one line, not a traceback
            write_json(args.json, report, cfg)
        print(f"report written to {args.json}")
    return 0 if verdict(report, cfg.tolerance) else 1
