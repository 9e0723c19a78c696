"""Public names say where users find them (reprs, docs, pickles), not which private module
defines them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def rehome(namespace: Mapping[str, object], names: Iterable[str], module: str) -> None:
    """Sets ``__module__`` to ``module`` on each of ``names`` in ``namespace`` that a private
    module (one with an underscored part, e.g. ``transport._peers``) defines; names from public
    modules keep theirs."""
    for name in names:
        obj = namespace[name]
        if any(part.startswith("_") for part in str(getattr(obj, "__module__", "")).split(".")):
            obj.__module__ = module
