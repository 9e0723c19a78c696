"""The status-quo baseline: ``torch.distributed.broadcast`` from the trainer (rank 0).

Two variants, as RL stacks ship them today:

* **per parameter**: one ``broadcast`` per tensor, straight into the generator's live tensor
  (the most favourable form of the per-parameter scheme: no receive buffer, no extra copy);
* **bucketed**: tensors are packed into buckets of at most ``bucket_bytes`` (a tensor larger
  than that is a bucket of its own), each bucket is broadcast as one flat byte buffer and
  unpacked into the live tensors. The buffer is allocated and touched once and reused for every
  bucket and version (cheaper than ``torch._utils._flatten_dense_tensors``, which allocates a
  fresh, never-touched tensor per bucket), so this baseline is as strong as it reasonably gets.

Both are synchronous collectives: every rank must call them, in the same order, and each call
returns on a rank only once that rank's part of the collective is done. Their waits are bounded
by the process group's timeout.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


class Baseline(enum.Enum):
    """A broadcast variant; the value is its label in tables and JSON."""

    PER_PARAM = "broadcast/param"
    BUCKETED = "broadcast/bucketed"


@dataclass(frozen=True)
class Slice:
    """One tensor's place in a bucket: ``nbytes`` bytes at byte ``offset``."""

    index: int  # position in the tensor list
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    slices: tuple[Slice, ...]
    nbytes: int


def plan_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """Groups consecutive tensors into buckets of at most ``bucket_bytes`` (8-byte aligned).

    Raises:
        ValueError: ``bucket_bytes`` is not positive.
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be > 0")
    buckets: list[Bucket] = []
    current: list[Slice] = []
    pos = 0
    for i, t in enumerate(tensors):
        n = t.numel() * t.element_size()
        if current and pos + n > bucket_bytes:
            buckets.append(Bucket(tuple(current), pos))
            current, pos = [], 0
        current.append(Slice(i, pos, n))
        pos += (n + 7) // 8 * 8
    if current:
        buckets.append(Bucket(tuple(current), pos))
    return buckets


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


class BucketedBroadcast:
    """Bucketed broadcast of a fixed list of contiguous tensors from rank 0.

    Args:
        tensors: the live tensors (the same shapes and order on every rank).
        bucket_bytes: target bucket size.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], bucket_bytes: int) -> None:
        self.tensors = list(tensors)
        self.buckets = plan_buckets(self.tensors, bucket_bytes)
        self.buffer = torch.zeros(max(b.nbytes for b in self.buckets), dtype=torch.uint8)  # touched once

    def __call__(self, rank: int) -> None:
        """Runs one broadcast of every tensor (rank 0 sends, every other rank receives in place)."""
        for bucket in self.buckets:
            flat = self.buffer[: bucket.nbytes]
            if rank == 0:
                for s in bucket.slices:
                    flat[s.offset : s.offset + s.nbytes].copy_(_bytes_of(self.tensors[s.index]))
            dist.broadcast(flat, src=0)
            if rank != 0:
                for s in bucket.slices:
                    _bytes_of(self.tensors[s.index]).copy_(flat[s.offset : s.offset + s.nbytes])


def broadcast_per_param(tensors: Sequence[torch.Tensor]) -> None:
    """One ``broadcast`` per tensor from rank 0, in place on every rank."""
    for t in tensors:
        dist.broadcast(t, src=0)
