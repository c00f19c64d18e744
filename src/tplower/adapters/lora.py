"""LoRA adapters (PEFT) on parallelized linear layers: placed so the math stays that of one process.

A LoRA layer computes ``base(x) + B(A(dropout(x))) * scaling``. With the base layer split over ``tp``, the
adapter pair is split the way the base is, and the two halves need nothing but the base's own boundary:

* **colwise** base (weight ``S(0)``: out-features sharded, input ``R`` or a sequence shard, output
  ``S(-1)``): ``B`` (``[out, r]``) is sharded as the base weight and runs the base's boundary (its input ``h``
  moves as the base's input does, with the same reduction of its gradient in backward; its output is the
  base's); ``A`` (``[r, in]``) stays whole and runs on the layer's input as it arrives. ``A``'s gradient is
  then whole on every rank (``h``'s gradient was reduced at ``B``'s boundary) unless the input arrives
  sharded (sequence parallelism): then it is partial and is reduced (``P(sum)``).
* **rowwise** base (weight ``S(1)``: in-features sharded, output ``P(sum)`` reduced to ``R`` or ``S(1)``):
  ``A`` (``[r, in]``) is sharded along ``in`` and runs the base's boundary (so ``h = A x`` is reduced as the
  base output is: an ``all_reduce`` of ``r`` features, not of ``out``); ``B`` stays whole, its gradient
  reduced when ``h`` arrives sharded.

Either way the forward moves ``r``-wide activations only, and every gradient equals one process's.

Both orders work:

* adapters added **before** :func:`tplower.parallelize` (``get_peft_model`` on the full model, then
  ``parallelize(peft_model, mesh, "auto")``): a plan entry that matches a LoRA layer applies to its
  ``base_layer``, and the adapters are placed from it;
* adapters added **after** (``get_peft_model`` on a parallelized model): PEFT builds them at the base's local
  shape; when PEFT puts a LoRA layer in place (a module registration whose ``base_layer`` tplower
  installed), :func:`place_lora_layer` gathers the sharded adapter whole, makes every rank's whole adapter
  equal to the axis' first rank's (PEFT draws them per rank) and places them as above. An adapter added
  later to an already placed layer (``add_adapter``) is refused at its first forward, naming
  :func:`place_lora` as the fix (call it before making the optimizer).

  PEFT drew the sharded adapter per rank at the local shape (a rowwise ``A`` with the local fan-in, the
  same values on every rank under one seed); :mod:`tplower.adapters.lora_init` draws it again, whole, as one
  process would, once the adapter's config is known (when the ``PeftModel`` is made, or in
  :func:`place_lora`).

Refused (:class:`~tplower.TPLowerError`, naming the module): LoRA on an embedding or convolution, DoRA
(``lora_magnitude_vector``), adapters on a base whose boundary is not a plain colwise or rowwise one, and,
added after :func:`tplower.parallelize`, an ``init_lora_weights`` other than ``True``, ``False`` and
``"gaussian"`` (PiSSA, OLoRA, LoftQ, EVA, ... compute the adapters from the base weight or from data: PEFT
read this rank's shard, and some of them fail inside PEFT on the DTensor weight before tplower sees the
layer; add those adapters before ``parallelize``).

Saving: :func:`tplower.adapters.peft_save.collective_peft_save` (wrapped when an adapter is first placed) makes
``PeftModel.save_pretrained`` write whole adapters, on every rank's call.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from ..core.support.errors import TPLowerError
from ..plans.entries import BoundaryEntry
from ..runtime.boundary import _Boundary
from .lora_init import LOCAL_DRAWS, draw_whole, local_draws_left
from .peft_save import collective_peft_save

__all__ = ["draw_whole", "is_lora_layer", "place_lora", "place_lora_layer", "redirect_to_base"]

#: ``install(module, qual, entry, lowerer, axis, config)``: tplower.parallelize's per-module install
Installer = Callable[[nn.Module, str, BoundaryEntry, Any, str], Any]

_INSTALL: list[Installer] = []
_HOOK: list[RemovableHandle] = []


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer: a ``base_layer`` and ``lora_A``/``lora_B`` module dicts."""
    return (isinstance(getattr(module, "base_layer", None), nn.Module)
            and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
            and isinstance(getattr(module, "lora_B", None), nn.ModuleDict))


