"""Names a module imports on first use (PEP 562's module ``__getattr__``).

The checkpoint engine imports torch (seconds); a command line that only lists a run's
versions must not pay for it. A module lists where each of its names lives, and
:func:`lazy_names` gives it the ``__getattr__`` and ``__dir__`` that import a name's home
the first time the name is used, then keep the value as an ordinary attribute.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping

__all__ = ["lazy_names"]


def lazy_names(
    module: str, homes: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``module`` (its ``__name__``), whose names
    live in the modules ``homes`` maps them to (relative to ``module``'s package)."""
    namespace = vars(sys.modules[module])
    package = namespace["__package__"]

    def getattr_(name: str) -> object:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value: object = getattr(importlib.import_module(home, package), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return getattr_, dir_
