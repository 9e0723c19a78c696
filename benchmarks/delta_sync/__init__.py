"""``python -m benchmarks.delta_sync``: Delta sync against dense, on real training updates.

The harness is :mod:`._run`; the other underscored modules are its own parts.
"""
