"""Prepared transfers of CUDA memory over ``ipc``, between two real processes on one GPU.

A prepared batch's device-to-device segments are enqueued together on the transport's CUDA
stream and waited for once: from ``KERNEL_MIN_COPIES`` segments on by one launch of the
batched copy kernel, below that by one ``cuMemcpyAsync`` each. Both are checked against the
target's own checksum of its memory (tests/cuda_peer.py) and by reading every segment back:
odd offsets and lengths, zero-length segments, local views that overlap, the region's end, a
segment list over two regions, and the same prepared transfer started again.

Every test needs a CUDA GPU and skips without one. Run them with ``pytest -m gpu``.
"""

from __future__ import annotations

import random

import pytest
import torch

from transport._cuda import KERNEL_MIN_COPIES

from .cuda_peer import digest
from .test_cuda import Checker, cuda_region, opened, random_bytes, same_bytes
from .test_cuda import peers as peers  # the fixture
from .test_cuda import pytestmark as pytestmark  # gpu, skipped without one, 180 s each

MiB = 1 << 20


def disjoint_ranges(rng: random.Random, nbytes: int, count: int) -> list[tuple[int, int]]:
    """``count`` disjoint (offset, length) ranges covering ``[0, nbytes)`` in order, some empty,
    the last one ending at ``nbytes``."""
    cuts = sorted(rng.sample(range(1, nbytes), count - 1))
    cuts[len(cuts) // 2] = cuts[len(cuts) // 2 - 1]  # one empty range
    bounds = [0, *cuts, nbytes]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(count)]


@pytest.mark.parametrize("count", [5, 300], ids=["memcpy-list", "kernel"])
async def test_prepared_device_batches_move_every_segment(peers, file_store, count):
    assert (count >= KERNEL_MIN_COPIES) == (count == 300)
    n = 4 * MiB + 77
    rng = random.Random(count)
    async with opened(file_store) as t:
        p = peers({"name": "batch", "regions": [cuda_region("a", "uint8", n, fill=0x11),
                                                 cuda_region("b", "uint8", n, fill=0x22)]})
        await p.ready(t, ["a", "b"])
        check = Checker(t)
        src = random_bytes(n, torch.uint8, seed=count)
        expect = {"a": torch.full((n,), 0x11, dtype=torch.uint8, device="cuda"),
                  "b": torch.full((n,), 0x22, dtype=torch.uint8, device="cuda")}
        items, where = [], []
        for key in ("a", "b"):
            for off, length in disjoint_ranges(rng, n, count):
                lo = rng.randrange(0, n - length + 1)  # local views overlap one another
                items.append((src[lo : lo + length], key, off))
                where.append((key, off, length))
                expect[key][off : off + length] = src[lo : lo + length]
        put = t.prepare_put("batch", items)
        assert put.segments == len(items) and put.nbytes == 2 * n
        for _ in range(2):  # prepared once, started twice: the same bytes land
            h = put.start()
            await h
            assert h.backend == "ipc"
        seen = await check.digests("batch", ["a", "b"])
        assert seen == {k: digest(v) for k, v in expect.items()}, "the target's memory differs from the batch"
        back = torch.zeros(2 * n, dtype=torch.uint8, device="cuda")
        views, pos = [], 0
        for key, off, length in where:
            views.append((back[pos : pos + length], key, off))
            pos += length
        await t.prepare_get("batch", views).start()
        want = torch.cat([expect[key][off : off + length] for key, off, length in where])
        assert same_bytes(back, want), "a prepared get of device segments returned other bytes"
        await p.result(t)
