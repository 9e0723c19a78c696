"""The tcp direct lane (transport/_native/tcp.py, csrc/tcp_direct.cpp): single-range transfers
up to DIRECT_MAX_BYTES served by native threads on both ends, against real Transports and real
processes.

* what it moves, and that it moves small ones inside put()/get();
* a large put to a stopped target never blocks the initiator's event loop;
* a reply that takes longer (a stopped target) completes in the background, can be cancelled,
  and a target killed meanwhile is a PeerLostError;
* whatever the lane refuses takes the checked path, which reports the precise error;
* hostile bytes on an authenticated direct-lane connection: every bad request is refused or
  ends that connection only, and nothing is written outside a writable registered range;
* a region withdrawn while a request moves its bytes stays alive until the request ends.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time

import anyio
import pytest
import torch

import transport
from tests._support import serving_target, sha
from transport._auth import Authenticator
from transport._channel import greet_plain, hello
from transport._conformance import warm_sync_route
from transport._sockets import connect
from transport._transfers import SYNC_MAX_BYTES
from transport.backends.tcp import _backend as tcp_backend
from transport.backends.tcp._backend import DIRECT_LANE, DIRECT_MAX_BYTES

REQ = struct.Struct("<IBBBBQQQ")  # csrc/tcp_direct.h Request
REP = struct.Struct("<IHHQQ")  # csrc/tcp_direct.h Reply
REQ_MAGIC, REP_MAGIC = 0x31524454, 0x31414454
PUT, GET = 1, 2
OK, NO_REGION, DTYPE, BOUNDS, READ_ONLY = 0, 1, 2, 3, 4


def request(op: int, key: str, dtype: str, offset: int, nbytes: int, rid: int = 1, magic: int = REQ_MAGIC) -> bytes:
    k, d = key.encode(), dtype.encode()
    return REQ.pack(magic, op, len(k), len(d), 0, rid, offset, nbytes) + k + d


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            raise EOFError(f"closed after {len(out)} of {n} bytes")
        out += part
    return out


def reply(sock: socket.socket) -> tuple[int, int, str, int]:
    """(status, rid, message, payload bytes) of the next reply."""
    magic, status, msg_len, rid, nbytes = REP.unpack(recv_exactly(sock, REP.size))
    assert magic == REP_MAGIC
    return status, rid, recv_exactly(sock, msg_len).decode(), nbytes


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


async def direct_lane(b: transport.Transport, token: str | None = None) -> socket.socket:
    """A raw, authenticated direct-lane connection to ``b``'s agent (a blocking socket)."""
    sock = await connect(b._agent.address)
    await greet_plain(sock, peer=b.name, peer_incarnation=b.incarnation,
                      hello=hello("raw", "raw-inc", DIRECT_LANE), auth=Authenticator(token))
    sock.setblocking(True)
    sock.settimeout(10)
    return sock


def stop(pid: int) -> None:
    """SIGSTOPs ``pid`` and waits until every one of its threads is stopped."""
    os.kill(pid, signal.SIGSTOP)
    for _ in range(1000):
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(s in "Tt" for s in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"{pid} did not stop: {states}")


def lanes_of(t: transport.Transport):
    return t._backends[0]._lanes


async def serving(t: transport.Transport, targets, store: str):
    """A target process "server" serving an int64 region "w" of 64 elements to ``t`` ("init"),
    with t's direct lane to it open."""
    target = await serving_target(t, targets, store, "tcp", [{"key": "w", "dtype": "int64", "numel": 64}])
    await warm_sync_route(t, "server", key="w", src=torch.zeros(1, dtype=torch.int64))
    return target


# -- what it does -------------------------------------------------------------------------------


