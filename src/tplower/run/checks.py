"""The checks of a run that need no torch: sizes, numbers, the debug rank, the files a command writes.

``tplower run`` makes them before it imports torch (a wrong number is
refused in a fraction of a second, not after the seconds torch takes to
load), and :func:`tplower.run.check_config` makes them again for a
:class:`~tplower.run.RunConfig` built in code. Only :func:`check_backend`
imports torch, and only for ``nccl``.
"""

from __future__ import annotations

import ast
import contextlib
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..core.support.errors import TPLowerError

__all__ = [
    "RunError",
    "check_backend",
    "check_kill_rank",
    "check_local_world",
    "check_numbers",
    "check_source_file",
    "check_writable",
    "check_writable_folder",
    "local_process_limit",
    "torchrun_env",
    "writing",
]

#: the fewest local processes a command may spawn whatever the CPU count (2 ranks per core on a small machine)
MIN_LOCAL_LIMIT = 8


class RunError(TPLowerError):
    """A run that cannot start or did not finish; the message says what to change."""


def torchrun_env() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` when started by ``torchrun`` (its env vars are set), else ``None``."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if not all(k in os.environ for k in keys):
        return None
    rank, world, local = (int(os.environ[k]) for k in keys)
    return rank, world, local


def check_numbers(
    *, steps: int, batch_size: int, repeat: int, tp: int, dp: int, lr: float, tolerance: float, timeout: float
) -> None:
    """Each count at least 1, ``lr`` and ``timeout`` finite and above 0, ``tolerance`` finite and at least 0.

    Raises:
        RunError: the first number out of range, named by its option (``--steps 0`` says why a run needs a step).
    """
    if steps == 0:
        raise RunError(
            "--steps 0: tplower run checks training against one process (each step's loss and the "
            "updated parameters), so it needs at least 1 step; --steps 1 is the shortest check"
        )
    for name, value in (
        ("--steps", steps),
        ("--batch-size", batch_size),
        ("--repeat", repeat),
        ("--tp", tp),
        ("--dp", dp),
    ):
        if value < 1:
            raise RunError(f"{name} {value} must be at least 1")
    for name, number, positive in (("--lr", lr, True), ("--tolerance", tolerance, False), ("--timeout", timeout, True)):
        if not math.isfinite(number) or number < 0 or (positive and number == 0):
            raise RunError(
                f"{name} {number:g} must be a finite number " + ("greater than 0" if positive else "of at least 0")
            )


def local_process_limit() -> int:
    """The most processes a command spawns on this machine: 2 per CPU core, at least :data:`MIN_LOCAL_LIMIT`.

    Each spawned rank imports torch (hundreds of MB) and runs its collectives on the CPU; far more ranks than
    cores only thrash the machine. More ranks belong on several machines, under ``torchrun``.
    """
    return max(MIN_LOCAL_LIMIT, 2 * (os.cpu_count() or 1))


def check_local_world(option: str, world: int, given: str | None = None, low: int = 1) -> None:
    """``world`` processes to spawn here is within ``low .. local_process_limit()``.

    Args:
        option: the option that sets the count (``--nproc``, ``--worlds``), named in the message.
        world: the number of processes the command would spawn.
        given: how the option was written when that differs from ``option world`` (e.g. ``--nproc 4 with
            --context 8``), for the message.
        low: the fewest the option allows (``--worlds``: 2), for the message.

    Raises:
        RunError: a count below 1 or above the limit; the message names ``option`` and the allowed range.
    """
    limit = local_process_limit()
    if 1 <= world <= limit:
        return
    what = given or f"{option} {world}"
    if world < 1:
        raise RunError(f"{what} must be at least 1")
    raise RunError(f"{what} would spawn {world} local processes; this machine allows 1..{limit} "
                   f"({os.cpu_count() or 1} CPU cores, 2 per core, at least {MIN_LOCAL_LIMIT}); give {option} "
                   f"N with N in {low}..{limit}, or use torchrun across machines for more ranks")


def check_kill_rank(kill_rank: int, world: int) -> None:
    """``--kill-rank`` is ``-1`` (none) or a rank of the run, ``0 .. world - 1``.

    Raises:
        RunError: any other value (a rank the run does not have would never die: the debug run would pass).
    """
    if kill_rank != -1 and not 0 <= kill_rank < world:
        raise RunError(
            f"--kill-rank {kill_rank}: the run has {world} rank(s), so R must be in 0..{world - 1} "
            "(or -1, the default: no rank is killed)"
        )


def check_backend(backend: str, world: int) -> None:
    """``nccl`` needs one CUDA GPU per spawned rank; ``gloo`` runs anywhere.

    Raises:
        RunError: ``nccl`` where torch sees no GPU, or fewer GPUs than ranks (the message suggests ``gloo``).
    """
    if backend != "nccl":
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        raise RunError(
            "--backend nccl needs CUDA GPUs, and torch sees none here (torch.cuda.is_available() is "
            "False); use --backend gloo (CPU processes)"
        )
    if gpus < world:
        raise RunError(
            f"--backend nccl spawns one rank per GPU: {world} ranks, but torch sees {gpus} GPU(s); use "
            f"--nproc {gpus} (with a --tp and --dp that fit) or --backend gloo"
        )


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be created in ``folder`` (a probe file is made and removed at once).

    ``os.access`` alone is not enough: it says yes to root in ``/proc`` and on a read-only mount.
    """
    try:
        handle, probe = tempfile.mkstemp(prefix=".tplower-probe-", dir=folder)
    except OSError:
        return False
    os.close(handle)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return True


def check_writable(option: str, path: str, suffix: str = "") -> None:
    """``path`` is a file the command can create or overwrite: not a folder, in a folder that exists and is writable.

    Made before a command imports torch or starts a rank, so a path that cannot be written costs a fraction of a
    second, not a whole run.

    ``suffix``: the file kind the command writes (``".py"``), used in the example name of the message.

    Raises:
        RunError: the path is a folder, its folder is missing or is a file, the folder is not writable (no
            permission, a read-only mount, ``/proc``) or the file is read-only; the message names ``option``.
    """
    out = Path(path)
    folder = out.parent
    if path.endswith(("/", os.sep)) and not out.is_dir():  # Path() drops the slash: "p.yaml/" would write "p.yaml"
        raise RunError(f"{option} {path!r} ends with '/', which names a folder; give a file name, e.g. "
                       f"{str(out)!r}")
    if out.is_dir():
        raise RunError(f"{option} {path!r} is a folder; give a file name in it, e.g. {str(out / ('out' + suffix))!r}")
    if folder.exists() and not folder.is_dir():
        raise RunError(f"{option} {path!r}: {str(folder)!r} is a file, not a folder; write elsewhere")
    if not folder.is_dir():
        raise RunError(f"{option} {path!r}: the folder {str(folder)!r} does not exist; create it or write elsewhere")
    if out.exists():
        try:
            with open(out, "a"):  # opened to append, nothing written: the file is unchanged
                pass
        except OSError:
            raise RunError(f"{option} {path!r} is read-only here (no write permission); make it writable or "
                           "write elsewhere") from None
    elif not os.access(folder, os.W_OK | os.X_OK) or not _can_create_in(folder):
        raise RunError(f"{option} {path!r} cannot be written: the folder {str(folder)!r} takes no new files (no "
                       "write permission or a read-only file system); write elsewhere")


def check_writable_folder(option: str, path: str) -> None:
    """``path`` is a folder the command can write files into, created (with its parents) if missing.

    Raises:
        RunError: the path is a file, the nearest existing folder above it is a file, or the folder (or, when it is
            missing, that nearest existing folder) takes no new files; the message names ``option``.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise RunError(f"{option} {path!r} is a file, not a folder; give a folder (it is created if missing), "
                       f"e.g. {str(out.parent / (out.stem + '-out'))!r}")
    nearest = out
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not nearest.is_dir():
        raise RunError(f"{option} {path!r}: {str(nearest)!r} is a file, so the folder cannot be created there; "
                       "give a folder elsewhere")
    if not os.access(nearest, os.W_OK | os.X_OK) or not _can_create_in(nearest):
        where = "it" if nearest == out else f"the folder {str(nearest)!r} (it would be created there)"
        raise RunError(f"{option} {path!r} cannot be written: {where} takes no new files (no write permission or "
                       "a read-only file system); give a folder elsewhere")


@contextlib.contextmanager
def writing(option: str, path: object) -> Iterator[None]:
    """Turn an ``OSError`` of the writes in the ``with`` block (a full disk, permissions changed) into one line.

    Raises:
        RunError: the block raised ``OSError``; the message names ``option``, ``path`` and the system's reason.
    """
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise RunError(f"{option} {str(path)!r} could not be written: {reason}"
                       + (f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else "")
                       + "; free space or write elsewhere") from None


def check_source_file(option: str, path: str) -> None:
    """``path`` is Python source that parses (a file a run will execute).

    Raises:
        RunError: it cannot be read, or has a syntax error (the message gives the file, line and column).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RunError(f"{option} {path!r} cannot be read: {exc}") from None
    try:
        ast.parse(text, filename=path)
    except SyntaxError as exc:
        raise RunError(
            f"{option} {path!r}: line {exc.lineno}, column {exc.offset}: {exc.msg}; fix the file, or "
            "remove it and the run writes a new one"
        ) from None
