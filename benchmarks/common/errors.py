"""The benchmarks' one error type."""

from __future__ import annotations


class BenchError(RuntimeError):
    """The benchmark could not run or its result is not to be trusted: bad arguments, a helper
    process failed or timed out, or data arrived wrong. The message says which process and why
    (quoting the tail of its output where there is one)."""
