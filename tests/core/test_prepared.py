"""Prepared transfers (``prepare_put`` / ``prepare_get`` / ``put_many`` / ``get_many``) on every
backend: many segments, checked once, one completion, reused across versions."""

from __future__ import annotations

import anyio
import pytest
import torch

import transport


async def test_a_prepared_put_moves_every_segment_and_is_reused(pair):
    a, b = pair
    w = b.empty("w", 1 << 16, torch.float32)
    v = b.empty("v", 1000, torch.int64)
    await a.peer("b", regions=["w", "v"])
    src = torch.zeros(1 << 16, dtype=torch.float32)
    ints = torch.zeros(1000, dtype=torch.int64)
    # 64 contiguous quarters-of-a-kilobyte of `src` (coalesced into one), two strided pieces of
    # `ints` into `v`, and a slice of `src` into the other half of `w`... all views, no copies.
    items = [(src[i * 256 : (i + 1) * 256], "w", i * 1024) for i in range(64)]
    items += [(ints[:100], "v", 0), (ints[500:600], "v", 500 * 8)]
    prepared = a.prepare_put("b", items)
    assert prepared.items == 66 and prepared.segments == 3
    assert prepared.nbytes == 64 * 1024 + 2 * 800
    for version in (1, 2, 3):  # fill, start, await, repeat: the same prepared object
        src.fill_(float(version))
        ints.copy_(torch.arange(1000) * version)
        h = prepared.start()
        assert h.segments == 3 and h.nbytes == prepared.nbytes
        await h
        assert torch.all(w[: 64 * 256] == version) and torch.all(w[64 * 256 :] == 0)
        assert torch.equal(v[:100], torch.arange(100) * version)
        assert torch.equal(v[500:600], torch.arange(500, 600) * version)
        assert torch.all(v[100:500] == 0)


async def test_a_prepared_get_reads_every_segment(pair):
    a, b = pair
    w = b.empty("w", 4096, torch.int32)
    w.copy_(torch.arange(4096, dtype=torch.int32))
    await a.peer("b", regions=["w"])
    dst = torch.zeros(4096, dtype=torch.int32)
    items = [(dst[i : i + 16], "w", (4095 - i - 15) * 4) for i in range(0, 4096, 16)]  # reversed blocks
    await a.get_many("b", items)
    expect = torch.cat([torch.arange(4095 - i - 15, 4095 - i + 1, dtype=torch.int32) for i in range(0, 4096, 16)])
    assert torch.equal(dst, expect)


async def test_ten_thousand_small_segments_in_one_transfer(pair):
    a, b = pair
    n, size, stride = 10_000, 64, 128  # bytes
    region = b.empty("w", n * stride, torch.uint8)
    await a.peer("b", regions=["w"])
    src = torch.randint(0, 255, (n, size), dtype=torch.uint8)
    prepared = a.prepare_put("b", [(src[i], "w", i * stride) for i in range(n)])
    assert prepared.segments == n  # the remote side is strided: nothing to coalesce
    await prepared.start()
    got = region.view(n, stride)
    assert torch.equal(got[:, :size], src) and torch.all(got[:, size:] == 0)


async def test_remote_checks_run_at_prepare_when_the_peer_is_known(pair):
    a, b = pair
    b.empty("w", 64, torch.float32)
    b.empty("ro", 64, torch.float32, writable=False)
    await a.peer("b", regions=["w", "ro"])
    ok = torch.ones(16)
    with pytest.raises(transport.RegistrationError, match="nope"):
        a.prepare_put("b", [(ok, "w", 0), (ok, "nope", 0)])
    with pytest.raises(transport.DTypeMismatchError):
        a.prepare_put("b", [(ok.to(torch.float64), "w", 0)])
    with pytest.raises(transport.BoundsError):
        a.prepare_put("b", [(ok, "w", 200)])
    with pytest.raises(transport.ReadOnlyRegionError):
        a.prepare_put("b", [(ok, "ro", 0)])
    a.prepare_get("b", [(ok, "ro", 0)])  # reading a read-only region is fine
    with pytest.raises(transport.BoundsError, match="write bytes"):
        a.prepare_put("b", [(ok, "w", 0), (ok, "w", 32)])  # overlapping writes in one transfer
    with pytest.raises(transport.LayoutError):
        a.prepare_put("b", [(torch.ones(8, 8).t(), "w", 0)])
    with pytest.raises(TypeError):
        a.prepare_put("b", [(ok, "w", 1.5)])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        a.prepare_put("b", [])
    with pytest.raises(ValueError, match="timeout"):
        a.prepare_put("b", [(ok, "w", 0)]).start(timeout=float("nan"))


