"""Old spellings of names that left the toy modules, kept working for one release.

The toys' figures moved to :mod:`cpsuper.plots.toys` (so that the toys import no plotting library)
and ``associative_memory.low_rank`` became :func:`cpsuper.truncation.low_rank_approx`. Each old
spelling warns (``DeprecationWarning``) and imports its new home only when used. This module goes
away, with the old spellings, in the next release.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["moved_names", "moved_plot"]


def moved_names(module: str, moved: Mapping[str, tuple[str, str]]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for names that moved: ``moved[old] = (new_module, new_name)``.

    Each access warns (``DeprecationWarning``) and imports the new home only then, so that
    importing a toy module does not import the plotting code. The old names go away in the
    release after this one.
    """

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return _moved(f"{module}.{name}", *moved[name])

    return __getattr__


def moved_plot(old: str, plot: str, *args: Any) -> Any:
    """``cpsuper.plots.toys.<plot>(*args)`` on behalf of the deprecated method ``old`` (a toy's
    ``.plot()``), with a ``DeprecationWarning``."""
    return _moved(old, "cpsuper.plots.toys", plot, stacklevel=4)(*args)


def _moved(old: str, new_module: str, new_name: str, stacklevel: int = 3) -> Any:
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new_module}.{new_name}.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return getattr(importlib.import_module(new_module), new_name)
