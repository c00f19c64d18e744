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
* ``--no-teardown``: end with neither, as a script that forgets ``dist.destroy_process_group()`` does.
* ``--rank1-leaves-first``: after its last line rank 0 waits until rank 1's process has exited (gone, or a
  zombie not yet reaped), so that rank 0's exit handlers run with its peer gone.
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


def _rank1_leaves_first() -> None:
    """Rank 1 leaves its pid in a file (the rendezvous port names it); rank 0 waits until that process ended."""
    import tempfile
    import time

    path = os.path.join(tempfile.gettempdir(), f"tplower-exit-{os.environ['MASTER_PORT']}.pid")
    if os.environ["RANK"] == "1":
        with open(path + ".part", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".part", path)
        return
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                pid = f.read().strip()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state in ("Z", "X"):
                break
        except FileNotFoundError:  # no file yet, or the process is gone
            if os.path.exists(path):
                break
        time.sleep(0.05)
    else:
        print("rank 0: rank 1 did not exit within 60 s", flush=True)
    print("rank 0: rank 1 has exited", flush=True)
    os.remove(path)


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
elif "--no-teardown" not in sys.argv:
    dist.destroy_process_group()
print(f"rank {dist.get_rank() if dist.is_initialized() else os.environ['RANK']}: done", flush=True)
if "--rank1-leaves-first" in sys.argv:
    _rank1_leaves_first()
