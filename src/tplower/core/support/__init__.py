"""The process's housekeeping, below every other room: errors, argument checks, words, and a clean exit.

* :mod:`~tplower.core.support.errors`: :class:`TPLowerError` and :class:`TPLowerTypeError`.
* :mod:`~tplower.core.support.argcheck`: argument checks that name the argument, the bad value and what is allowed.
* :mod:`~tplower.core.support.words`: counted nouns in messages.
* :mod:`~tplower.core.support.teardown`: dropping every reference to destroyed process groups, so a process exits
  cleanly.
"""