async def test_small_puts_and_gets_complete_while_the_targets_loop_is_blocked(targets, file_store):
    """Served by the target's native lane thread: its event loop (and so its agent, the checked
    path) sleeps throughout, yet every put and get completes. Most complete inside put() itself
    (the lane's reply comes within DIRECT_WAIT_S), but on a loaded machine a reply may come later
    and the transfer completes from the event loop, still on the lane: what is asserted is that
    they complete before the target wakes, not how fast."""
    async with transport.Transport("init", store=file_store, backends=("tcp",)) as t:
        # "sleep": the target's Python thread sleeps, so its event loop and agent cannot run;
        # its direct-lane thread serves on.
        target = targets({"name": "server", "store": file_store, "backends": ["tcp"], "initiator": "init",
                          "mode": "sleep", "sleep_on_signal": True,
                          "regions": [{"key": "w", "dtype": "int32", "numel": 4096}]})
        await t.wait_signal("ready", timeout=60)
        await t.peer("server", regions=["w"])
        await warm_sync_route(t, "server", key="w", src=torch.zeros(4, dtype=torch.int32))  # opens the lane
        await t.signal("server", "sleep", 1)
        await t.wait_signal("sleeping", timeout=30)
        await anyio.sleep(0.2)  # it is in time.sleep() now
        src = torch.arange(4096, dtype=torch.int32)
        mirror = torch.zeros(4096, dtype=torch.int32)
        for i, (lo, n) in enumerate([(0, 2), (100, 1), (4096 - 7, 7), (8, 1024), (2048, 2048)]):
            piece = src[lo : lo + n] + i
            h = t.put(piece, "server", key="w", offset=lo * 4)
            await h
            assert h.backend == "tcp", h
            mirror[lo : lo + n] = piece
            back = torch.zeros(n, dtype=torch.int32)
            await t.get(back, "server", key="w", offset=lo * 4)
            assert torch.equal(back, piece)
        ops = t.flight_record()["records"][-4:]
        assert all(o["state"] == "done" and o["backend"] == "tcp" for o in ops), ops
        target.go()
        info = await target.result()
    assert info["woke_by_go"]
    assert info["sha256"] == {"w": sha(mirror)}


async def test_a_slow_reply_completes_in_the_background_and_can_be_cancelled(targets, file_store):
    async with transport.Transport("init", store=file_store, backends=("tcp",), timeout=30) as t:
        target = await serving(t, targets, file_store)
        pid = target.proc.pid
        stop(pid)  # its lane thread cannot reply now
        try:
            h = t.put(torch.full((8,), 7, dtype=torch.int64), "server", key="w")
            assert not h.done(), "a put whose reply cannot come is still running"
            assert t._transfers._ranges, "and it holds its range for the ordering rule"
            later = t.put(torch.full((8,), 9, dtype=torch.int64), "server", key="w")
            assert not later.done()
        finally:
            os.kill(pid, signal.SIGCONT)
        with anyio.fail_after(20):
            await transport.gather(h, later)
        back = torch.zeros(8, dtype=torch.int64)
        await t.get(back, "server", key="w")
        assert torch.equal(back, torch.full((8,), 9, dtype=torch.int64)), "the later put must win"

        # Cancelled while its reply is awaited: aborted, partial (the bytes may land), and the
        # lane is given up (its stream can no longer be matched): settled, then closed, once the
        # target has ended that connection; the next transfers still work.
        await warm_sync_route(t, "server", key="w", src=torch.zeros(1, dtype=torch.int64))
        lane = lanes_of(t)["server"][1][0]
        stop(pid)
        try:
            h = t.put(torch.full((8,), 3, dtype=torch.int64), "server", key="w")
            assert not h.done()
            h.cancel()
            with anyio.fail_after(10), pytest.raises(transport.TransferAbortedError) as err:
                await h
            assert err.value.partial
            assert lane.closed or lane in t._backends[0]._settling
        finally:
            os.kill(pid, signal.SIGCONT)
        with anyio.fail_after(20):
            while not lane.closed:
                await anyio.sleep(0.01)
        await warm_sync_route(t, "server", key="w", src=torch.full((1,), 5, dtype=torch.int64))
        await t.get(back[:1], "server", key="w")
        assert int(back[0]) == 5
        await t.signal("server", "done", 1)
        assert (await target.result())["sha256"]


async def test_a_target_killed_while_its_reply_is_awaited_is_peer_lost(targets, file_store):
    async with transport.Transport("init", store=file_store, backends=("tcp",), timeout=30) as t:
        target = await serving(t, targets, file_store)
        stop(target.proc.pid)
        h = t.put(torch.ones(8, dtype=torch.int64), "server", key="w")
        assert not h.done()
        target.proc.kill()
        with anyio.fail_after(20), pytest.raises(transport.PeerLostError):
            await h


async def test_what_the_lane_refuses_takes_the_checked_path_and_its_precise_error(memory_store):
    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=10) as a, \
            transport.Transport("b", store=memory_store, backends=("tcp",), timeout=10) as b:
        w = torch.zeros(16, dtype=torch.float32)
        b.register("w", w)
        await a.peer("b", regions=["w"])
        await warm_sync_route(a, "b", key="w", src=torch.zeros(1))
        # b re-registers "w" as int32; a's record (and its direct route) still says float32.
        b.unregister("w")
        v = torch.zeros(16, dtype=torch.int32)
        b.register("w", v)
        with pytest.raises(transport.DTypeMismatchError, match="int32"):
            await a.put(torch.ones(4), "b", key="w")
        assert not v.any() and not w.any(), "nothing was written"
        # Its new record in hand, the lane carries the right dtype again.
        await warm_sync_route(a, "b", key="w", src=torch.full((2,), 6, dtype=torch.int32))
        assert v[:2].tolist() == [6, 6]