async def test_an_unknown_peer_is_checked_at_the_first_start(pair):
    a, b = pair
    b.empty("w", 64, torch.float32)
    prepared = a.prepare_put("b", [(torch.ones(8), "w", 0), (torch.ones(8), "missing", 0)])  # not looked up yet
    with pytest.raises(transport.RegistrationError, match="missing"):
        await prepared.start()


async def test_a_prepared_transfer_is_checked_again_when_the_peer_re_registers(pair):
    a, b = pair
    w = b.empty("w", 64, torch.float32)
    await a.peer("b", regions=["w"])
    prepared = a.prepare_put("b", [(torch.full((16,), 2.0), "w", 0)])
    await prepared.start()
    assert torch.all(w[:16] == 2)
    b.unregister("w")
    with anyio.fail_after(10):
        with pytest.raises(transport.RegistrationError):
            await prepared.start()
    w2 = b.empty("w", 64, torch.float32)  # registered again: the next start goes there
    await prepared.start()
    assert torch.all(w2[:16] == 2)


async def test_a_prepared_put_is_ordered_after_an_overlapping_put(pair):
    a, b = pair
    w = b.empty("w", 4096, torch.uint8)
    await a.peer("b", regions=["w"])
    batch = torch.empty(4096, dtype=torch.uint8)
    prepared = a.prepare_put("b", [(batch[:2048], "w", 0), (batch[2048:], "w", 2048)])
    single = torch.empty(4096, dtype=torch.uint8)
    for i in range(200):
        single.fill_(i % 200)
        batch.fill_(i % 200 + 1)
        await transport.gather(a.put(single, "b", key="w"), prepared.start())
        assert torch.all(w == i % 200 + 1), i


async def test_a_cancelled_prepared_transfer_reports_it(pair):
    a, b = pair
    b.empty("w", 2 << 20, torch.uint8)
    await a.peer("b", regions=["w"])
    src = torch.ones(1 << 20, dtype=torch.uint8)
    # Two segments apart (one would move as a put does, completed inside start() when small).
    h = a.prepare_put("b", [(src[: 1 << 19], "w", 0), (src[1 << 19 :], "w", 1 << 20)]).start()
    h.cancel()  # before its task ran: nothing moves
    with pytest.raises(transport.TransferAbortedError) as info:
        await h
    assert not info.value.partial


async def test_one_refused_segment_refuses_the_whole_start_and_nothing_lands(pair):
    """The peer unregistered one of the regions after the transfer was prepared: on tcp its agent
    refuses the frame (it checks every range first), elsewhere the initiator sees the new record
    before moving. Either way no byte of the start lands."""
    a, b = pair
    w = b.empty("w", 1024, torch.uint8)
    b.empty("v", 1024, torch.uint8)
    await a.peer("b", regions=["w", "v"])
    src = torch.full((1024,), 9, dtype=torch.uint8)
    prepared = a.prepare_put("b", [(src[:512], "w", 0), (src[512:], "v", 0)])
    b.unregister("v")
    with anyio.fail_after(10):
        with pytest.raises(transport.RegistrationError, match="v"):
            await prepared.start()
    assert torch.all(w == 0)


async def test_a_prepared_transfer_of_empty_tensors_is_checked_and_moves_nothing(pair):
    a, b = pair
    b.empty("w", 16, torch.float32)
    await a.peer("b", regions=["w"])
    h = a.put_many("b", [(torch.ones(0), "w", 0), (torch.ones(0), "w", 64)])
    await h
    assert h.nbytes == 0 and h.segments == 0
    with pytest.raises(transport.BoundsError):
        a.put_many("b", [(torch.ones(0), "w", 68)])
