"""The one error type tplower raises for its own failures."""

from __future__ import annotations


class TPLowerError(ValueError):
    """A placement, plan or mesh that tplower cannot accept.

    Subclasses ``ValueError`` so callers that already catch ``ValueError``
    around placement parsing keep working. The message always names the
    argument, shows the bad value and says what is allowed.
    """


class TPLowerTypeError(TPLowerError, TypeError):
    """The debug check's error when a rank's call had an argument of the wrong type.

    Raised on every rank alike (see :mod:`tplower.core.lower.agreement`), so it is both a
    ``TPLowerError`` (what the check raises) and a ``TypeError`` (what the
    same call raises without the check, on the rank that made it).
    """
