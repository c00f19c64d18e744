"""The code generator: a parallelized model's forwards written out as straight-line Python, and installed back.

One idea: what :func:`tplower.parallelize` installs on each module (its boundary: moves, local compute,
parameter views) is data, so it can be written out as a plain ``forward`` per module that calls named
bare operators, and bound back in place of the hooks, bit-identical to them. Built on
:mod:`tplower.nn` (it reads what ``parallelize`` installed) and :mod:`tplower.core`; the module layer
never imports it (the layer contract in ``pyproject.toml``).

* :mod:`~tplower.codegen.emit`: :func:`emit` (a model and a plan in, a Python module's source out) and
  :func:`install` (a generated file bound to a live mesh in place of the hooks).
* :mod:`~tplower.codegen.ops`: :class:`GeneratedOps`, the runtime a generated file calls (operators bound
  to the mesh by ``install``).
* :mod:`~tplower.codegen.writer`: the text of one generated forward.
* :mod:`~tplower.codegen.text`: the comments above each operator call (transition, collectives, bytes).

A generated file imports this package and reads ``tplower.codegen.GeneratedOps``.
"""

from __future__ import annotations

from .emit import GeneratedOps, emit, install

__all__ = ["GeneratedOps", "emit", "install"]
