"""State in and out: a parallelized model's weights read from and written to whole tensors and checkpoints.

One idea: outside the model, state is whole (a safetensors folder, a
``save_pretrained`` directory, one process's ``state_dict``) or DCP's boxes;
inside it, every parameter is a DTensor holding this rank's pieces. These
modules translate between the two, collectively where a whole tensor must be
gathered, and never change how the model runs:

* :mod:`~tplower.state.full_state`: whole state dicts, ``load_state_dict`` of whole tensors,
  ``save_pretrained`` from rank 0;
* :mod:`~tplower.state.loading`: each rank reads its own slices of a safetensors folder;
* :mod:`~tplower.state.packed_checkpoint`: DCP of packed parameters, one box per part.

Built on :mod:`tplower.core`; adapters (:mod:`tplower.adapters`) build on it, never the other way.
"""
