"""The communication share of a model step, (step - floor) / floor, on any device and backend.

Feeds docs/parallelize.md ("Overlapping the input gradient's all_reduce"): the communication share on
CUDA ranks; ``benchmarks/device_check.sh`` runs it (the CPU figures there are ``tplower bench``'s model phase).

    python benchmarks/comm_share.py --device cuda --backend auto --out share-out
    python benchmarks/comm_share.py                       # CPU, gloo (as `tplower bench --phases model`)

Runs the model phase of ``tplower bench`` (:func:`tplower.bench.model.model_phase`:
all-MiniLM-L6-v2 at tp=2, every parallel copy beside its floor copy on a
``fake`` group of the same ranks, :mod:`tplower.bench.floor`) and prints its
table and the share line. ``--backend auto`` takes NCCL where every rank has
a GPU of its own and gloo where the ranks share one (NCCL refuses two ranks
on one device; gloo carries CUDA tensors through the host, so the share is
then gloo's, not NCCL's). Writes ``share.md`` and ``share.json`` under
``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _backend(device: str, backend: str, tp: int) -> str:
    if backend != "auto":
        return backend
    if device == "cpu":
        return "gloo"
    import torch

    if torch.cuda.device_count() >= tp:
        return "nccl"
    print(
        f"comm_share: {torch.cuda.device_count()} GPU(s) for {tp} ranks: NCCL refuses two ranks on one device, "
        "so gloo carries the CUDA tensors (through the host)",
        file=sys.stderr,
    )
    return "gloo"


def main(argv: list[str] | None = None) -> int:
    """Run the model phase with its floors; print and write the table. 0 on success, 2 on a failed rank."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7, as --quick)")
    parser.add_argument("--out", default="share-out", help="folder for share.md and share.json")
    args = parser.parse_args(argv)

    from tplower.bench.model import model_phase
    from tplower.bench.phases import BenchResult, machine
    from tplower.bench.report import model_table, share_line
    from tplower.testing import RankFailure

    backend = _backend(args.device, args.backend, 2)
    try:
        rows, _ = model_phase(
            args.rounds,
            device=args.device,
            backend=backend,
            rss=False,
            progress=lambda what: print(f"[comm_share] {what}", file=sys.stderr, flush=True),
        )
    except RankFailure as exc:
        print(f"comm_share: error: {exc}", file=sys.stderr)
        return 2
    res = BenchResult(config=vars(args), meta=machine() | {"backend": backend}, model=rows)
    text = "\n".join(
        [
            f"# Communication share ({args.device}, {backend}, {args.rounds} rounds)",
            "",
            *share_line(res),
            "",
            *model_table(res),
        ]
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "share.md").write_text(text + "\n")
    (out / "share.json").write_text(json.dumps({"meta": res.meta, "model": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
