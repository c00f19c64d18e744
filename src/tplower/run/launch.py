"""Start the ranks of a run, or join ``torchrun``'s; turn any failure into one clear :class:`RunError`.

Spawned runs use :func:`tplower.testing.run_processes`: a ``FileStore``
rendezvous in a temporary folder (no port), one thread per rank, and every
process ended (terminate, then kill) when one fails or the run outlives its
timeout. Under ``torchrun`` this process is one rank: the process group
comes from the launcher's environment (NCCL when CUDA is there, else gloo),
and the launcher ends the other ranks when one exits non-zero.
"""

from __future__ import annotations

import datetime
import os
import re
from typing import Any

import torch
import torch.distributed as dist

from ..testing import RankFailure, run_processes
from .config import RunConfig, RunError, check_config, torchrun_env
from .worker import rank_main

__all__ = ["explain_failure", "run"]

_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Failure|Exit)): (.*)$", re.MULTILINE)
_USER_ERRORS = ("RunError", "TPLowerError", "MissingPackageError")


def _spawned(rank: int, world: int, cfg: RunConfig) -> dict[str, Any] | None:
    device = f"cuda:{rank}" if cfg.backend == "nccl" else "cpu"
    if device != "cpu":
        torch.cuda.set_device(rank)
    return rank_main(rank, world, cfg, device)


def explain_failure(exc: RankFailure, timeout: float) -> str:
    """One message for a failed run: a rank's own error first, then a death, then a timeout.

    A rank that raised a tplower error (a plan or size that does not fit)
    gives its message as is; a rank that died names its exit code; ranks
    that gave nothing name the timeout. Ranks that only failed because a
    peer went away are not repeated.
    """
    found: list[tuple[int, int, str]] = []  # (priority, rank, message)
    for rank, text in exc.failures.items():
        matches = list(_EXC_LINE.finditer(text))
        m = matches[-1] if matches else None
        if m is not None and m.group(1).rsplit(".", 1)[-1] in _USER_ERRORS:
            found.append((0, rank, text[m.start(2):].strip()))
        elif text.startswith("process exited with code"):
            found.append((1, rank, f"rank {rank} died ({text}); the other ranks were ended. Its own output above "
                                   "may say why; a rank killed by the system (code -9) usually ran out of memory"))
        elif text.startswith("no result within"):
            found.append((3, rank, f"rank {rank} gave {text}; every rank was ended. A larger --timeout helps if "
                                   "the machine is just slow"))
        else:
            last = f"{m.group(1)}: {m.group(2)}" if m is not None else text.strip().splitlines()[-1]
            found.append((2, rank, f"rank {rank} failed: {last}"))
    found.sort()
    return found[0][2] if found else str(exc)


def _init_from_env(cfg: RunConfig) -> str:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    local = int(os.environ["LOCAL_RANK"])
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout))
    except Exception as exc:
        text = str(exc)
        addr = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise RunError(f"the rendezvous port {addr} is in use by another program; start torchrun with "
                           "--master-port set to a free port (or --rdzv-endpoint host:free_port)") from None
        raise RunError(f"could not join the process group at {addr} ({type(exc).__name__}: {text.splitlines()[0]}); "
                       "check that every node uses the same --master-addr/--master-port and can reach it") from None
    return device


def run(cfg: RunConfig, *, checked: bool = False) -> dict[str, Any] | None:
    """Run ``cfg``: check it, start or join the ranks, return rank 0's report (``None`` on other ranks).

    Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set) the
    world is the launcher's and ``cfg.world`` must equal it; otherwise
    ``cfg.world`` processes are spawned on ``cfg.backend``.

    ``checked``: :func:`check_config` already passed (the command line checks
    before it says it starts processes); else it runs here first.

    Raises:
        RunError: a bad config (before any process starts), a rank that
            raised, died or timed out (every process ended first), or a
            process group that could not be joined.
    """
    env = torchrun_env()
    if env is not None:
        rank, world, _ = env
        if cfg.world != world:
            raise RunError(f"torchrun started {world} processes but the run asks for {cfg.world}; drop --nproc "
                           "under torchrun (its --nproc-per-node and --nnodes set the world)")
        check_config(cfg)
        device = _init_from_env(cfg)
        try:
            return rank_main(rank, world, cfg, device)
        finally:
            dist.destroy_process_group()
    if not checked:
        check_config(cfg)
    try:
        results = run_processes(cfg.world, _spawned, cfg, backend=cfg.backend, timeout=cfg.timeout)
    except RankFailure as exc:
        raise RunError(explain_failure(exc, cfg.timeout)) from None
    report: dict[str, Any] | None = results[0]
    return report
