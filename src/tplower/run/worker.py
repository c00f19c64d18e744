"""The body every rank of ``tplower run`` executes, after the default process group is up.

Three copies of one model: tplower's tensor-parallel copy, DTensor's
(``parallelize_module``), and on rank 0 the unsharded reference. The same
micro-batches go through all three: each data-parallel rank takes its
``torch.chunk`` piece of every batch; the reference runs the pieces one
after another (its training loss and gradient are their mean, as the
data-parallel average is). Rank 0 returns the report; the others ``None``.
"""

from __future__ import annotations

import functools
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from ..conformance import quiet_dtensor_logs
from .config import RunConfig
from .models import load_model, model_spec
from .paths import BoundaryLog, gather_params, parallelize_dtensor, parallelize_tplower, shard_dims
from .tasks import make_batch, model_output, training_loss

__all__ = ["rank_main"]

Batch = dict[str, torch.Tensor]
T = TypeVar("T")


def _pieces(items: Sequence[T], n: int) -> list[list[T]]:
    """``torch.chunk`` pieces of ``items`` (the first ones longer)."""
    size = -(-len(items) // n)
    return [list(items[i * size:(i + 1) * size]) for i in range(n) if items[i * size:(i + 1) * size]]


class _Progress:
    """A tqdm bar on rank 0 (no-op elsewhere or when disabled)."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.bar: Any = None
        if enabled:
            try:
                tqdm: Any = importlib.import_module("tqdm").tqdm
            except ImportError:  # the bar is a courtesy: without tqdm the run goes on silently
                return
            self.bar = tqdm(total=total, file=sys.stderr, leave=False, unit="step", dynamic_ncols=True)

    def __call__(self, what: str, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.set_description(what)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dp_average_grads(model: nn.Module, mesh: DeviceMesh) -> None:
    if mesh["dp"].size() == 1:
        return
    group, n = mesh.get_group("dp"), mesh["dp"].size()
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=group)
            g.div_(n)


def _train_step(task: str, model: nn.Module, opt: torch.optim.Optimizer, batch: Batch, mesh: DeviceMesh) -> float:
    """One SGD step on this rank's piece; returns the data-parallel mean loss."""
    opt.zero_grad(set_to_none=True)
    loss = training_loss(task, model, batch)
    loss.backward()
    _dp_average_grads(model, mesh)
    opt.step()
    value = loss.detach().reshape(1).clone()
    if mesh["dp"].size() > 1:
        dist.all_reduce(value, group=mesh.get_group("dp"))
        value /= mesh["dp"].size()
    return float(value.item())


def _ref_train_step(task: str, model: nn.Module, opt: torch.optim.Optimizer, pieces: Sequence[Batch]) -> float:
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for b in pieces:
        loss = training_loss(task, model, b) / len(pieces)
        loss.backward()
        total += float(loss.item())
    opt.step()
    return total


def _max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max((float((x.cpu() - y.cpu()).abs().max()) for x, y in zip(a, b, strict=True) if x.numel()),
               default=0.0)


def _param_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    worst, where = 0.0, ""
    for name, r in ref.items():
        if got[name].shape != r.shape:
            return float("inf"), f"{name}: shape {tuple(got[name].shape)} != {tuple(r.shape)}"
        d = float((got[name] - r).abs().max()) if r.numel() else 0.0
        if d >= worst:
            worst, where = d, name
    return worst, where


class _Run:
    """One rank's state: the config, mesh, the three copies and their optimizers."""

    def __init__(self, rank: int, cfg: RunConfig, device: torch.device) -> None:
        self.rank, self.cfg, self.device = rank, cfg, device
        self.task = model_spec(cfg.model).task
        self.plan = cfg.resolved_plan()
        self.mesh = init_device_mesh(device.type, (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.batches = [cfg.texts[i:i + cfg.batch_size] for i in range(0, len(cfg.texts), cfg.batch_size)]
        pairs = [list(cfg.texts[i:i + 2]) for i in range(0, 2 * cfg.pairs, 2)]
        self.train_pieces = [[s for pair in piece for s in pair] for piece in _pieces(pairs, cfg.dp)]
        self.progress = _Progress(cfg.progress and rank == 0,
                                  3 + len(self.batches) + 2 * cfg.steps + 1 + 4 * (cfg.repeat + 1)
                                  + (cfg.checkpoint is not None) + 2 * (cfg.compile is not None) + 1)
        self.progress("load: tplower copy", 0)
        self.models: dict[str, nn.Module] = {}
        self.models["tplower"], self.tok = load_model(cfg.model, device=device)
        self.boundaries: BoundaryLog = parallelize_tplower(self.models["tplower"], self.mesh, self.plan,
                                                           codegen=cfg.codegen)
        self.progress("load: DTensor copy")
        self.models["dtensor"] = load_model(cfg.model, device=device)[0]
        parallelize_dtensor(self.models["dtensor"], self.mesh, self.plan)
        self.progress("load: one-process reference")
        if rank == 0:
            self.models["reference"] = load_model(cfg.model, device=device)[0]
        self.opts = {k: torch.optim.SGD(m.parameters(), lr=cfg.lr) for k, m in self.models.items()}
        self.progress("loaded")

    def pieces(self, texts: Sequence[str]) -> list[Batch]:
        """The batches of every dp rank's piece of ``texts``."""
        return [make_batch(self.cfg.model, self.tok, p, self.device) for p in _pieces(texts, self.cfg.dp)]

    def _collect(self, local: torch.Tensor | None) -> list[torch.Tensor]:
        if self.cfg.dp == 1:
            return [] if local is None else [local]
        got: list[Any] = [None] * self.cfg.dp
        dist.all_gather_object(got, local, group=self.mesh.get_group("dp"))
        return [g for g in got if g is not None]

    def forward_phase(self) -> dict[str, list[torch.Tensor]]:
        """Every batch through each copy (no grad); on rank 0 the outputs of all dp pieces, in order."""
        out: dict[str, list[torch.Tensor]] = {k: [] for k in self.models}
        with torch.no_grad():
            for texts in self.batches:
                pieces = self.pieces(texts)
                mine = pieces[self.dp_rank] if self.dp_rank < len(pieces) else None
                for key in ("tplower", "dtensor"):
                    local = None if mine is None else model_output(self.task, self.models[key], mine).cpu()
                    out[key].extend(self._collect(local))
                if "reference" in self.models:
                    out["reference"].extend(model_output(self.task, self.models["reference"], p).cpu()
                                            for p in pieces)
                self.progress("forward")
        return out

    def step(self, key: str) -> float:
        """One training step of copy ``key``; returns its loss (the mean over dp pieces)."""
        model, opt = self.models[key], self.opts[key]
        if key == "reference":
            return _ref_train_step(self.task, model, opt, self.ref_train)
        return _train_step(self.task, model, opt, self.my_train, self.mesh)

    def train_phase(self) -> dict[str, list[float]]:
        """``cfg.steps`` SGD steps of every copy, interleaved; the losses."""
        self.my_train = make_batch(self.cfg.model, self.tok, self.train_pieces[self.dp_rank], self.device)
        self.ref_train = [make_batch(self.cfg.model, self.tok, p, self.device) for p in self.train_pieces]
        losses: dict[str, list[float]] = {k: [] for k in self.models}
        for _ in range(self.cfg.steps):
            for key in self.models:
                losses[key].append(self.step(key))
            self.progress("train", 2)
        return losses

    def checkpoint_phase(self, folder: str) -> float | None:
        """Save tplower's model with DCP, reload it into the unparallelized model on rank 0, compare outputs.

        Every rank saves its shards (a collective); rank 0 then loads the
        checkpoint without a process group (``no_dist=True``) into a fresh
        one-process model and returns the max abs difference between its
        outputs and the parallel model's on the first batch (others ``None``).
        """
        from torch.distributed.checkpoint.state_dict_loader import load
        from torch.distributed.checkpoint.state_dict_saver import save

        model = self.models["tplower"]
        save(model.state_dict(), checkpoint_id=folder)
        pieces = self.pieces(self.batches[0])
        mine = pieces[self.dp_rank] if self.dp_rank < len(pieces) else None
        with torch.no_grad():
            parallel = self._collect(None if mine is None else model_output(self.task, model, mine).cpu())
        dist.barrier()
        self.progress("checkpoint")
        if self.rank != 0:
            return None
        fresh = load_model(self.cfg.model, device=self.device)[0]
        state = fresh.state_dict()
        load(state, checkpoint_id=folder, no_dist=True)
        fresh.load_state_dict(state)
        with torch.no_grad():
            reloaded = [model_output(self.task, fresh, p).cpu() for p in pieces]
        return _max_diff(parallel, reloaded)

    def verify_phase(self) -> dict[str, Any] | None:
        """:func:`tplower.verify` of this run's plan on the first batch: per-boundary verdicts (a collective).

        Two fresh copies of the model, one parallelized by the plan on the tp
        axis and one whole, compared boundary by boundary (forward values,
        arriving gradients, parameter gradients). Returns ``{"ok", "table",
        "first"}`` (the first divergence or ``None``). With ``dp > 1`` each dp
        group checks the same batch on its own tp axis (verify takes a one-axis
        mesh); rank 0 reports its group's.
        """
        from ..verification.verifier import verify

        batch = self.pieces(self.batches[0])[0]
        report = verify(lambda: load_model(self.cfg.model, device=self.device)[0], self.plan, self.mesh["tp"], batch)
        self.progress("verify: boundary by boundary")
        first = report.first_divergence
        return {"ok": report.ok, "table": report.table(), "first": None if first is None else str(first)}

    def params(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every copy's parameters, whole (a collective)."""
        tp = self.models["tplower"]
        out = {"tplower": gather_params(tp, shard_dims(tp, self.plan, self.mesh), self.mesh),
               "dtensor": gather_params(self.models["dtensor"], {}, self.mesh)}
        if "reference" in self.models:
            out["reference"] = {k: v.detach().cpu().clone() for k, v in self.models["reference"].named_parameters()}
        self.progress("gather parameters")
        return out

    def timing_phase(self) -> dict[str, dict[str, float]]:
        """Median ms per forward and per training step: tplower and DTensor interleaved, then one process."""
        fwd_pieces = self.pieces(self.batches[0])
        mine = fwd_pieces[self.dp_rank]

        def fwd(key: str) -> Callable[[], object]:
            def go() -> object:
                with torch.no_grad():
                    if key == "reference":
                        return [model_output(self.task, self.models[key], b) for b in fwd_pieces]
                    return model_output(self.task, self.models[key], mine)
            return go

        runs: dict[str, dict[str, list[float]]] = {k: {"forward_ms": [], "train_step_ms": []}
                                                   for k in ("tplower", "dtensor")}
        for _ in range(self.cfg.repeat + 1):  # the first round is a warm-up
            for key, r in runs.items():
                r["forward_ms"].append(_time_ms(fwd(key), self.device))
                r["train_step_ms"].append(_time_ms(functools.partial(self.step, key), self.device))
            self.progress("time: tplower vs DTensor", 2)
        timing = {k: {m: statistics.median(v[1:]) for m, v in r.items()} for k, r in runs.items()}
        dist.barrier()
        if "reference" in self.models:
            f = [_time_ms(fwd("reference"), self.device) for _ in range(self.cfg.repeat + 1)]
            s = [_time_ms(lambda: self.step("reference"), self.device) for _ in range(self.cfg.repeat + 1)]
            timing["one_process"] = {"forward_ms": statistics.median(f[1:]), "train_step_ms": statistics.median(s[1:])}
        self.progress("time: one process", 2 * (self.cfg.repeat + 1))
        dist.barrier()
        return timing


    def compile_phase(self, backend: str) -> tuple[float, dict[str, dict[str, float]]]:
        """``torch.compile`` tplower's model (and the reference on rank 0): forward check, then timings.

        The compiled modules share parameters and optimizers with the eager
        copies. Returns the max abs difference between the compiled and the
        eager tplower forward on the first batch, and the median ms per
        forward and per training step of each compiled copy (the first
        round, which compiles, is not counted).
        """
        keys = [k for k in ("tplower", "reference") if k in self.models]
        compiled: dict[str, Any] = {k: torch.compile(self.models[k], backend=backend) for k in keys}
        pieces = self.pieces(self.batches[0])
        mine = pieces[self.dp_rank]
        with torch.no_grad():
            diff = _max_diff([model_output(self.task, compiled["tplower"], mine)],
                             [model_output(self.task, self.models["tplower"], mine)])
        timing: dict[str, dict[str, float]] = {}
        for key, model in compiled.items():
            def fwd(model: Any = model, key: str = key) -> object:
                with torch.no_grad():
                    return [model_output(self.task, model, b) for b in (pieces if key == "reference" else [mine])]

            def step(model: Any = model, key: str = key) -> object:
                if key == "reference":
                    return _ref_train_step(self.task, model, self.opts[key], self.ref_train)
                return _train_step(self.task, model, self.opts[key], self.my_train, self.mesh)

            f = [_time_ms(fwd, self.device) for _ in range(self.cfg.repeat + 1)]
            s = [_time_ms(step, self.device) for _ in range(self.cfg.repeat + 1)]
            timing[f"{key}_compiled"] = {"forward_ms": statistics.median(f[1:]),
                                         "train_step_ms": statistics.median(s[1:])}
            self.progress(f"compiled: {key}")
        dist.barrier()
        return diff, timing


def _time_ms(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def rank_main(rank: int, world: int, cfg: RunConfig, device_name: str = "cpu") -> dict[str, Any] | None:
    """Run ``cfg`` on this rank (``rank`` of ``world``); rank 0 returns the report dict, others ``None``.

    The report holds ``diffs`` (max absolute difference from one process,
    per copy: ``forward``, ``loss``, ``params``), ``losses``, ``timing``
    (median ms), ``boundaries`` (rows of :class:`~.paths.BoundaryRecord`)
    and the run's shape.

    Raises:
        RunError: a plan or size the model does not fit.
    """
    quiet_dtensor_logs()
    torch.manual_seed(0)
    run = _Run(rank, cfg, torch.device(device_name))
    if rank == cfg.kill_rank:
        os._exit(3)  # debug switch --kill-rank: die without a word, as a crashed rank does
    outputs = run.forward_phase()
    losses = run.train_phase()
    reloaded = None if cfg.checkpoint is None else run.checkpoint_phase(cfg.checkpoint)
    verified = run.verify_phase()
    params = run.params()
    timing = run.timing_phase()
    compiled_diff = None
    if cfg.compile is not None:
        compiled_diff, compiled_timing = run.compile_phase(cfg.compile)
        timing |= compiled_timing
    run.progress.close()
    if rank != 0:
        return None
    ref = params["reference"]
    diffs: dict[str, dict[str, Any]] = {}
    for key in ("tplower", "dtensor"):
        pdiff, where = _param_diff(params[key], ref)
        diffs[key] = {"forward": _max_diff(outputs[key], outputs["reference"]),
                      "loss": max((abs(a - b) for a, b in zip(losses[key], losses["reference"], strict=True)),
                                  default=0.0),
                      "params": pdiff, "params_worst": where}
    if reloaded is not None:
        diffs["tplower"]["checkpoint"] = reloaded
    if compiled_diff is not None:
        diffs["tplower"]["compiled"] = compiled_diff
    if verified is not None:
        diffs["tplower"]["verify"] = 0.0 if verified["ok"] else float("inf")
    before = load_model(cfg.model)[0].state_dict()
    moved = max(float((ref[k] - before[k].cpu()).abs().max()) for k in ref)
    return {"diffs": diffs, "losses": losses, "timing": timing, "param_update_max": moved,
            "boundaries": [vars(b) | {"shape": list(b.shape)} for b in run.boundaries.rows()],
            "forward_shape": list(run.pieces(run.batches[0])[run.dp_rank]["input_ids"].shape),
            "output_shape": list(outputs["reference"][0].shape[1:]), "world": world, "verify": verified,
            "device": device_name, "backend": dist.get_backend()}
