"""How one ``parallelize(model, mesh, "auto")`` call on tiny Llama travels through the package's files.

A ``sys.setprofile`` trace of the call (1-rank gloo group, so no other process is needed) records every Python
call and return whose code lives in ``tplower``; it prints how many of the package's files the call enters, and how
many times control returns into the file that defines ``parallelize`` from another package file (a return to a
frame of that file, or a call into it, after a frame of another file ran).

Run: python benchmarks/parallelize_trace.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import tplower
from tplower.run.hf_configs import architectures, tiny_model


def main() -> None:
    root = Path(tplower.__file__).resolve().parent
    home = Path(sys.modules[tplower.parallelize.__module__].__file__ or "").resolve()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
            model = tiny_model(architectures(["llama"])[0])
            files: set[Path] = set()
            last: list[Path | None] = [None]
            returns = [0]

            def prof(frame, event, arg):  # type: ignore[no-untyped-def]
                if event not in ("call", "return"):
                    return
                f = Path(frame.f_code.co_filename).resolve()
                if event == "return":
                    back = frame.f_back
                    f = Path(back.f_code.co_filename).resolve() if back is not None else f
                if root not in f.parents:
                    return
                files.add(f)
                if f == home and last[0] is not None and last[0] != home:
                    returns[0] += 1
                last[0] = f

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sys.setprofile(prof)
                try:
                    tplower.parallelize(model, mesh, "auto")
                finally:
                    sys.setprofile(None)
        finally:
            dist.destroy_process_group()
    print(f"parallelize(tiny llama, 'auto'): entered {len(files)} of the package's files; came back to "
          f"{home.relative_to(root)} {returns[0]} times from another package file")
    for f in sorted(files):
        print(f"  {f.relative_to(root)}")


if __name__ == "__main__":
    main()