def redirect_to_base(matched: Mapping[str, str], modules: Mapping[str, nn.Module]) -> dict[str, str]:
    """Plan matches with each LoRA layer's match moved to its ``base_layer`` (``{module name: plan key}``)."""
    out: dict[str, str] = {}
    for qual, key in matched.items():
        m = modules.get(qual)
        if m is not None and is_lora_layer(m) and f"{qual}.base_layer" in modules:
            out.setdefault(f"{qual}.base_layer", key)
        else:
            out[qual] = key
    return out


def _axis_spec(spec: Any, axis: str) -> str:
    if isinstance(spec, Mapping):
        return str(spec.get(axis, "R"))
    return str(spec)


def _family(entry: BoundaryEntry, axis: str, qual: str) -> str:
    """``"colwise"`` (weight ``S(0)``) or ``"rowwise"`` (``S(1)``) of a base entry, else refuse."""
    weight = _axis_spec(entry.params.get("weight", entry.params.get("*", "R")), axis)
    odd = [f for f in ("partial_tail", "masked_lookup", "expert_dispatch", "local_compute")
           if getattr(entry, f) is not None] + (["share"] if entry.share else [])
    if weight in ("S(0)", "S(-2)") and not odd:
        return "colwise"
    if weight in ("S(1)", "S(-1)") and not odd:
        return "rowwise"
    raise TPLowerError(f"module {qual!r}: a LoRA adapter on a base placed {weight} on {axis!r}"
                       f"{' with ' + ', '.join(odd) if odd else ''} has no placement tplower can prove; "
                       "LoRA is placed for colwise (S(0)) and rowwise (S(1)) linear layers only: leave this "
                       "module out of the LoRA target_modules")


def _sharded(spec: Any, axis: str) -> bool:
    return _axis_spec(spec, axis).startswith("S(")


def adapter_entries(base: BoundaryEntry, axis: str, qual: str, has_bias: bool
                    ) -> tuple[str, BoundaryEntry, str, BoundaryEntry]:
    """The entries of one adapter pair on a base of entry ``base``.

    Returns:
        ``(sharded name, its entry, whole name, its entry)`` with names ``"lora_A"``/``"lora_B"``: the
        sharded adapter takes the base's boundary and weight placement; the whole one ``R`` with a
        ``P(sum)`` gradient where its input arrives sharded.

    Raises:
        TPLowerError: a base that is neither colwise nor rowwise (see the module docstring).
    """
    family = _family(base, axis, qual)
    weight = base.params.get("weight", base.params.get("*"))
    params: dict[str, Any] = {"weight": weight}
    if has_bias and family == "colwise":
        params["bias"] = base.params.get("bias", weight)
    packed = {"weight": base.packed["weight"]} if "weight" in base.packed else {}
    # no deferred bias: the sharded adapter of a rowwise base is A, which PEFT never gives a bias (lora_bias
    # puts it on B, the whole one here), and a colwise base's B bias is sharded with its rows
    sharded = dataclasses.replace(base, params=params, param_grads={}, local_attrs={}, packed=packed,
                                  deferred_bias=None)
    if family == "colwise":
        inp = next(iter(base.in_src.values()), "R")
        name, whole_name = "lora_B", "lora_A"
    else:
        inp = next(iter(base.out_dst.values()), "R")
        name, whole_name = "lora_A", "lora_B"
    rep = {axis: "R"}
    whole = BoundaryEntry(params={"weight": rep, "bias": rep},
                          param_grads={"weight": {axis: "P(sum)"}, "bias": {axis: "P(sum)"}} if _sharded(inp, axis)
                          else {})
    return name, sharded, whole_name, whole


