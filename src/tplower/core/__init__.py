"""The core: placement transitions planned, bound to a mesh's process groups and run as collectives.

Imports nothing else of tplower (the layer contract in ``pyproject.toml``). Four rooms, each importing only the
rooms below it:

* :mod:`tplower.core.ops`: model-level operations built on the lowering: expert parallelism's token exchange
  (``plan_dispatch``, ``dispatch_tokens``, ``combine_tokens``, and the same under ``torch.compile``) and the
  vocabulary-parallel cross entropy.
* :mod:`tplower.core.lower`: the lowering and the call path: collectives on local tensors, backends, plans bound
  to a live mesh (:class:`~tplower.core.lower.redistribute.MeshLowerer`, ``redistribute_local`` and its fast
  path), the seed API (``classify_tp_transition``, ``TPExecutionOp``, ...), the overlapped linear, the debug
  check, bounded caches and collective traffic counts.
* :mod:`tplower.core.language`: the transition language: placements parsed and formatted, the pure planner
  (steps, shapes, bytes) and the text of ``tplower explain``; no process group.
* :mod:`tplower.core.support`: the process's housekeeping: the error classes, argument checks, counted words and
  dropping every reference to destroyed process groups, so a process exits cleanly.
"""
