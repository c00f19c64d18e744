"""The transition language: placements as text and as PyTorch's types, and the pure planner of transitions.

* :mod:`~tplower.core.language.placement_text`: the placement syntax, read without torch.
* :mod:`~tplower.core.language.placements`: parsing and formatting placements (``R``, ``S(d)``, ``P(op)``), named
  per mesh axis.
* :mod:`~tplower.core.language.transitions`: the pure planner: a transition as ordered single-axis steps, their
  local shapes and bytes.
* :mod:`~tplower.core.language.explain`: the text of ``tplower explain``.

No process group, no collective: the lowering (:mod:`tplower.core.lower`) and every later stage read these.
"""
