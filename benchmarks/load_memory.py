"""Peak memory per rank while a parallelized model built on meta is filled from a safetensors folder.

Feeds docs/big-models.md ("Models bigger than one rank"): 141.8 MiB per rank for a 283.5 MiB model.

A Llama built from a config is saved once in one process (``save_pretrained``); then each of ``--tp`` gloo
ranks builds it under ``accelerate.init_empty_weights()``, parallelizes it (``"auto"``) and fills it with
``tplower.load_safetensors``. A sampling thread reads the rank's resident memory (``/proc/self/status``:
``RssAnon``, private memory; ``RssFile``, pages of the memory-mapped files, which the kernel can drop) every
millisecond while it loads. Printed per rank: the rise of each over the value before loading, against the
model's whole size and this rank's shards.

    python benchmarks/load_memory.py --size tiny       # llama-tiny of the bench
    python benchmarks/load_memory.py --size 100m       # about 300 MB of float32 weights
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

SIZES = {  # LlamaConfig fields
    "tiny": {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2},
    "100m": {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 4,
             "num_attention_heads": 12, "num_key_value_heads": 4},
}


def _status() -> dict[str, int]:
    """``RssAnon`` and ``RssFile`` of this process, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


class Peak:
    """Samples :func:`_status` every millisecond on a thread; keeps the maximum of each field."""

    def __init__(self) -> None:
        self.base = _status()
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for k, v in _status().items():
                self.peak[k] = max(self.peak[k], v)
            time.sleep(0.001)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        for k, v in _status().items():
            self.peak[k] = max(self.peak[k], v)


def _rank(rank: int, world: int, folder: str, fields: dict[str, int]) -> dict[str, Any]:
    import accelerate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    import tplower

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with accelerate.init_empty_weights():
        model = LlamaForCausalLM(LlamaConfig(**fields))
    tplower.parallelize(model, mesh, "auto")
    with Peak() as peak:
        report = tplower.load_safetensors(model, folder)
    shards = sum(p._local_tensor.nbytes if isinstance(p, DTensor) else p.nbytes for p in model.parameters())
    largest = max(p.nbytes for p in model.parameters())
    return {"anon": peak.peak["RssAnon"] - peak.base["RssAnon"], "file": peak.peak["RssFile"] - peak.base["RssFile"],
            "shards": shards, "read": report.bytes_read, "largest_global": largest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from tplower.testing import run_processes

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = LlamaForCausalLM(LlamaConfig(**SIZES[args.size]))
        whole = sum(p.nbytes for p in model.parameters())
        model.save_pretrained(tmp)
        del model
        rows = run_processes(args.tp, _rank, tmp, SIZES[args.size], timeout=900.0)
    mib = 1 / 2**20
    print(f"{args.size}: whole model {whole * mib:.1f} MiB, tp={args.tp}")
    print("rank | its shards MiB | read MiB | RssAnon rise MiB | RssFile rise MiB | largest whole tensor MiB")
    for i, r in enumerate(rows):
        print(f"{i} | {r['shards'] * mib:.1f} | {r['read'] * mib:.1f} | {r['anon'] * mib:.1f} | {r['file'] * mib:.1f}"
              f" | {r['largest_global'] * mib:.1f}")


if __name__ == "__main__":
    main()
