"""The verifier: a plan run on the user's own model against one process, boundary by boundary, both ways.

One idea: every boundary :func:`tplower.parallelize` installs is a claim (these inputs arrive so, these
outputs leave so, these gradients come back so), and each claim can be checked where it is made, by
reading the local tensors back to global values and comparing them with the same points of the same model
in one process; the first boundary that diverges is where the plan is wrong. Built on :mod:`tplower.nn`
and :mod:`tplower.core`; the module layer never imports it (the layer contract in ``pyproject.toml``).

* :mod:`~tplower.verification.verifier`: :func:`verify` (``tplower.verify``), the driver.
* :mod:`~tplower.verification.record`: hooks recording each boundary's inputs, outputs and gradients.
* :mod:`~tplower.verification.compare`: local tensors read back by their placements, compared, causes named.
* :mod:`~tplower.verification.checks`: the checks, point by point, folded into verdicts.
* :mod:`~tplower.verification.report`: :class:`VerifyReport` and its table.
* :mod:`~tplower.verification.derived`: a derived plan (``"derive"``) verified before it is used.

``tplower.verify`` is the function; this package's modules are its attributes, imported on first use
(``tplower.verification.derived.verify_derived``), or import them by name
(``from tplower.verification.derived import verify_derived``).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import TYPE_CHECKING

from .report import BoundaryVerdict, Check, VerifyReport
from .verifier import DEFAULT_TOLERANCES, verify

__all__ = ["DEFAULT_TOLERANCES", "BoundaryVerdict", "Check", "VerifyReport", "verify"]


if TYPE_CHECKING:  # type checkers see the named modules; any other attribute stays an error for them
    from . import derived as derived  # the attribute, imported on first use at run time
else:

    def __getattr__(name: str) -> ModuleType:
        """A module of this package named as an attribute (``tplower.verification.derived``), imported on first use.

        Raises:
            AttributeError: ``name`` is neither a name of the package nor one of its modules.
        """
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
