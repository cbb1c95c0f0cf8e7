"""Deprecated alias of :mod:`attnlab.capture` (renamed: ``attnlab.inspect`` shadowed the standard library's
``inspect``). Importing it, or reading any name from it, warns with DeprecationWarning and gives
``attnlab.capture``'s object; it will be removed in a later release.

    from attnlab.capture import capture      # instead of: from attnlab.inspect import capture
"""
from __future__ import annotations

import warnings

from . import capture as _capture

__all__ = list(_capture.__all__)

_MESSAGE = "attnlab.inspect is deprecated; use attnlab.capture (same names: {})"

warnings.warn(_MESSAGE.format("from attnlab.capture import ..."), DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    # module-level __getattr__ runs for every name not defined here, so each use warns, not only the first import
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        value = getattr(_capture, name)
    except AttributeError:
        raise AttributeError(f"module 'attnlab.inspect' has no attribute {name!r} (it is a deprecated alias of "
                             "attnlab.capture)") from None
    warnings.warn(_MESSAGE.format(f"attnlab.capture.{name}"), DeprecationWarning, stacklevel=2)
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
