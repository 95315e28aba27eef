"""Old import paths that keep working for one release, with a ``DeprecationWarning``.

A module whose names moved calls :func:`moved_names` and assigns the result to its module-level
``__getattr__`` (PEP 562): the old path then imports the new home on first use and warns.
The new homes are named as strings, so the deprecated path adds no import edge (and no cycle).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable, Mapping


def moved_names(old_module: str, new_homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving ``old_module.<name>`` from ``new_homes[name]``, with a warning."""

    def __getattr__(name: str) -> Any:
        if name not in new_homes:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        warnings.warn(
            f"{old_module}.{name} moved to {new_homes[name]}.{name}; the old path will be removed in "
            f"the next release: import it from {new_homes[name]}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new_homes[name]), name)

    return __getattr__