def _refuse_other_adapters(layer: nn.Module, qual: str) -> None:
    for attr in ("lora_embedding_A", "lora_magnitude_vector"):
        d = getattr(layer, attr, None)
        if isinstance(d, (nn.ModuleDict, nn.ParameterDict)) and len(d):
            raise TPLowerError(f"module {qual!r}: {attr} ({'DoRA' if 'magnitude' in attr else 'embedding LoRA'}) "
                               "on a parallelized layer is not placed by tplower; use plain LoRA on linear layers")
    base = layer.base_layer
    if not isinstance(base, nn.Linear):
        raise TPLowerError(f"module {qual!r}: LoRA on a {type(base).__name__} base is not placed by tplower; "
                           "LoRA is placed on nn.Linear layers only")


def _whole(p: torch.Tensor, global_shape: torch.Size, base: DTensor, sharded: bool) -> torch.Tensor:
    """The whole value of an adapter tensor PEFT built at the base's local shape (sharded) or whole.

    A sharded one is gathered with the base weight's mesh and placements (its shard dim means the same
    features); a whole one is the axis' first rank's (PEFT draws each rank's on its own).
    """
    data = p.detach().contiguous()
    if tuple(data.shape) == tuple(global_shape):
        if not sharded:
            group = base.device_mesh.get_group(0)
            data = data.clone()
            dist.broadcast(data, src=dist.get_global_rank(group, 0), group=group)
        return data
    whole: torch.Tensor = DTensor.from_local(data, base.device_mesh, base.placements, run_check=False,
                                             shape=global_shape,
                                             stride=torch.empty(global_shape, device="meta").stride()).full_tensor()
    return whole


def place_lora_layer(layer: nn.Module, qual: str | None = None) -> int:
    """Place the unplaced adapters of LoRA layer ``layer`` whose ``base_layer`` tplower parallelized.

    Args:
        layer: a PEFT LoRA layer (:func:`is_lora_layer`).
        qual: its module name, for messages (default: the base boundary's name).

    Returns:
        The number of adapter pairs placed (``0``: nothing to do, or the base is not parallelized).

    Raises:
        TPLowerError: an adapter kind or a base tplower does not place (see the module docstring).
    """
    base: Any = layer.base_layer
    boundary = base.__dict__.get("forward")
    if not isinstance(boundary, _Boundary) or boundary.entry is None or not _INSTALL:
        return 0
    qual = qual or boundary.info.module.removesuffix(".base_layer")
    _refuse_other_adapters(layer, qual)
    weight = base._parameters.get("weight")
    assert isinstance(weight, DTensor), "a parallelized colwise/rowwise base holds a DTensor weight"
    n = 0
    local_draws: dict[str, str] = {}
    lora_a: Any = layer.lora_A
    lora_b: Any = layer.lora_B
    for name in list(lora_a.keys()):
        if name not in lora_b:
            continue
        a, b = lora_a[name], lora_b[name]
        if isinstance(a.weight, DTensor) or isinstance(b.weight, DTensor):
            continue
        sname, sentry, _, wentry = adapter_entries(boundary.entry, boundary.axis, qual,
                                                       getattr(b, "bias", None) is not None)
        out_f, in_f = weight.shape
        r = a.weight.shape[0]
        shapes = {"lora_A": torch.Size((r, in_f)), "lora_B": torch.Size((out_f, r))}
        if tuple((a if sname == "lora_A" else b).weight.shape) != tuple(shapes[sname]):
            local_draws[name] = sname  # PEFT built it at the local shape: drawn per shard
        for adapter, aname in ((a, "lora_A"), (b, "lora_B")):
            with torch.no_grad():
                full = _whole(adapter.weight, shapes[aname], weight, aname == sname)
                adapter.weight = nn.Parameter(full, requires_grad=adapter.weight.requires_grad)
                bias = getattr(adapter, "bias", None)
                if bias is not None:
                    bshape = torch.Size((shapes[aname][0],))
                    adapter.bias = nn.Parameter(_whole(bias, bshape, weight, aname == sname),
                                                requires_grad=bias.requires_grad)
            entry = sentry if aname == sname else wentry
            _INSTALL[0](adapter, f"{qual}.{aname}.{name}", entry, boundary.lowerer, boundary.axis)
        n += 1
    if local_draws:
        layer.__dict__.setdefault(LOCAL_DRAWS, {}).update(local_draws)
    if n and "_tplower_lora_check" not in layer.__dict__:
        layer.__dict__["_tplower_lora_check"] = layer.register_forward_pre_hook(functools.partial(_check_placed, qual))
    if n:
        collective_peft_save()  # PeftModel.save_pretrained writes whole adapters
    return n


