"""Loading the native extension ``transport._C`` (built from ``csrc/``).

The extension loads on first use, not at import: ``import transport`` works without it, and
whatever needs it raises :class:`TransportInternalError` saying how to build it. Inside
``_native`` the module is reached as :data:`_C`, which the type checker reads from the stub
``_C.pyi`` beside this file; at run time it is a stand-in that loads the extension on its first
attribute access.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .._errors import TransportInternalError

# transport._C: the extension is installed next to the package's top-level modules.
_EXTENSION = __name__.split(".")[0] + "._C"


def load() -> ModuleType:
    """The ``transport._C`` module itself (untyped; code in ``_native`` uses :data:`_C`).

    Raises:
        TransportInternalError: the extension is missing or does not load.
    """
    try:
        return importlib.import_module(_EXTENSION)
    except ImportError as exc:
        raise TransportInternalError(
            f"the native extension {_EXTENSION} did not load ({exc}); reinstall with "
            "`pip install -e .` so that csrc/ is compiled"
        ) from exc


def unavailable_reason() -> str | None:
    """None when the native extension loads, else why not."""
    try:
        load()
    except TransportInternalError as exc:
        return str(exc)
    return None


def extension_path() -> str:
    """The file of the native extension (a child process can load it without ``transport``).

    Raises:
        TransportInternalError: the extension is missing or does not load.
    """
    path = load().__file__
    if path is None:  # an extension module always has one; this is for the type checker
        raise TransportInternalError(f"{_EXTENSION} has no file")
    return path


class _Lazy:
    """Stands for the extension until it is used: the first access of each attribute loads the
    extension (raising :class:`TransportInternalError` when it is missing) and keeps that
    attribute, so later accesses are plain lookups."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # introspection (copy, pickle, inspect) must not load anything
            raise AttributeError(name)
        value = getattr(load(), name)
        setattr(self, name, value)
        return value


if TYPE_CHECKING:
    from . import _C as _C
else:
    _C = _Lazy()

__all__ = ["_C", "extension_path", "load", "unavailable_reason"]