async def test_medium_puts_and_gets_go_by_the_lane_and_larger_ones_do_not(memory_store):
    """Up to DIRECT_MAX_BYTES a single-range transfer is served by the target's native lane
    threads (its served count says so); past it, by the checked path (the count stays)."""
    cap = DIRECT_MAX_BYTES // 4
    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=10) as a, \
            transport.Transport("b", store=memory_store, backends=("tcp",), timeout=10) as b:
        w = b.empty("w", cap + 1, torch.float32)
        await a.peer("b", regions=["w"])
        await warm_sync_route(a, "b", key="w", src=torch.zeros(1))
        served = b._backends[0]._direct.served
        for numel in (1 << 18, cap):  # 1 MiB, and the lane's largest
            src = torch.arange(numel, dtype=torch.float32)
            await a.put(src, "b", key="w")
            back = torch.zeros(numel)
            await a.get(back, "b", key="w")
            assert torch.equal(w[:numel], src) and torch.equal(back, src)
        assert b._backends[0]._direct.served == served + 4
        h = a.put(torch.ones(cap + 1), "b", key="w")
        assert not h.done(), "past DIRECT_MAX_BYTES a put goes the asynchronous way"
        await h
        assert torch.equal(w, torch.ones(cap + 1))
        assert b._backends[0]._direct.served == served + 4


async def test_a_lane_put_to_a_stopped_target_never_blocks_the_event_loop(targets, file_store):
    """A put far larger than the socket buffers, to a target whose lane thread is stopped:
    put() returns a running handle at once (the rest is sent from the event loop whenever the
    socket is writable), other tasks run meanwhile, and the bytes land once the target runs."""
    numel = min(DIRECT_MAX_BYTES, SYNC_MAX_BYTES) // 8  # put() itself starts it on the lane
    async with transport.Transport("init", store=file_store, backends=("tcp",), timeout=60) as t:
        target = await serving_target(t, targets, file_store, "tcp", [{"key": "w", "dtype": "int64", "numel": numel}])
        await warm_sync_route(t, "server", key="w", src=torch.zeros(1, dtype=torch.int64))
        pid = target.proc.pid
        resumed = threading.Event()
        # A guard, not a measurement: were put() to block (the old lane sent with blocking
        # writes for up to the Transport's timeout), it would return only after this fired.
        watchdog = threading.Timer(30, lambda: (resumed.set(), os.kill(pid, signal.SIGCONT)))
        stop(pid)
        watchdog.start()
        try:
            src = torch.arange(numel, dtype=torch.int64)
            h = t.put(src, "server", key="w")
            assert not resumed.is_set(), "put() returned only after the target was resumed"
            assert not h.done()
            ticks = 0
            for _ in range(20):
                await anyio.sleep(0.01)
                ticks += 1
            assert ticks == 20 and not h.done(), "the loop runs while the put waits for the stopped target"
            assert any(lane.pending for lane in lanes_of(t)["server"][1]), "a lane carries it"
        finally:
            watchdog.cancel()
            os.kill(pid, signal.SIGCONT)
        with anyio.fail_after(30):
            await h
        back = torch.zeros(numel, dtype=torch.int64)
        await t.get(back, "server", key="w")
        assert torch.equal(back, src)
        await t.signal("server", "done", 1)
        assert (await target.result())["sha256"] == {"w": sha(src)}


