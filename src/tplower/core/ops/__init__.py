"""Model-level operations built on the lowering: whole steps of a model's forward, not single transitions.

* :mod:`~tplower.core.ops.dispatch`: expert parallelism's token exchange (``plan_dispatch``, ``dispatch_tokens``,
  ``combine_tokens``) over one differentiable variable-split ``all_to_all``; :mod:`~tplower.core.ops.dispatch_traced`:
  the same under ``torch.compile`` (counts kept as tensors, the exchange one operator: no graph break).
* :mod:`~tplower.core.ops.vocab_loss`: cross entropy over logits sharded on the vocabulary, without gathering them.

They sit above :mod:`tplower.core.lower` (the layer contract): nothing in the lowering imports them.
"""
