"""The benchmarks' one error type."""

from __future__ import annotations


class BenchError(RuntimeError):
    """The benchmark could not run (bad arguments, a helper process failed, wrong data)."""
