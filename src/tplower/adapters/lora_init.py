"""The first values of LoRA adapters added after :func:`tplower.parallelize`: drawn whole, as one process.

Added to a parallelized model, PEFT builds each adapter at its base's local shape and draws it there, per
rank: the sharded one of a pair (``A`` ``[r, in/tp]`` of a rowwise base, ``B`` ``[out/tp, r]`` of a colwise
one) with the local fan-in (a rowwise ``A``'s ``kaiming_uniform_`` bound is ``1/sqrt(in/tp)``, not
``1/sqrt(in)``) and, under one seed, the same values on every rank. :func:`tplower.adapters.lora.place_lora_layer`
places it as drawn and records it (``layer.__dict__[LOCAL_DRAWS]``); :func:`draw_whole` draws it again, whole,
as PEFT in one process would. The draw depends on the adapter's ``init_lora_weights``, which the layer does
not keep, so it waits for the config:

* when the ``PeftModel`` takes its tuner (``get_peft_model``, ``PeftModel(...)``,
  ``PeftModel.from_pretrained``: the registration of a module holding ``peft_config`` and ``model``, which
  :mod:`tplower.adapters.lora`'s registration hook sees);
* in :func:`tplower.adapters.lora.place_lora` (``inject_adapter_in_model``, transformers' ``add_adapter``: PEFT
  makes no ``PeftModel``; until then each such layer warns at its forward).

The values follow one process's distribution; they are not one process's values: PEFT's draws at the local
shapes used other amounts of the generator, so no seed replays a one-process ``get_peft_model``. Drawn from a
given generator state (:func:`tplower.adapters.lora.place_lora` after ``torch.manual_seed``), they equal PEFT's own
``reset_lora_parameters`` run on one process's layers in module order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.support.errors import TPLowerError
from ..state.full_state import shard_of

__all__ = ["LOCAL_DRAWS", "draw_whole", "local_draws_left"]

#: ``layer.__dict__`` key: ``{adapter name: "lora_A" | "lora_B"}``, the sharded adapter PEFT drew per shard
LOCAL_DRAWS = "_tplower_local_draws"


def local_draws_left(model: nn.Module) -> list[str]:
    """``"module:adapter"`` of each adapter of ``model`` still holding PEFT's per-shard draw."""
    return sorted(f"{q}:{k}" for q, m in model.named_modules() for k in m.__dict__.get(LOCAL_DRAWS) or {})


def _init_mode(config: Any, qual: str, name: str) -> bool | str:
    init = getattr(config, "init_lora_weights", True)
    if isinstance(init, str) and init.lower() == "gaussian":
        return "gaussian"
    if init is True or init is False:
        return bool(init)
    raise TPLowerError(f"module {qual!r}: LoRA adapter {name!r} with init_lora_weights={init!r} was added after "
                       "tplower.parallelize: PEFT computed it from this rank's shard of the base weight (or left it "
                       "to a data-driven step that would); tplower draws whole only init_lora_weights True, False "
                       "and 'gaussian'. Add this adapter to the whole model, before tplower.parallelize")


def _one_process_draw(shape: torch.Size, r: int, sname: str, init: bool | str, bias: bool) -> dict[str, torch.Tensor]:
    """One process's first draw of adapter ``sname`` (``weight`` ``shape`` ``[out, in]``, ``bias`` ``[out]``).

    As PEFT makes it: on the default device and dtype, from the default generator. ``False``: ``nn.Linear``'s
    own ``reset_parameters``; ``True``: ``A`` ``kaiming_uniform_(a=sqrt(5))``, ``B`` zeros; ``"gaussian"``:
    ``A`` ``normal_(std=1/r)``, ``B`` zeros (PEFT's ``LoraLayer.reset_lora_parameters``).
    """
    if init is False:
        linear = nn.Linear(shape[1], shape[0], bias=bias, device="meta").to_empty(device=torch.get_default_device())
        linear.reset_parameters()
        return {n: p.detach() for n, p in linear.named_parameters()}
    weight = torch.empty(shape)
    if sname == "lora_B":
        weight.zero_()
    elif init is True:
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    else:
        nn.init.normal_(weight, std=1 / r)
    return {"weight": weight, **({"bias": torch.zeros(shape[0])} if bias else {})}


def draw_whole(model: nn.Module, configs: Mapping[str, Any]) -> int:
    """Draw again, whole, each sharded adapter PEFT drew per shard (added after :func:`tplower.parallelize`).

    For each LoRA layer of ``model`` in module order, each adapter whose sharded half (``A`` ``[r, in]`` of a
    rowwise base, ``B`` ``[out, r]`` of a colwise one) PEFT built at the base's local shape: every rank draws
    the whole tensor as one process's PEFT would for the adapter's ``init_lora_weights`` (see the module
    docstring), the axis' first rank's draw is broadcast, and each rank keeps its shard (in place: the
    parameters stay the same objects). The whole (replicated) adapters, which PEFT drew at their whole shape
    and :func:`~tplower.adapters.lora.place_lora_layer` made the axis' first rank's, are left as they are.
    A collective over each adapter's axis: call it on every rank; every rank draws the same amount from its
    generator, so ranks seeded alike stay alike.

    Args:
        model: a module holding LoRA layers tplower placed (a ``PeftModel``, its tuner or the model inside).
        configs: ``{adapter name: its LoraConfig}`` (``peft_model.peft_config``); adapters not in it are left
            for a later call.

    Returns:
        The number of adapters drawn.

    Raises:
        TPLowerError: an adapter's ``init_lora_weights`` is not ``True``, ``False`` or ``"gaussian"``.
    """
    n = 0
    for qual, layer in model.named_modules():
        local_draws = layer.__dict__.get(LOCAL_DRAWS)
        for name in [k for k in (local_draws or {}) if k in configs]:
            sname = local_draws.pop(name)
            adapter = getattr(layer, sname)[name]
            init = _init_mode(configs[name], qual, name)
            bias = getattr(adapter, "bias", None)
            drawn = _one_process_draw(adapter.weight.shape, int(layer.r[name]), sname, init, bias is not None)
            for pname, value in drawn.items():
                p = getattr(adapter, pname)
                whole = value.to(device=p.device, dtype=p.dtype)
                group = p.device_mesh.get_group(0)
                dist.broadcast(whole, src=dist.get_global_rank(group, 0), group=group)
                with torch.no_grad():
                    p._local_tensor.copy_(shard_of(whole, p)._local_tensor)
            n += 1
    return n
