"""Model-family helpers: the local computes that some styles name, for layers a plain forward cannot shard.

One idea: where a model family's layer is not a plain ``nn.Linear`` (GPT-2's
transposed ``Conv1D``; BLOOM's ALiBi built for all heads outside attention),
a style names a function here as its ``local_compute``, and the function
runs the layer on the rank's local parameters. Plans refer to them by path
(``tplower.families.conv1d:conv1d_forward``); they import nothing of
tplower but its errors.

* :mod:`~tplower.families.conv1d`: transformers' ``Conv1D`` on local parameters;
* :mod:`~tplower.families.alibi`: the ALiBi rows of a rank's heads.
"""
