"""Old import paths that still work and say where the name lives now.

A module whose names moved keeps them importable for users' code by a module-level ``__getattr__``
(:func:`moved_names`), which Python calls only for a name the module does not define: the old path returns the same
object and warns with a ``FutureWarning`` naming the new path, once per calling line. A module that moved as a
whole warns when it is imported (:func:`moved_module`). Nothing in dask_lm imports an old path, so a plain
``import dask_lm`` or the CLI never warns (tests/test_moved.py).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["moved_names", "moved_module"]


def moved_names(old: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for module ``old``: each name of ``homes`` is looked up in the module it maps to,
    with a ``FutureWarning`` naming that module; any other name raises ``AttributeError`` as usual."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old}.{name} moved: import it from {home} ({old}.{name} will be removed)", FutureWarning, stacklevel=2
        )
        return getattr(importlib.import_module(home), name)

    return __getattr__


def moved_module(old: str, new: str) -> None:
    """Warn, from module ``old`` as it is imported, that its names live in ``new``."""
    warnings.warn(f"{old} moved: import from {new} ({old} will be removed)", FutureWarning, stacklevel=3)
