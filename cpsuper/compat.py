"""Old spellings of public arguments, kept working for one release with a DeprecationWarning.

Analyses take ``(model, dataset, <what is swept>, *, conflict_types=..., targets=...,
batch_size=..., progress=...)``. Earlier releases took some options by position or under
another name; :func:`legacy_arguments` maps such calls onto the current signature.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

__all__ = ["legacy_arguments"]

F = TypeVar("F", bound=Callable)


def legacy_arguments(positional: Sequence[str] = (), renamed: Mapping[str, str] | None = None) -> Callable[[F], F]:
    """Decorator: accept the old call forms of a function whose options became keyword-only.

    ``positional``: names of the parameters that used to follow the current positional ones, in
    their old order (extra positional arguments are bound to them). ``renamed``: old keyword ->
    current keyword. Either use warns once per call site (DeprecationWarning).
    """
    renamed = dict(renamed or {})

    def wrap(fn: F) -> F:
        params = inspect.signature(fn).parameters.values()
        n_positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if len(args) > n_positional:
                extra = args[n_positional:]
                if len(extra) > len(positional):
                    raise TypeError(f"{fn.__name__}() takes {n_positional} positional arguments, got {len(args)}.")
                names = positional[: len(extra)]
                warnings.warn(
                    f"{fn.__name__}(): pass {', '.join(names)} by keyword; positional use is deprecated.",
                    DeprecationWarning,
                    stacklevel=2,
                )
                for name, value in zip(names, extra):
                    if name in kwargs:
                        raise TypeError(f"{fn.__name__}() got multiple values for argument {name!r}.")
                    kwargs[name] = value
                args = args[:n_positional]
            for old, new in renamed.items():
                if old in kwargs:
                    warnings.warn(
                        f"{fn.__name__}(): the argument {old!r} is now called {new!r}.",
                        DeprecationWarning,
                        stacklevel=2,
                    )
                    if new in kwargs:
                        raise TypeError(f"{fn.__name__}() got both {old!r} and {new!r}; pass only {new!r}.")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap
