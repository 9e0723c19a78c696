"""Prepared transfers of CUDA memory over ``ipc``, between two real processes on one GPU.

A prepared batch's device-to-device segments are enqueued together on the transport's CUDA
stream and waited for once: from ``KERNEL_MIN_COPIES`` segments on by one launch of the
batched copy kernel, below that by one ``cuMemcpyAsync`` each. Both are checked against the
target's own checksum of its memory (tests/peers/cuda_peer.py) and by reading every segment back:
odd offsets and lengths, zero-length segments, local views that overlap, the region's end, a
segment list over two regions, and the same prepared transfer started again.

Every test needs a CUDA GPU and skips without one. Run them with ``pytest -m gpu``.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.gpu._support import CUDA_MARKS, Checker, MiB, cuda_region, opened, random_bytes, same_bytes
from tests.peers.cuda_peer import digest
from transport._cuda_copier import KERNEL_MIN_COPIES

pytestmark = CUDA_MARKS  # gpu, skipped without one, 180 s each


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
        # (empty items are dropped; the others are not adjacent both here and there: none coalesce)
        assert put.segments == sum(1 for *_, length in where if length) and put.nbytes == 2 * n
        for _ in range(2):  # prepared once, started twice: the same bytes land
            h = put.start()
            await h
            assert h.backend == "ipc"
        seen = await check.digests("batch", ["a", "b"])
        assert seen == {k: digest(v) for k, v in expect.items()}, "the target's memory differs from the batch"
        # Read back into local views one byte apart, so that the get's segments do not coalesce
        # either (and the get takes the same path: the kernel, or the list).
        back = torch.zeros(2 * n + len(where), dtype=torch.uint8, device="cuda")
        views, pos = [], 0
        for key, off, length in where:
            views.append((back[pos : pos + length], key, off))
            pos += length + 1
        get = t.prepare_get("batch", views)
        assert get.segments == put.segments
        await get.start()
        for (local, key, off), (_, _, length) in zip(views, where, strict=True):
            assert same_bytes(local, expect[key][off : off + length]), f"a prepared get read other bytes at {key}:{off}"
        await p.result(t)


async def test_a_prepared_device_batch_waits_for_the_stream_current_at_start(peers, file_store):
    # The work a start must see is what was queued on the current stream when start() was
    # called, even when the transfer runs after the caller has left that stream.
    n, count = 1 * MiB, 64
    async with opened(file_store) as t:
        p = peers({"name": "order", "regions": [cuda_region("w", "uint8", n)]})
        await p.ready(t, ["w"])
        check = Checker(t)
        src = torch.zeros(n, dtype=torch.uint8, device="cuda")
        piece = n // count
        put = t.prepare_put("order", [(src[i * piece : (i + 1) * piece - 1], "w", i * piece) for i in range(count)])
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # a long kernel first (~0.1 s): the fill lands late
            src.fill_(7)
            h = put.start()
        await h  # after leaving the side stream
        want = torch.zeros(n, dtype=torch.uint8, device="cuda")
        for i in range(count):
            want[i * piece : (i + 1) * piece - 1] = 7
        seen = await check.digests("order", ["w"])
        assert seen["w"] == digest(want), "the batch copied before the work queued at start() had run"
        await p.result(t)
