"""The order statistics the benchmarks report (medians of timed series, latency percentiles, the
best of timed runs)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence


def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence (the mean of the middle two for an even length)."""
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sequence."""
    s = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(s)))
    return s[rank - 1]


def best_s(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``fn``, in seconds (``time.perf_counter``)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
