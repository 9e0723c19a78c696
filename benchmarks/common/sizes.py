"""Byte sizes on the command line and in tables: one syntax for every benchmark.

``parse_size("64MiB")``, ``parse_sizes("1MiB,1GiB")`` and ``format_size(1 << 20) == "1 MiB"``.
Units are binary (``M`` = ``MiB`` = 2**20 bytes).
"""

from __future__ import annotations

import re

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Parses ``"1MiB"``, ``"4M"``, ``"512KiB"``, ``"1GiB"`` or a plain byte count.

    Args:
        text: the size; units are binary (``M`` = ``MiB`` = 2**20 bytes).

    Returns:
        The size in bytes.

    Raises:
        ValueError: not a size, or not a positive whole number of bytes.
    """
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 1MiB, 64M, 1GiB or a byte count)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0 or value != int(value):
        raise ValueError(f"size must be a positive whole number of bytes, got {text!r}")
    return int(value)


def parse_sizes(text: str) -> tuple[int, ...]:
    """Parses a comma-separated list of sizes (see :func:`parse_size`).

    Args:
        text: e.g. ``"1MiB,64MiB,1GiB"``.

    Returns:
        The sizes in bytes, sorted, without duplicates.

    Raises:
        ValueError: a part is not a size, or there is no size at all.
    """
    sizes = {parse_size(part) for part in text.split(",") if part.strip()}
    if not sizes:
        raise ValueError(f"no sizes in {text!r}")
    return tuple(sorted(sizes))


def format_size(n: int) -> str:
    """``1048576`` -> ``"1 MiB"``; sizes that are not whole units are shown in bytes."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"
