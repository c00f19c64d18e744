"""What runs at every call of a parallelized model: boundaries, local parameters, moves, streams.

One idea: a planned module's ``forward`` becomes a boundary that takes its
parameters' local tensors, moves the declared inputs by tplower's lowered
collectives, runs the module's own compute and moves the outputs; every
decision was made before (:mod:`tplower.nn`), so a call only reads it:

* :mod:`~tplower.runtime.boundary`: the installed forward (:class:`InstalledBoundary` describes it);
* :mod:`~tplower.runtime.params`, :mod:`~tplower.runtime.rest_params`: DTensor parameters and their local
  views, with the gradient reduction a layout needs;
* :mod:`~tplower.runtime.uneven`: global sizes of sharded activations, exchanged or checked;
* :mod:`~tplower.runtime.fanout`: siblings that read one tensor share its move;
* :mod:`~tplower.runtime.overlap`: a column-parallel linear run as one node, its input gradient's all_reduce
  overlapping the weight gradient (``parallelize(..., overlap=True)``);
* :mod:`~tplower.runtime.experts`: expert parallelism's dispatch and combine around the experts' compute;
* :mod:`~tplower.runtime.dropout`: dropout streams of sharded and replicated regions;
* :mod:`~tplower.runtime.interned`: equal per-call layouts shared (fewer guards under ``torch.compile``);
* :mod:`~tplower.runtime.operators`: the bare-operator runtime (``TPOperators``).

Built on :mod:`tplower.plans`, :mod:`tplower.families` and :mod:`tplower.core`.
"""
