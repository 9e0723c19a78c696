"""Timeout arguments: checked where the caller passes them, before anything is submitted."""

from __future__ import annotations

import math
import numbers


def seconds(value: object, what: str = "timeout") -> float:
    """``value`` as a finite number of seconds greater than zero.

    Nothing in the library waits forever, so ``inf`` is refused like ``nan``, zero, negatives
    and non-numbers. Any real number is accepted (numpy scalars included), bools are not.

    Raises:
        ValueError: anything else, saying what was given.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be a number of seconds, got {value!r} ({type(value).__name__})")
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{what} must be a finite number of seconds > 0, got {value!r}")
    return number
