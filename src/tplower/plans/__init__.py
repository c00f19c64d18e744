"""The plan language: what a plan says about a model, read without touching the model or a process group.

One idea: a plan is data. It maps module names (or globs) to Hugging Face
``tp_plan`` styles or boundary entries, and every question about it (which
entry a module gets, which form its boundary takes, how a style places a
parameter, what a derived plan would say) is answered from the plan, the
model's structure and the mesh's axis names alone:

* :mod:`~tplower.plans.entries`: plan entries, files and matching (:class:`BoundaryEntry`, :func:`load_plan`), and
  each plan value read once (:func:`~tplower.plans.entries.read_plan`); :mod:`~tplower.plans.schema`: an entry's
  fields checked and its placement text read into PyTorch's types, the only place a plan's text is parsed;
* :mod:`~tplower.plans.keys`: plan keys against a model's names, and the message for a key that names nothing;
* :mod:`~tplower.plans.styles`: transformers' style names as entries;
* :mod:`~tplower.plans.hf`: a transformers model's own plan (``"auto"``) and its parameter keys;
* :mod:`~tplower.plans.expert_layout`: the dim a style splits in an experts module's parameters;
* :mod:`~tplower.plans.forms`: boundary forms and their annotations (``tplower explain --plan``);
* :mod:`~tplower.plans.derive`, :mod:`~tplower.plans.heads`, :mod:`~tplower.plans.module_facts`: a plan
  derived from the module tree (``"derive"``).

Built on :mod:`tplower.core` and :mod:`tplower.families` only.
"""
