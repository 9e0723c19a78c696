"""``python -m benchmarks.gpu_bench``: Device put/get between two processes on one GPU, next to same-
run torch copies.

The harness is :mod:`._run`; the other underscored modules are its own parts.
"""
