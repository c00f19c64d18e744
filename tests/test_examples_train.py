"""examples/train.py, launched as its docstring says (torchrun, 2 processes), and its checkpoint checked here.

The script checks itself (its one-process reload against the parallel model);
this test also loads the DCP checkpoint it leaves, in this process and with the
example's own model builder, and checks that training moved every parameter
and left it finite.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train.py"
SUCCESS = "OK: one-process reload vs parallel model"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tplower_example_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_example_says_clipped_only_when_the_norm_was_over_the_max() -> None:
    example = _example()
    assert example.MAX_NORM == 0.25
    assert example.step_line(1, 5, 0.5, 0.1) == "step 1/5  loss 0.500000  grad-norm 0.100000, not clipped (max 0.25)"
    assert example.step_line(2, 5, 0.5, 0.25) == "step 2/5  loss 0.500000  grad-norm 0.250000, not clipped (max 0.25)"
    assert example.step_line(3, 5, 0.5, 0.75) == "step 3/5  loss 0.500000  grad-norm 0.750000, clipped to 0.25"


@pytest.mark.slow  # tests/test_training_stack.py checks training, clipping and DCP in-process
def test_train_example_runs_under_torchrun_and_leaves_a_trained_checkpoint() -> None:
    root = tempfile.mkdtemp(prefix="tplower-test-train-")
    tmpdir, scratch = os.path.join(root, "ckpt"), os.path.join(root, "tmp")
    os.mkdir(scratch)
    try:
        # TMPDIR: torchrun's agent leaves its torchelastic_* log dir there; it goes with the rest
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": scratch}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), "examples/train.py", "--steps", "3", "--checkpoint", tmpdir]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output  # no exit-time abort either (tplower.core.support.teardown)
        assert SUCCESS in proc.stdout, output
        assert proc.stdout.count("grad-norm") == 3, output  # one line per step, from rank 0 only

        example = _example()
        initial = example.build_model()  # the seeded weights every rank started from
        trained = example.build_model()
        sd = trained.state_dict()
        with warnings.catch_warnings():  # no_dist=True: a one-process load, as intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, checkpoint_id=tmpdir, no_dist=True)
        trained.load_state_dict(sd)
        before = dict(initial.named_parameters())
        names = [name for name, _ in trained.named_parameters()]
        assert set(names) == set(before) and len(names) == 12, names  # 2 blocks x (norm, up, down) x (weight, bias)
        for name, p in trained.named_parameters():
            assert torch.isfinite(p).all(), name
            assert not torch.equal(p, before[name]), f"{name} did not change in training"
    finally:
        shutil.rmtree(root, ignore_errors=True)
