"""Bytes of tensor storages alive on this rank during a training step, at most and by kind.

:class:`LiveTensors` is the tracker :mod:`tplower.planner` measures a step with, on fake tensors (the prediction)
and on real ones (the check) alike. It counts storages, not tensors (a view adds nothing): those it is told are
held before the step starts (parameters, buffers, optimizer state, the batch: :meth:`LiveTensors.hold`) and every
storage an operator creates while it is active, each until it is freed (a finalizer per storage), with its size
kept current when FSDP2 frees or refills a storage in place (``UntypedStorage.resize_``, patched while active, as
``torch.distributed._tools.mem_tracker.MemTracker`` does). At each new peak it notes how the bytes split into the
model's parameters, their gradients, the optimizer's state, the batch and the rest (activations saved for
backward, temporaries, FSDP2's gathered parameters, communication buffers).

Why not ``MemTracker`` itself: it registers hooks on each module's parameters at call time, and under tplower's
context parallelism a module's parameter attribute is a local view, not a leaf (it refuses). The bytes it counts
are the same: CPU storages are counted at their size; on CUDA ``MemTracker`` rounds each storage to 512 bytes
(the caching allocator's block), which :class:`LiveTensors` does too for CUDA tensors.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["KINDS", "LiveTensors", "layer_places"]

#: the kinds a peak is split into (bytes of each, in :attr:`LiveTensors.peak_split`)
KINDS = ("parameters", "gradients", "optimizer", "batch", "activations")

_BLOCK = 512  # the CUDA caching allocator's smallest block (bytes)


def _storage(t: Any) -> torch.UntypedStorage | None:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t._local_tensor
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return None


def _nbytes(st: torch.UntypedStorage) -> int:
    n = int(st.nbytes())
    return math.ceil(n / _BLOCK) * _BLOCK if st.device.type == "cuda" else n


class LiveTensors(TorchDispatchMode):
    """While active: :attr:`live` and :attr:`peak` bytes of the storages alive, :attr:`peak_split` at the peak.

    Args:
        kinds: ``{kind: callable returning the tensors of that kind now}`` for :data:`KINDS` other than
            ``"activations"`` (e.g. ``{"gradients": lambda: [p.grad for p in params]}``); read at each new peak
            to split it (the rest is ``"activations"``).

    Use as ``t = LiveTensors(kinds); t.hold(tensors); with t: step()``; then ``t.peak`` (bytes) and
    ``t.peak_split`` (``{kind: bytes}``, summing to ``t.peak``). :meth:`reset_peak` starts a new peak from the
    bytes alive now. Setting :attr:`phase` (``"forward"``, ``"backward"``, ...) keeps each phase's own peak too,
    split, in :attr:`phases`; setting :attr:`places` as well keeps the phase's peak at those places too (under
    ``"<phase> <place>"``: a decoder layer's place, ``"first"``, ``"second"``, ..., or ``"start"``/``"end"``:
    :func:`layer_places`).
    """

    def __init__(self, kinds: dict[str, Callable[[], Iterable[Any]]] | None = None) -> None:
        super().__init__()
        self.kinds = dict(kinds or {})
        unknown = set(self.kinds) - set(KINDS[:-1])
        if unknown:
            raise ValueError(f"LiveTensors: kinds {sorted(unknown)} are not among {list(KINDS[:-1])}")
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}  # id(storage) -> bytes counted
        self.peak_split: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._phase: str | None = None
        self.phases: dict[str, dict[str, int]] = {}
        self._places: tuple[str, ...] = ()
        self._keys: tuple[str, ...] = ()  # the phases keys the running place updates (set with phase and places)
        self._resize: Any = None

    @property
    def phase(self) -> str | None:
        """The phase the step is in (set by the caller); ``phases[phase]`` is its own peak, split."""
        return self._phase

    @phase.setter
    def phase(self, value: str | None) -> None:
        self._phase = value
        self._rekey()

    @property
    def places(self) -> tuple[str, ...]:
        """Where in the phase the step is (set by the caller; :func:`layer_places`' hooks)."""
        return self._places

    @places.setter
    def places(self, value: tuple[str, ...]) -> None:
        self._places = value
        self._rekey()

    def _rekey(self) -> None:
        p = self._phase
        self._keys = () if p is None else (p, *(f"{p} {q}" for q in self._places))

    def hold(self, tensors: Iterable[Any]) -> None:
        """Count the storages of ``tensors`` (DTensors by their local tensor; ``None`` and meta skipped) as alive."""
        for t in tensors:
            st = _storage(t)
            if st is not None:
                self._add(st)
        self._note_peak()

    def reset_peak(self) -> None:
        """Start the peak again from the bytes alive now."""
        self.peak = 0
        self._note_peak()

    def _add(self, st: torch.UntypedStorage) -> None:
        key = id(st)  # the storage's Python object lives as long as the storage does
        if key in self.sizes:
            return
        n = _nbytes(st)
        self.sizes[key] = n
        self.live += n
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)

    def _note_peak(self) -> None:
        higher = [k for k in self._keys if k not in self.phases or self.live > sum(self.phases[k].values())]
        if self.live <= self.peak and not higher:
            return
        split = dict.fromkeys(KINDS, 0)
        seen: set[int] = set()
        for kind, tensors in self.kinds.items():
            for t in tensors():
                st = _storage(t)
                if st is not None and id(st) in self.sizes and id(st) not in seen:
                    seen.add(id(st))
                    split[kind] += self.sizes[id(st)]
        split["activations"] = self.live - sum(split.values())
        for k in higher:
            self.phases[k] = split
        if self.live > self.peak:
            self.peak = self.live
            self.peak_split = split

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        grew = False
        for t in pytree.tree_leaves(out):
            st = _storage(t)
            if st is not None and id(st) not in self.sizes:
                self._add(st)
                grew = True
        if grew:
            self._note_peak()
        return out

    def __enter__(self) -> LiveTensors:
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = original(st, size)
            key = id(st)
            if key in tracker.sizes:
                n = _nbytes(st)
                tracker.live += n - tracker.sizes[key]
                tracker.sizes[key] = n
                tracker._note_peak()
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]