def _check_placed(qual: str, layer: nn.Module, args: Any) -> None:
    lora_b: Any = layer.lora_B
    for name, b in lora_b.items():
        if not isinstance(b.weight, DTensor):
            raise TPLowerError(f"LoRA adapter {name!r} was added to a parallelized layer after its adapters were "
                               "placed; call tplower.adapters.lora.place_lora(model) after adding it (before making "
                               "the optimizer)")
    if layer.__dict__.get(LOCAL_DRAWS):
        warnings.warn(f"tplower: module {qual!r}: LoRA adapters {sorted(layer.__dict__[LOCAL_DRAWS])} keep PEFT's "
                      "per-shard initial draw (no PeftModel was made, which would draw them whole); call "
                      "tplower.adapters.lora.place_lora(model) on every rank before training", stacklevel=2)


def place_lora(model: nn.Module) -> int:
    """Place every unplaced LoRA adapter of ``model`` on a base :func:`tplower.parallelize` split.

    Call it after adding adapters to a parallelized model by a path that does not register a new LoRA
    layer (``add_adapter`` on a layer that already has one), or that makes no ``PeftModel``
    (``inject_adapter_in_model``, transformers' ``add_adapter``), before making the optimizer (the adapters'
    parameters are replaced). Then draws whole (:func:`draw_whole`) the sharded adapters PEFT drew per shard,
    by ``model.peft_config``. A collective over each base's axis: call it on every rank.

    Args:
        model: a model holding PEFT LoRA layers (the ``PeftModel`` or the model PEFT injected into).

    Returns:
        The number of adapter pairs placed.

    Raises:
        TPLowerError: as :func:`place_lora_layer`; an adapter drawn per shard that ``model.peft_config``
            does not name (pass the model that holds the config), or whose ``init_lora_weights`` tplower does
            not draw (:func:`draw_whole`).
    """
    n = sum(place_lora_layer(m, q) for q, m in model.named_modules() if is_lora_layer(m))
    configs = getattr(model, "peft_config", None)
    draw_whole(model, configs if isinstance(configs, Mapping) else {})
    left = local_draws_left(model)
    if left:
        raise TPLowerError(f"place_lora: adapters {left} were drawn per shard and {type(model).__name__}.peft_config "
                           "does not name them; call place_lora on the PeftModel (or the model PEFT injected into)")
    return n


def _on_register(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    if submodule is None:
        return
    if is_lora_layer(submodule):
        place_lora_layer(submodule)
    elif isinstance(submodule.__dict__.get("peft_config"), Mapping) and "model" in submodule._modules:
        # a PEFT tuner taken by its PeftModel: the adapters' configs are known now
        draw_whole(submodule, submodule.__dict__["peft_config"])


def watch_registrations(install: Installer) -> None:
    """Place adapters when PEFT puts a LoRA layer around a parallelized base (once per process).

    Args:
        install: :func:`tplower.parallelize`'s per-module install, ``install(module, qual, entry, lowerer,
            axis)``.
    """
    if not _INSTALL:
        _INSTALL.append(install)
    if not _HOOK:
        _HOOK.append(torch.nn.modules.module.register_module_module_registration_hook(_on_register))
