"""Names a package exports but imports on first use (PEP 562), so importing the package loads no torch.

Used by ``tplower``, ``tplower.run`` and ``tplower.bench``: the ``tplower``
command builds its parser and prints ``--help`` without importing torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, homes: Mapping[str, str], namespace: dict[str, Any], *,
                 subpackages: bool = False) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``.

    Args:
        package: the package's ``__name__``.
        homes: public name -> the module (relative, ``".nn.parallelize"``) that defines it.
        namespace: the package's ``globals()``; a name is stored there once imported.
        subpackages: also import ``package.<name>`` for any other name (``tplower.codegen``
            after a bare ``import tplower``).

    Returns:
        ``(__getattr__, __dir__)``; ``__getattr__`` raises ``AttributeError`` for a name that is neither.
    """

    def getattr_(name: str) -> Any:
        home = homes.get(name)
        if home is not None:
            value = getattr(importlib.import_module(home, package), name)
        elif subpackages and not name.startswith("__"):
            try:
                value = importlib.import_module(f".{name}", package)
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return getattr_, dir_
