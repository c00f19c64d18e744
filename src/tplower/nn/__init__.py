"""The module layer: plans and boundaries of ``nn.Module``s, and installing them with ``parallelize``.

Built on :mod:`tplower.core` only; the code generator (:mod:`tplower.codegen`) and the verifier
(:mod:`tplower.verify`) sit above it:

* :mod:`~tplower.nn.plans`, :mod:`~tplower.nn.styles`, :mod:`~tplower.nn.hf_plans`: plan entries and
  Hugging Face ``tp_plan`` styles (:mod:`~tplower.nn.conv1d`, :mod:`~tplower.nn.alibi`: two styles' local
  computes; :mod:`~tplower.nn.expert_layout`: the dim a style splits in an experts module's parameters, read
  from its layout); :mod:`~tplower.nn.derive`: a plan derived from the module tree.
* :mod:`~tplower.nn.boundaries`, :mod:`~tplower.nn.boundary_runtime`, :mod:`~tplower.nn.operators`:
  boundary forms, the installed forward and the bare operators (``TPOperators``).
* :mod:`~tplower.nn.parallelize`, :mod:`~tplower.nn.params`, :mod:`~tplower.nn.install_params`,
  :mod:`~tplower.nn.rest_params`, :mod:`~tplower.nn.uneven`, :mod:`~tplower.nn.experts`: install a plan
  (DTensor parameters, lowered boundaries, uneven activations, expert dispatch);
  :mod:`~tplower.nn.fanout`: siblings that read one tensor share its move.
* :mod:`~tplower.nn.coverage`: every parameter covered (a whole one used on sharded activations).
* :mod:`~tplower.nn.full_state`, :mod:`~tplower.nn.loading`, :mod:`~tplower.nn.packed_checkpoint`,
  :mod:`~tplower.nn.lora`, :mod:`~tplower.nn.lora_init`: whole state dicts (``save_pretrained`` of
  transformers and PEFT models), safetensors loading, DCP of packed parameters, PEFT LoRA (placed, and its
  first draw whole).
"""
