"""The lowering and the call path: a planned transition bound to a live mesh's process groups and run as collectives.

* :mod:`~tplower.core.lower.collectives`, :mod:`~tplower.core.lower.backends`: the collectives on local tensors, the
  one autograd Function, and what each backend can carry.
* :mod:`~tplower.core.lower.binding`, :mod:`~tplower.core.lower.program`: a step bound to a group, a transition's
  steps as one runnable program (forward and backward).
* :mod:`~tplower.core.lower.redistribute`: :class:`MeshLowerer` (plans bound to a live mesh) and
  ``redistribute_local``; :mod:`~tplower.core.lower.callcache`, :mod:`~tplower.core.lower.traced`,
  :mod:`~tplower.core.lower.mesh_facts`: its fast path, its lookups under ``torch.compile``, the mesh read once.
* :mod:`~tplower.core.lower.lowering`: the seed API (``classify_tp_transition``, ``TPExecutionOp``, ...).
* :mod:`~tplower.core.lower.overlap`: a linear layer after an ``R -> R`` (gradient ``P``) transition as one autograd
  Function, the transition's backward all_reduce started before the weight gradient and waited for after it.
* :mod:`~tplower.core.lower.agreement`, :mod:`~tplower.core.lower.debug_path`: the debug check that ranks agree on a
  call; :mod:`~tplower.core.lower.cache`: bounded caches; :mod:`~tplower.core.lower.traffic`: collective counts.
"""
