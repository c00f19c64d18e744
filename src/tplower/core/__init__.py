"""The core: placement transitions planned, bound to a mesh's process groups and run as collectives.

Imports nothing else of tplower (the layer contract in ``pyproject.toml``):

* :mod:`~tplower.core.placements`: parsing and formatting placements.
* :mod:`~tplower.core.transitions`: the pure planner (steps, shapes, bytes).
* :mod:`~tplower.core.collectives`: the collectives on local tensors and the one autograd Function.
* :mod:`~tplower.core.overlap`: a linear layer after an ``R -> R`` (gradient ``P``) transition as one autograd
  Function, the transition's backward all_reduce started before the weight gradient and waited for after it.
* :mod:`~tplower.core.redistribute`: :class:`MeshLowerer` (plans bound to a live mesh) and ``redistribute_local``.
* :mod:`~tplower.core.callcache`: ``redistribute_local``'s fast path (a call seen before goes straight to its program).
* :mod:`~tplower.core.lowering`: the seed API (``classify_tp_transition``, ``TPExecutionOp``, ...).
* :mod:`~tplower.core.dispatch`: expert parallelism's token exchange (``plan_dispatch``, ``dispatch_tokens``,
  ``combine_tokens``) over one differentiable variable-split ``all_to_all``; :mod:`~tplower.core.dispatch_traced`:
  the same under ``torch.compile`` (counts kept as tensors, the exchange one operator: no graph break).
* :mod:`~tplower.core.teardown`: dropping every reference to destroyed process groups, so a process exits cleanly.
* :mod:`~tplower.core.agreement`, :mod:`~tplower.core.argcheck`, :mod:`~tplower.core.cache`,
  :mod:`~tplower.core.errors`, :mod:`~tplower.core.explain`: the debug check, argument checks,
  bounded caches, errors and the text of ``tplower explain``.
"""
