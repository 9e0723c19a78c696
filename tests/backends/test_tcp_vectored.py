"""The tcp backend's vectored frames (PUTR / GETR: a prepared transfer's runs).

* The socket helpers that move a frame's payload of many views with a few ``sendmsg`` /
  ``recvmsg_into`` calls, over a real socket pair whose small buffers force partial calls:
  zero-length views, more views than one call takes (IOV_MAX), views larger than one call's
  byte budget, and a peer that closes mid-payload.
* The target checks a frame's runs in bulk (each group's region once for its span, then bounds
  and alignment per run): an authenticated peer sends crafted run tables through the tcp
  backend's own channel, and a bad run anywhere after good ones refuses the whole frame with a
  typed error, nothing written.
"""

from __future__ import annotations

import random
import socket

import anyio
import numpy as np
import pytest
import torch

import transport
from transport._sockets import _IO_CHUNK, _IOV_MAX, recv_into_views, send_all_views
from transport.backends.tcp._frames import TcpFrame


def socket_pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    for s in (a, b):
        s.setblocking(False)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
    return a, b


def views_of(buf: bytearray, sizes: list[int]) -> list[memoryview]:
    out, pos, whole = [], 0, memoryview(buf)
    for n in sizes:
        out.append(whole[pos : pos + n])
        pos += n
    return out


async def test_many_views_cross_a_socket_in_order_whatever_the_calls_return():
    rng = random.Random(1)
    sizes = [rng.choice([0, 0, 1, 7, 512, 4096, 9000]) for _ in range(3 * _IOV_MAX + 5)]
    sizes[10] = _IO_CHUNK + 12345  # one view past a call's byte budget
    src = bytearray(rng.randbytes(sum(sizes)))
    dst = bytearray(len(src))
    # The receiver's views are cut differently from the sender's: the stream has no boundaries.
    rsizes = sorted(rng.sample(range(1, len(src)), 2000))
    rsizes = [b - a for a, b in zip([0, *rsizes], [*rsizes, len(src)], strict=True)]
    rsizes[5:5] = [0, 0]
    a, b = socket_pair()
    with a, b, anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(send_all_views, a, views_of(src, sizes))
            await recv_into_views(b, views_of(dst, rsizes))
    assert dst == src


async def test_a_peer_closing_mid_payload_is_eof_not_a_hang():
    a, b = socket_pair()
    with b, anyio.fail_after(10):
        with a:
            a.sendall(b"x" * 100)
        dst = bytearray(300)
        with pytest.raises(EOFError, match="200 bytes outstanding"):
            await recv_into_views(b, views_of(dst, [50, 0, 150, 100]))
    assert dst[:100] == b"x" * 100


async def test_views_all_empty_take_no_call():
    a, b = socket_pair()
    with a, b, anyio.fail_after(5):
        await send_all_views(a, [memoryview(b""), memoryview(b"")])
        await recv_into_views(b, [memoryview(bytearray(0))])


@pytest.fixture
async def tcp_pair(memory_store: str):
    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=20) as a:
        async with transport.Transport("b", store=memory_store, backends=("tcp",), timeout=20) as b:
            yield a, b


async def putr(a: transport.Transport, segs: list[list[object]], payload: bytes,
               groups: list[list[object]] | None = None) -> None:
    """Sends one PUTR frame of these ``[key, dtype, offset, nbytes]`` ranges (one group per run
    of ranges of the same key and dtype, unless ``groups`` is given), as any authenticated peer
    could."""
    record = a._directory.known("b")  # the peer's record (looked up by the test before)
    assert record is not None
    if groups is None:
        groups = []
        for key, dtype, _, _ in segs:
            if groups and groups[-1][:2] == [key, dtype]:
                groups[-1][2] += 1
            else:
                groups.append([key, dtype, 1])
    table = np.array([s[2:] for s in segs], dtype="<i8").tobytes()
    backend = next(x for x in a._backends if x.name == "tcp")
    chan = await backend._pool.get(record.name, record.incarnation, record.agent)
    await chan.request(TcpFrame.PUTR, {"groups": groups, "staged": False},
                       payload=[memoryview(table), memoryview(payload)])


BAD_AFTER_GOOD = [
    ("out of bounds", [["w", "uint8", 0, 16], ["w", "uint8", 4090, 16]], None, transport.BoundsError, "exceeds"),
    ("negative offset", [["w", "uint8", 0, 16], ["w", "uint8", -16, 16]], None, transport.BoundsError, "negative"),
    ("misaligned", [["f", "float32", 0, 8], ["f", "float32", 6, 8]], None, transport.BoundsError, "aligned"),
    ("misaligned alone", [["w", "uint8", 0, 16], ["f", "float32", 6, 8]], None, transport.BoundsError, "multiple"),
    # (refused as it is decoded, before any run is checked)
    ("bool count", [["w", "uint8", 0, 16], ["w", "uint8", 16, 16]], [["w", "uint8", 1], ["w", "uint8", True]],
     transport.TransportError, "integer"),
    ("other dtype", [["w", "uint8", 0, 16], ["w", "float32", 16, 16]], None, transport.DTypeMismatchError, "float32"),
    ("read-only", [["w", "uint8", 0, 16], ["ro", "uint8", 0, 16]], None, transport.ReadOnlyRegionError, "read-only"),
    ("unknown key", [["w", "uint8", 0, 16], ["nope", "uint8", 0, 16]], None, transport.RegistrationError, "nope"),
]


@pytest.mark.parametrize(("case", "segs", "groups", "error", "match"), BAD_AFTER_GOOD,
                         ids=[c[0] for c in BAD_AFTER_GOOD])
async def test_a_bad_range_after_good_ones_refuses_the_frame(tcp_pair, case, segs, groups, error, match):
    a, b = tcp_pair
    w = b.empty("w", 4096, torch.uint8)
    f = b.empty("f", 1024, torch.float32)
    ro = b.empty("ro", 64, torch.uint8, writable=False)
    await a.peer("b", regions=["w", "f", "ro"])
    payload = bytes(range(256)) * (sum(s[3] for s in segs) // 256 + 1)
    with anyio.fail_after(10), pytest.raises(error, match=match):
        await putr(a, segs, payload[: sum(s[3] for s in segs)], groups)
    assert not w.any() and not f.any() and not ro.any(), f"{case}: a refused frame wrote bytes"
    # The connection stays in step: a good frame right after lands.
    await putr(a, [["w", "uint8", 8, 4], ["w", "uint8", 100, 2]], b"abcdef")
    assert bytes(w[8:12].tolist()) == b"abcd" and bytes(w[100:102].tolist()) == b"ef"


async def test_many_ranges_of_two_regions_land_in_one_frame(tcp_pair):
    a, b = tcp_pair
    w = b.empty("w", 1 << 16, torch.uint8)
    f = b.empty("f", 1 << 12, torch.float32)
    await a.peer("b", regions=["w", "f"])
    rng = random.Random(3)
    segs, expect_w, expect_f, payload = [], torch.zeros_like(w), torch.zeros_like(f).view(torch.uint8), bytearray()
    for i in range(3000):
        key, region = ("w", expect_w) if i % 3 else ("f", expect_f)
        n = rng.choice([0, 4, 8, 64])
        off = rng.randrange(0, (region.numel() - n) // 4 + 1) * 4
        data = rng.randbytes(n)
        segs.append([key, "uint8" if key == "w" else "float32", off, n])
        region[off : off + n] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else region[off:off]
        payload += data
    with anyio.fail_after(20):
        await putr(a, segs, bytes(payload))
    assert torch.equal(w, expect_w) and torch.equal(f.view(torch.uint8), expect_f)
