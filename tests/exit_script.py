"""A user's script that trains one tplower step on 2 gloo ranks and ends as scripts end; run by test_teardown.py.

Launched with ``python -m torch.distributed.run --nproc-per-node 2 tests/exit_script.py [options]``.
Its first act is to register an ``atexit`` handler, so the handler runs last of all (``atexit`` is last in,
first out): it reads this process's thread names from ``/proc/self/task/*/comm`` and, if a gloo worker
thread (``pt_gloo_runloop``) or gloo's connection thread is still alive, prints them and ends the process
with exit code 17. Options:

* ``--import-late``: import tplower (and with it ``torch._dynamo``) after ``init_process_group``, as a
  script that imports it inside ``main()`` does.
* ``--queued N``: before tearing down, queue ``N`` asynchronous all_reduces of Python-made tensors and drop
  every reference to them, so that gloo's workers still hold them when the script's last line runs: without
  a teardown that joins the workers while Python is whole, one of them drops the last reference while the
  interpreter finalizes and the process aborts ("terminate called without an active exception").
* ``--tplower-shutdown``: end with ``tplower.shutdown()`` instead of ``dist.destroy_process_group()``.
"""

from __future__ import annotations

import atexit
import glob
import os
import sys


def _gloo_threads() -> list[str]:
    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                names.append(f.read().strip())
        except OSError:
            continue
    return sorted(n for n in names if "gloo" in n)


def _check_at_exit() -> None:
    left = _gloo_threads()
    rank = os.environ.get("RANK", "?")
    if left:
        print(f"rank {rank}: gloo threads alive at exit: {left}", flush=True)
        sys.stdout.flush()
        os._exit(17)
    print(f"rank {rank}: no gloo thread alive at exit", flush=True)


atexit.register(_check_at_exit)  # first registered, so it runs after every other handler

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

late = "--import-late" in sys.argv
if not late:
    import tplower

dist.init_process_group("gloo")
if late:
    import tplower

mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
torch.manual_seed(0)
model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
model = tplower.parallelize(model, mesh, {"0": "replicate", "1": "colwise", "3": "rowwise"})
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
x = torch.randn(4, 8)
loss = model(x).pow(2).mean()  # kept in a global, with its graph's nodes, as a script's top level keeps it
loss.backward()
opt.step()
queued = int(sys.argv[sys.argv.index("--queued") + 1]) if "--queued" in sys.argv else 0
works = [dist.all_reduce(torch.ones(1 << 14), async_op=True) for _ in range(queued)]
del works
if "--tplower-shutdown" in sys.argv:
    tplower.shutdown()
else:
    dist.destroy_process_group()
print(f"rank {dist.get_rank() if dist.is_initialized() else os.environ['RANK']}: done", flush=True)