async def test_a_put_given_up_on_the_lane_never_lands_after_a_later_overlapping_put(targets, file_store):
    """A large put cancelled while its lane still carried it (the target stopped, its bytes in
    the sockets' buffers): the target's lane thread writes them once it runs again. A later
    overlapping put, on another lane, must land after them, not before (the later put wins)."""
    n = 1 << 20  # 8 MiB of int64
    async with transport.Transport("init", store=file_store, backends=("tcp",), timeout=60) as t:
        target = await serving_target(t, targets, file_store, "tcp", [{"key": "w", "dtype": "int64", "numel": n},
                                                                      {"key": "w2", "dtype": "int64", "numel": 8}])
        await warm_sync_route(t, "server", key="w", src=torch.zeros(1, dtype=torch.int64))
        pid = target.proc.pid
        # A second lane: one put holds the first while another asks for a lane.
        stop(pid)
        h = t.put(torch.zeros(n, dtype=torch.int64), "server", key="w")
        t.put(torch.zeros(1, dtype=torch.int64), "server", key="w2")
        await anyio.sleep(0.1)
        os.kill(pid, signal.SIGCONT)
        await h
        with anyio.fail_after(20):
            while len(lanes_of(t)["server"][1]) < 2:
                t.put(torch.zeros(1, dtype=torch.int64), "server", key="w2")
                await anyio.sleep(0.02)
        stop(pid)
        try:
            a = t.put(torch.full((n,), 111, dtype=torch.int64), "server", key="w")
            await anyio.sleep(0.3)  # its bytes fill the sockets' buffers
            a.cancel()
            with pytest.raises(transport.TransferAbortedError) as caught:
                await a
            assert caught.value.partial
            off = 6 << 20
            b = t.put(torch.full((8192,), 222, dtype=torch.int64), "server", key="w", offset=off)
        finally:
            os.kill(pid, signal.SIGCONT)
        with anyio.fail_after(60):
            await b
        await anyio.sleep(0.3)  # (were a's bytes still to come, they would have landed by now)
        back = torch.zeros(8192, dtype=torch.int64)
        await t.get(back, "server", key="w", offset=off)
        assert back.unique().tolist() == [222], "the later, completed put was overwritten by the one given up on"
        await t.signal("server", "done", 1)
        assert (await target.result())["sha256"]


async def test_a_target_at_its_lane_cap_is_not_asked_again_and_again(monkeypatch, memory_store):
    """A target serving its cap of direct-lane connections closes a new one after its HELLO:
    the initiator's first request on it breaks, and it backs off (no new lane for
    DIRECT_RETRY_S) instead of reconnecting for every put; the puts take the checked path."""
    monkeypatch.setattr(tcp_backend, "DIRECT_MAX_CONNS", 1)
    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=10) as a, \
            transport.Transport("b", store=memory_store, backends=("tcp",), timeout=10) as b:
        w = b.empty("w", 64, torch.int64)
        held = await direct_lane(b)  # takes b's only lane slot
        try:
            await a.peer("b", regions=["w"])
            accepted = []
            real = b._backends[0].adopt_lane
            monkeypatch.setattr(b._backends[0], "adopt_lane", lambda lane, sock: accepted.append(1) or real(lane, sock))
            for i in range(50):
                await a.put(torch.full((8,), i, dtype=torch.int64), "b", key="w")
                await anyio.sleep(0.005)
            assert torch.equal(w[:8], torch.full((8,), 49, dtype=torch.int64))
            assert "b" in a._backends[0]._failed, "the lane that broke unused is remembered"
            assert len(accepted) <= 2, f"{len(accepted)} direct-lane connections in 50 puts"
        finally:
            held.close()


# -- hostile bytes on an authenticated direct lane ----------------------------------------------


async def test_bad_requests_are_refused_and_write_nothing(memory_store):
    async with transport.Transport("b", store=memory_store, backends=("tcp",), timeout=5) as b:
        w = b.empty("w", 64, torch.float32)
        ro = torch.zeros(8, dtype=torch.float32)
        b.register("ro", ro, writable=False)
        sock = await direct_lane(b)
        cases = [
            ("nope", "float32", 0, 4, NO_REGION, "has no region 'nope'"),
            ("w", "int32", 0, 4, DTYPE, "the data is int32 but the region is float32"),
            ("w", "float32", 256, 4, BOUNDS, "exceeds its 256 bytes"),
            ("w", "float32", 252, 8, BOUNDS, "exceeds its 256 bytes"),
            ("w", "float32", (1 << 64) - 4, 8, BOUNDS, "exceeds"),  # offset + nbytes wraps around
            ("w", "float32", 2, 4, BOUNDS, "not a multiple of the float32 element size 4"),
            ("ro", "float32", 0, 4, READ_ONLY, "is read-only"),
        ]
        for rid, (key, dtype, offset, nbytes, status, words) in enumerate(cases, 1):
            sock.sendall(request(PUT, key, dtype, offset, nbytes, rid) + b"\xff" * min(nbytes, 64))
            got = reply(sock)
            assert got[:2] == (status, rid) and words in got[2] and got[3] == 0, (key, offset, got)
        # The stream stayed in step: a good put and a get on the same connection work.
        sock.sendall(request(PUT, "w", "float32", 4, 8, 99) + struct.pack("<ff", 1.5, 2.5))
        assert reply(sock) == (OK, 99, "", 0)
        sock.sendall(request(GET, "w", "float32", 0, 12, 100))
        assert reply(sock) == (OK, 100, "", 12)
        assert struct.unpack("<fff", recv_exactly(sock, 12)) == (0.0, 1.5, 2.5)
        assert w[3:].eq(0).all() and not ro.any()
        # A get out of bounds is refused too (nothing is sent from outside the region).
        sock.sendall(request(GET, "w", "float32", 0, 260, 101))
        assert reply(sock)[0] == BOUNDS
        sock.close()


