"""Context parallelism: the sequence split over a mesh axis, attention exchanged around the model's own kernel.

One idea: attention is the only computation of a decoder that mixes tokens, so
a sequence split over a ``cp`` axis needs two placement transitions around the
model's own attention function and nothing else. Ulysses moves
``S(seq) -> S(heads)`` before the local attention and back after it (one
``all_to_all`` each way); the all-gather mode moves the keys and values
``S(seq) -> R`` (an ``all_gather``, a ``reduce_scatter`` in backward) and keeps
the local queries. Both are tplower transitions. The masks follow each token's
global position (:mod:`tplower.context.layout`); the batch is split and made
whole by :mod:`tplower.context.sequence`; :func:`install_context`
(:mod:`tplower.context.install`) wires a transformers model as shipped.
"""

from .discover import attention_modules
from .install import ContextInstall, install_context, installed_context
from .layout import SequenceLayout
from .sequence import SPLIT_KEY, ContextSplit, gather_sequence, shard_sequence

__all__ = ["SPLIT_KEY", "ContextInstall", "ContextSplit", "SequenceLayout", "attention_modules", "gather_sequence",
           "install_context", "installed_context", "shard_sequence"]
