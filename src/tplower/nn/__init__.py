"""The module layer: plans and boundaries of ``nn.Module``s, and installing them with ``parallelize``.

Built on :mod:`tplower.core` only; the code generator (:mod:`tplower.codegen`) and the verifier
(:mod:`tplower.verify`) sit above it:

* :mod:`~tplower.plans.entries`, :mod:`~tplower.plans.styles`, :mod:`~tplower.plans.hf`: plan entries and
  Hugging Face ``tp_plan`` styles (:mod:`~tplower.families.conv1d`, :mod:`~tplower.families.alibi`: two styles' local
  computes; :mod:`~tplower.plans.expert_layout`: the dim a style splits in an experts module's parameters, read
  from its layout); :mod:`~tplower.plans.derive`: a plan derived from the module tree.
* :mod:`~tplower.plans.forms`, :mod:`~tplower.runtime.boundary`, :mod:`~tplower.runtime.operators`:
  boundary forms, the installed forward and the bare operators (``TPOperators``).
* :mod:`~tplower.nn.parallelize`, :mod:`~tplower.runtime.params`, :mod:`~tplower.nn.install_params`,
  :mod:`~tplower.runtime.rest_params`, :mod:`~tplower.runtime.uneven`, :mod:`~tplower.runtime.experts`: install a plan
  (DTensor parameters, lowered boundaries, uneven activations, expert dispatch);
  :mod:`~tplower.runtime.fanout`: siblings that read one tensor share its move.
* :mod:`~tplower.nn.coverage`: every parameter covered (a whole one used on sharded activations).
* :mod:`~tplower.state.full_state`, :mod:`~tplower.state.loading`, :mod:`~tplower.state.packed_checkpoint`,
  :mod:`~tplower.adapters.lora`, :mod:`~tplower.adapters.lora_init`: whole state dicts (``save_pretrained`` of
  transformers and PEFT models), safetensors loading, DCP of packed parameters, PEFT LoRA (placed, and its
  first draw whole).
"""
