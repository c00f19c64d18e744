"""The module layer: plans and boundaries of ``nn.Module``s, ``parallelize``, the code generator and the verifier.

Built on :mod:`tplower.core` only:

* :mod:`~tplower.nn.plans`, :mod:`~tplower.nn.hf_plans`: plan entries and Hugging Face ``tp_plan`` styles.
* :mod:`~tplower.nn.boundaries`: boundary forms and the bare operators (``TPOperators``).
* :mod:`~tplower.nn.parallelize`, :mod:`~tplower.nn.params`, :mod:`~tplower.nn.uneven`: install a plan
  (DTensor parameters, lowered boundaries, uneven activations).
* :mod:`~tplower.nn.codegen` (with ``codegen_ops`` and ``codegen_text``): generated forwards.
* :mod:`~tplower.nn.verify` (with ``verify_record``, ``verify_compare``, ``verify_report``): a plan
  checked boundary by boundary against one process.
"""
