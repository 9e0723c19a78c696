"""The batch of small segments that the point-to-point and GPU benchmarks both time: many
pieces to one peer in one operation, against as many single transfers."""

from __future__ import annotations

from .sizes import KiB

BATCH_SEGMENTS = 10_000
"""Segments in the batch."""
BATCH_SEGMENT_BYTES = 4 * KiB
"""Bytes of each segment."""
BATCH_STRIDE = 8 * KiB
"""Distance between two segments in the target's region: no two are adjacent, so nothing coalesces."""