@pytest.mark.parametrize("garbage", [
    "bad-magic", "bad-op", "empty-key", "long-dtype", "huge-refused-put",
])
async def test_malformed_requests_close_only_their_connection(memory_store, garbage):
    async with transport.Transport("b", store=memory_store, backends=("tcp",), timeout=5) as b:
        w = b.empty("w", 64, torch.float32)
        sock = await direct_lane(b)
        frame = {
            "bad-magic": request(PUT, "w", "float32", 0, 4, magic=0xDEADBEEF) + b"\x01" * 4,
            "bad-op": request(7, "w", "float32", 0, 4) + b"\x01" * 4,
            "empty-key": REQ.pack(REQ_MAGIC, PUT, 0, 7, 0, 1, 0, 4) + b"float32" + b"\x01" * 4,
            "long-dtype": REQ.pack(REQ_MAGIC, PUT, 1, 200, 0, 1, 0, 4) + b"w" + b"x" * 200,
            # refused (out of bounds) and too large to read and drop: refused, then closed
            "huge-refused-put": request(PUT, "w", "float32", 0, 1 << 40),
        }[garbage]
        sock.sendall(frame)
        if garbage == "huge-refused-put":
            assert reply(sock)[0] == BOUNDS
        assert closed_by_peer(sock)
        sock.close()
        assert not w.any()
        # Everyone else is served on: a new direct lane and a normal Transport.
        again = await direct_lane(b)
        again.sendall(request(PUT, "w", "float32", 0, 4, 5) + struct.pack("<f", 4.0))
        assert reply(again) == (OK, 5, "", 0)
        again.close()
        async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=5) as a:
            await a.put(torch.full((2,), 8.0), "b", key="w", offset=8)
        assert w[:4].tolist() == [4.0, 0.0, 8.0, 8.0]


async def test_a_stalled_request_ends_its_connection_after_the_timeout(memory_store):
    async with transport.Transport("b", store=memory_store, backends=("tcp",), timeout=1) as b:
        w = b.empty("w", 64, torch.float32)
        sock = await direct_lane(b)
        sock.sendall(request(PUT, "w", "float32", 0, 256) + b"\x01" * 100)  # and then nothing
        with anyio.fail_after(10):
            assert await anyio.to_thread.run_sync(closed_by_peer, sock)
        sock.close()
        assert w[25:].eq(0).all(), "bytes past what arrived are untouched"


async def test_a_direct_lane_needs_the_token(memory_store):
    async with transport.Transport("b", store=memory_store, backends=("tcp",), token="s3cret") as b:
        b.empty("w", 64, torch.float32)
        with pytest.raises(transport.AuthenticationError):
            await direct_lane(b, token=None)
        sock = await direct_lane(b, token="s3cret")
        sock.sendall(request(PUT, "w", "float32", 0, 4) + b"\x00" * 4)
        assert reply(sock)[0] == OK
        sock.close()


# -- regions withdrawn under a request ----------------------------------------------------------


async def test_a_region_withdrawn_mid_request_stays_alive_until_the_request_ends(memory_store):
    async with transport.Transport("b", store=memory_store, backends=("tcp",), timeout=20) as b:
        n = 1 << 20
        b.empty("w", n, torch.uint8)
        sock = await direct_lane(b)
        sock.sendall(request(PUT, "w", "uint8", 0, n) + b"\x07" * (n // 2))  # half the payload so far
        await anyio.sleep(0.2)  # checked and moving
        region = b.regions["w"]
        b.unregister("w")
        tcp = b._backends[0]  # the tcp backend's target side keeps the direct lane's mirror
        assert list(tcp._retired.values()) == [region], "its memory is kept while the request runs"
        sock.sendall(b"\x07" * (n - n // 2))
        assert reply(sock) == (OK, 1, "", 0)  # it was checked before the unregister
        assert torch.all(region.tensor == 7)
        sock.sendall(request(PUT, "w", "uint8", 0, 1) + b"\x01")
        assert reply(sock)[0] == NO_REGION  # withdrawn for every later request
        b.empty("v", 8, torch.uint8)  # any change to the table lets go of released regions
        assert not tcp._retired
        sock.close()
