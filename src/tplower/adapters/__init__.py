"""Adapters: PEFT LoRA layers on a parallelized model, placed from their base layer's entry.

One idea: an adapter added to a planned layer runs beside it with the same
boundary (a colwise base gets a colwise ``B``; a rowwise base a rowwise
``A``), its first draw whole as one process draws it, and its save whole:

* :mod:`~tplower.adapters.lora`: LoRA layers placed and installed (before or after ``parallelize``);
* :mod:`~tplower.adapters.lora_init`: their initial values drawn whole, then sharded;
* :mod:`~tplower.adapters.peft_save`: PEFT's ``save_pretrained`` writing whole adapters.

Built on :mod:`tplower.runtime`, :mod:`tplower.state`, :mod:`tplower.plans` and :mod:`tplower.core`.
"""
