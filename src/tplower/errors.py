"""The one error type tplower raises for its own failures."""

from __future__ import annotations


class TPLowerError(ValueError):
    """A placement, plan or mesh that tplower cannot accept.

    Subclasses ``ValueError`` so callers that already catch ``ValueError``
    around placement parsing keep working. The message always names the
    argument, shows the bad value and says what is allowed.
    """