def layer_places(model: nn.Module, tracker: LiveTensors) -> list[Any]:
    """Hooks that keep ``tracker.places`` at the decoder layer the step is in, by its place: ``first``, ``second``,
    ``penultimate``, ``last`` (layers ``0``, ``1``, ``n - 2``, ``n - 1``; a layer can hold two), else ``middle``;
    ``start`` before the phase's first layer and ``end`` after its last (the caller sets ``start`` as a phase
    begins). In forward from each layer's hooks; in backward from gradient hooks on its output (its backward
    starts) and on the first layer's input (the last layer's backward ends). Returns the handles (none for a model
    without transformers' decoder layers, or with fewer than 3).

    Why: a phase's peak over its moments is the largest of lines in the layer count, so the peaks of three and
    four layers counted on can miss a moment that overtakes at more layers (the end of backward, where gradients
    pile up, overtaking its start). The peak at each place is one such line (the middle layers lie between the
    second and the penultimate), so :meth:`tplower.planner.trace.StepTrace.scaled` counts each on and takes the largest.
    """
    from ..context.discover import decoder_layers

    layers = [layer for _, _, layer in decoder_layers(model)]
    n = len(layers)
    if n < 3:
        return []

    def at(here: tuple[str, ...]) -> Callable[[Any], None]:
        def hook(grad: Any) -> None:
            tracker.places = here
        return hook

    handles = []
    for j, layer in enumerate(layers):
        here = tuple(name for name, k in (("first", 0), ("second", 1), ("penultimate", n - 2), ("last", n - 1))
                     if j == k) or ("middle",)

        def pre(module: nn.Module, args: Any, kwargs: Any, here: tuple[str, ...] = here, j: int = j) -> None:
            tracker.places = here  # (in backward too: checkpointing's recomputation)
            x = args[0] if args else kwargs.get("hidden_states")
            if j == 0 and tracker.phase == "forward" and isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(at(("end",)))

        def post(module: nn.Module, args: Any, output: Any, here: tuple[str, ...] = here, j: int = j) -> None:
            if tracker.phase != "forward":
                return  # (a recomputation in backward: its layer's backward goes on)
            if j == n - 1:
                tracker.places = ("end",)  # (between two layers: still the one before)
            y = output[0] if isinstance(output, tuple) else output
            if isinstance(y, torch.Tensor) and y.requires_grad:
                y.register_hook(at(here))

        handles += [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post)]
    return handles
