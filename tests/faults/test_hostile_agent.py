"""Hostile peers and poisoned stores against real target processes (tests/peers/hostile_target.py).

Two targets serve for the whole module: ``open`` (no token; agent caps lowered to 64 connections
and 8 waiting for HELLO, a 3 s handshake deadline, and RLIMIT_NOFILE lowered to 40 descriptors
above what it holds) and ``tok`` (a token; a 30 s handshake deadline, so a prompt close can only
be a refusal). After every attack the target must still run, and a legitimate put from a fresh
Transport (new connections) must land: the test reads the bytes back. The decoders and the
agent's limits are also tested directly, in this process, with real sockets.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import struct
import subprocess
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

import transport
from tests._support import PYTHON, ROOT, put_to_fake_agent, python_env, sha
from transport._agent import AgentServer
from transport._auth import Authenticator
from transport._channel import Channel, hello
from transport._errors import WireError
from transport._wire import (
    FRAME_HEADER,
    FRAME_MAGIC,
    MAX_META,
    MAX_RECORD_BYTES,
    PRE_AUTH_META,
    ErrCode,
    FrameKind,
    PeerRecord,
    decode_meta,
    encode_frame,
    loads_bounded,
)
from transport.backends.tcp._frames import TcpFrame

NUMEL = 1 << 16
TOKEN = "s3cret"
OPEN_MAX_CONNS, OPEN_MAX_PREAUTH, OPEN_HANDSHAKE_S, OPEN_HEADROOM = 64, 8, 3, 40


# ---------------------------------------------------------------------------------------------
# Targets


class HostileTarget:
    """A running tests/peers/hostile_target.py process (killed at the end if still alive)."""

    def __init__(self, tmp: Path, spec: dict) -> None:
        self.name, self.token = spec["name"], spec.get("token")
        self.out = str(tmp / f"{self.name}.json")
        self.log = tmp / f"{self.name}.log"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [PYTHON, "-m", "tests.peers.hostile_target", json.dumps({**spec, "out": self.out})],
                env=python_env(), cwd=ROOT, stderr=err,
            )

    def wait_ready(self, timeout: float = 90) -> dict:
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.out + ".ready"):
            assert self.proc.poll() is None, f"{self.name} died at startup:\n{self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{self.name} not ready in {timeout}s"
            time.sleep(0.05)
        return json.loads(Path(self.out + ".ready").read_text())

    def assert_alive(self) -> None:
        assert self.proc.poll() is None, f"{self.name} died ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}"

    def watch(self) -> dict:
        try:
            return json.loads(Path(self.out + ".watch").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {"rounds": 0, "outcomes": {}}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


class Env:
    def __init__(self, store_dir: Path, targets: dict[str, HostileTarget]) -> None:
        self.store_dir = store_dir
        self.store = f"file://{store_dir}"
        self.targets = targets


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    store_dir = tmp / "store"
    store = f"file://{store_dir}"
    specs = [
        {"name": "open", "store": store, "backends": ["tcp"], "numel": NUMEL, "watch": ["poisoned", "deep"],
         "nofile_headroom": OPEN_HEADROOM,
         "env": {"TRANSPORT_AGENT_MAX_CONNS": str(OPEN_MAX_CONNS), "TRANSPORT_AGENT_MAX_PREAUTH": str(OPEN_MAX_PREAUTH),
                 "TRANSPORT_AGENT_HANDSHAKE_TIMEOUT": str(OPEN_HANDSHAKE_S)}},
        {"name": "tok", "store": store, "backends": ["tcp"], "numel": NUMEL, "token": TOKEN,
         "env": {"TRANSPORT_AGENT_HANDSHAKE_TIMEOUT": "30", "TRANSPORT_AGENT_MAX_PREAUTH": "128"}},
    ]
    targets: dict[str, HostileTarget] = {}
    try:
        for spec in specs:
            targets[spec["name"]] = HostileTarget(tmp, spec)
        for t in targets.values():
            t.wait_ready()
        yield Env(store_dir, targets)
    finally:
        for t in targets.values():
            t.close()


async def legit_put(env: Env, name: str, seed: int) -> str:
    """A put from a fresh Transport (so from new connections), read back; returns its sha256."""
    target = env.targets[name]
    target.assert_alive()
    src = torch.randint(0, 256, (NUMEL,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    back = torch.zeros_like(src)
    async with transport.Transport(f"init-{uuid.uuid4().hex[:8]}", store=env.store, backends=("tcp",),
                                   token=target.token, timeout=30) as t:
        await t.peer(name, regions=["w"])
        await t.put(src, name, key="w")
        await t.get(back, name, key="w")
    assert torch.equal(back, src), f"the put to {name} did not land"
    target.assert_alive()
    return sha(src)


async def agent_of(env: Env, name: str) -> tuple[tuple[str, int], str]:
    """The target's agent address and incarnation, from its published record."""
    async with transport.Transport(f"scout-{uuid.uuid4().hex[:8]}", store=env.store, backends=("tcp",),
                                   token=env.targets[name].token, timeout=30) as t:
        peer = await t.peer(name, regions=["w"])
        return tuple(peer._record.agent), peer.incarnation  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Raw sockets (blocking, run in a worker thread)


def header(kind: int, meta_len: int, payload_len: int = 0, rid: int = 1) -> bytes:
    return FRAME_HEADER.pack(FRAME_MAGIC, kind, 0, 0, rid, meta_len, payload_len)


def closed_by_peer(s: socket.socket, timeout: float) -> bool:
    """Reads until the other end closes (True) or ``timeout`` passes with it open (False)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([s], [], [], left)[0]:
            return False
        try:
            if not s.recv(65536):
                return True
        except OSError:  # reset: closed with our bytes unread
            return True


def send_and_wait_closed(addr: tuple[str, int], data: bytes, timeout: float = 15) -> bool:
    with socket.create_connection(addr, timeout=10) as s:
        try:
            s.sendall(data)
        except OSError:
            return True  # reset while we were still sending: closed
        return closed_by_peer(s, timeout)


def hello_frame(to: str, incarnation: str, rid: int = 1, who: str = "intruder") -> bytes:
    return encode_frame(FrameKind.HELLO, rid, {**hello(who, "0" * 16, "control"), "to": to,
                                                 "to_incarnation": incarnation}, 0)


# ---------------------------------------------------------------------------------------------
# a. deeply nested frames


@pytest.mark.parametrize("name", ["open", "tok"])
async def test_deeply_nested_frames_close_only_their_connection(env, name):
    addr, inc = await agent_of(env, name)
    attacks = [
        header(FrameKind.HELLO, 100_000) + b"[" * 100_000,  # refused from the header (too long before auth)
        header(FrameKind.HELLO, PRE_AUTH_META) + b"[" * PRE_AUTH_META,  # short enough: refused by its depth
        header(FrameKind.HELLO, 8000) + b'{"a":' * 1600,
    ]
    if name == "open":  # without a token anyone gets past HELLO: the same after it, up to MAX_META
        attacks.append(hello_frame(name, inc) + header(FrameKind.SIGNAL, 100_000) + b"[" * 100_000)
        attacks.append(hello_frame(name, inc) + header(TcpFrame.PUT, MAX_META) + b"[" * MAX_META)
    for data in attacks:
        assert await anyio.to_thread.run_sync(send_and_wait_closed, addr, data), "the agent kept the connection"
        env.targets[name].assert_alive()
    await legit_put(env, name, seed=1)


# ---------------------------------------------------------------------------------------------
# b. connection floods under a lowered RLIMIT_NOFILE


def flood_idle(addr: tuple[str, int], n: int, first: bytes | Callable[[int], bytes] = b"") -> list[socket.socket]:
    """``n`` connections, each sent ``first`` (or ``first(i)``) and then left idle."""
    socks = []
    for i in range(n):
        s = socket.create_connection(addr, timeout=10)
        if data := first(i) if callable(first) else first:
            s.sendall(data)
        socks.append(s)
    return socks


def count_closed(socks: list[socket.socket], want: int, timeout: float) -> int:
    """Waits until at least ``want`` of ``socks`` were closed by the peer (or ``timeout``)."""
    closed: set[socket.socket] = set()
    deadline = time.monotonic() + timeout
    while len(closed) < want and time.monotonic() < deadline:
        ready = select.select([s for s in socks if s not in closed], [], [], 0.2)[0]
        for s in ready:
            try:
                if not s.recv(65536):
                    closed.add(s)
            except OSError:
                closed.add(s)
    return len(closed)


async def test_idle_socket_flood_does_not_lock_out_a_legit_client(env):
    """2x the connection cap of idle sockets: the agent keeps at most OPEN_MAX_PREAUTH of them
    (closing the oldest), so a legitimate client connecting after them still gets in."""
    target = env.targets["open"]
    addr, _ = await agent_of(env, "open")
    n = 2 * OPEN_MAX_CONNS
    socks = await anyio.to_thread.run_sync(flood_idle, addr, n)
    try:
        await legit_put(env, "open", seed=2)  # while they are open (the newest until the deadline)
        closed = await anyio.to_thread.run_sync(count_closed, socks, n, 30)
        assert closed == n, f"{n - closed} idle connections outlived the handshake deadline"
        assert "closing the oldest waiting one" in target.log.read_text()
    finally:
        for s in socks:
            s.close()


async def test_authenticated_flood_past_the_descriptor_limit_leaves_the_listener_alive(env):
    """Without a token anyone can say HELLO, under any name; 2x the connection cap of them (each
    under its own name: the cap per peer stops one name sooner) run the target out of descriptors
    (its limit is lower than the cap): accept fails with EMFILE, is logged, and retried; once
    they go, a legitimate client gets in."""
    target = env.targets["open"]
    addr, inc = await agent_of(env, "open")
    socks = await anyio.to_thread.run_sync(flood_idle, addr, 2 * OPEN_MAX_CONNS,
                                           lambda i: hello_frame("open", inc, who=f"intruder-{i}"))
    try:
        with anyio.fail_after(30):
            while "accept failed" not in target.log.read_text():
                target.assert_alive()
                await anyio.sleep(0.1)
        assert "Too many open files" in target.log.read_text()
        target.assert_alive()
    finally:
        for s in socks:
            s.close()
    await legit_put(env, "open", seed=3)


# ---------------------------------------------------------------------------------------------
# c. half-sent HELLOs


async def test_hello_announcing_a_large_meta_is_refused_from_its_header(env):
    """On ``tok`` the handshake deadline is 30 s: a close within the bound is the header check."""
    addr, _ = await agent_of(env, "tok")

    def attack() -> tuple[int, bool]:
        slow = socket.create_connection(addr, timeout=10)
        slow.sendall(header(FrameKind.HELLO, 100))  # a plausible HELLO, then silence
        try:
            big = flood_idle(addr, 64, header(FrameKind.HELLO, 1 << 20))
            try:
                closed = count_closed(big, 64, 10)
            finally:
                for s in big:
                    s.close()
            return closed, closed_by_peer(slow, 0.05)
        finally:
            slow.close()

    closed, slow_closed = await anyio.to_thread.run_sync(attack)
    assert closed == 64, f"only {closed} of 64 HELLOs announcing 1 MiB of metadata were refused"
    assert not slow_closed, "a HELLO in progress was closed with the refused ones"
    await legit_put(env, "tok", seed=4)


async def test_handshake_deadline_closes_silent_connections(env):
    addr, _ = await agent_of(env, "open")

    def attack() -> list[bool]:
        socks = flood_idle(addr, 2) + flood_idle(addr, 1, header(FrameKind.HELLO, 100))
        socks[1].sendall(header(FrameKind.HELLO, 100)[:10])  # a partial header
        try:
            return [closed_by_peer(s, OPEN_HANDSHAKE_S + 15) for s in socks]
        finally:
            for s in socks:
                s.close()

    assert await anyio.to_thread.run_sync(attack) == [True, True, True]
    await legit_put(env, "open", seed=5)


# ---------------------------------------------------------------------------------------------
# d. poisoned store records


def plant(env: Env, name: str, make: Callable[[Path], None]) -> Path:
    path = env.store_dir / urllib.parse.quote(f"peer/{name}", safe="")
    make(path)
    return path


def huge_sparse(path: Path) -> None:
    with open(path, "wb") as f:
        f.write(b'{"format":"transport.peer","v":1,"name":"')
        f.truncate(300 << 20)  # 300 MB that cost no disk


def deeply_nested(path: Path) -> None:
    path.write_bytes(b'{"format":"transport.peer","v":1,"regions":' + b"[" * 200_000 + b"]" * 200_000 + b"}")


async def test_poisoned_records_are_typed_errors_and_stall_nothing(env):
    target = env.targets["open"]
    planted = [plant(env, "poisoned", huge_sparse), plant(env, "deep", deeply_nested)]
    try:
        rounds = target.watch()["rounds"]
        with anyio.fail_after(60):  # the target looks both up every round
            while target.watch()["rounds"] < rounds + 3:
                target.assert_alive()
                await anyio.sleep(0.1)
        outcomes = target.watch()["outcomes"]
        assert all("Error: " in outcomes[name] for name in ("poisoned", "deep")), outcomes

        async with transport.Transport("victim", store=env.store, backends=("tcp",), timeout=30) as t:
            for name in ("poisoned", "deep"):
                with anyio.fail_after(30):
                    with pytest.raises(transport.TransportError) as info:
                        await t.peer(name, timeout=1)
                    assert await t.lookup(name) is None
                    with pytest.raises(transport.TransportError):
                        await t.put(torch.ones(4), name, key="w")
                # Refused by what it is (too large: never read; too deep: never parsed).
                assert ("too large" if name == "poisoned" else "nest") in str(info.value), info.value
        target.assert_alive()
    finally:
        for p in planted:
            p.unlink()
    await legit_put(env, "open", seed=6)


async def test_targets_survived_and_hold_the_last_put(env):
    for name in ("open", "tok"):
        digest = await legit_put(env, name, seed=7)
        async with transport.Transport("closer", store=env.store, backends=("tcp",), token=env.targets[name].token,
                                       timeout=30) as t:
            await t.signal(name, "done", 1)
        target = env.targets[name]
        with anyio.fail_after(30):
            while target.proc.poll() is None:
                await anyio.sleep(0.05)
        assert target.proc.returncode == 0, target.log.read_text()[-3000:]
        assert json.loads(Path(target.out).read_text())["sha256"] == digest


# ---------------------------------------------------------------------------------------------
# e. a hostile agent answering a client; the agent's limits in this process


def fake_agent(answer: Callable[[int], bytes]) -> tuple[socket.socket, Callable[[], None]]:
    """A listening socket whose first connection gets ``answer(rid)`` after its HELLO arrives."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)

    def serve() -> None:
        conn, _ = lsock.accept()
        with conn:
            conn.settimeout(10)
            head = conn.recv(FRAME_HEADER.size, socket.MSG_WAITALL)
            _, _, _, _, rid, meta_len, _ = FRAME_HEADER.unpack(head)
            conn.recv(meta_len, socket.MSG_WAITALL)
            try:
                conn.sendall(answer(rid))
                conn.recv(1)  # until the client hangs up
            except OSError:
                pass

    return lsock, serve


@pytest.mark.parametrize("answer", [
    lambda rid: header(FrameKind.OK, 100_000, rid=rid) + b"[" * 100_000,
    lambda rid: header(FrameKind.OK, 4 * MAX_META, rid=rid),
    lambda rid: header(FrameKind.OK, 6, rid=rid) + b"\xff\xfe[[[[",
    lambda rid: header(TcpFrame.PUT, 2, rid=rid) + b"{}",  # a request's kind where a reply is due
    lambda rid: header(77, 2, rid=rid) + b"{}",  # a kind no one declared
], ids=["nested", "oversized", "not-utf8", "request-kind", "unknown-kind"])
async def test_a_hostile_hello_reply_is_peer_lost_with_a_wire_cause(answer):
    lsock, serve = fake_agent(answer)
    with lsock:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, serve)
            with anyio.fail_after(20):
                with pytest.raises(transport.PeerLostError) as caught:
                    await Channel.open(tg, lsock.getsockname(), peer="fake", peer_incarnation="x",
                                       hello=hello("me", "i", "control"), auth=Authenticator(None))
    assert isinstance(caught.value.__cause__, WireError), repr(caught.value.__cause__)


async def test_a_mistyped_err_reply_is_a_typed_error():
    meta = json.dumps({"code": [1], "message": {"x": 1}}).encode()
    lsock, serve = fake_agent(lambda rid: header(FrameKind.ERR, len(meta), rid=rid) + meta)
    with lsock:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, serve)
            with anyio.fail_after(20):
                with pytest.raises(transport.TransportError, match="fake refused"):
                    await Channel.open(tg, lsock.getsockname(), peer="fake", peer_incarnation="x",
                                       hello=hello("me", "i", "control"), auth=Authenticator(None))


async def test_a_transport_survives_a_hostile_peer_agent(memory_store):
    """Through the whole stack: the put fails with PeerLostError, the Transport keeps working."""
    lsock, serve = fake_agent(lambda rid: header(FrameKind.OK, 100_000, rid=rid) + b"[" * 100_000)
    with lsock:
        async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=10) as a, \
                transport.Transport("b", store=memory_store, backends=("tcp",), timeout=10) as b, \
                transport.Transport("c", store=memory_store, backends=("tcp",), timeout=10) as c:
            b.register("w", torch.zeros(4))
            w = torch.zeros(4)
            c.register("w", w)
            await put_to_fake_agent(a, b, lsock.getsockname()[1], serve, timeout=20)
            await a.peer("c", regions=["w"])
            await a.put(torch.ones(4), "c", key="w")
            assert w.sum() == 4


class _Routes:
    """The agent's routes interface, with a backend request that fails unexpectedly."""

    def __init__(self) -> None:
        self.signals: list[Any] = []

    def signal(self, request: Any) -> None:
        self.signals.append(request)

    async def backend_request(self, meta: Any) -> Any:
        raise RuntimeError("a bug in a route")

    def serves(self, kind: Any, meta: Any) -> bool:
        return False

    async def frame(self, conn: Any, kind: Any, rid: int, meta: Any, payload_len: int) -> None:
        raise AssertionError("not used")

    def takes_lane(self, lane: str) -> bool:
        return False


async def test_an_unexpected_error_in_a_route_closes_only_its_connection():
    routes = _Routes()
    server = AgentServer("srv", "inc", Authenticator(None), routes)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, tg)

        async def channel() -> Channel:
            return await Channel.open(tg, server.address, peer="srv", peer_incarnation="inc",
                                      hello=hello("me", "i", "control"), auth=Authenticator(None))

        with anyio.fail_after(20):
            broken, fine = await channel(), await channel()
            with pytest.raises(transport.PeerLostError):
                await broken.request(FrameKind.BACKEND, {"backend": "x"})
            await fine.request(FrameKind.SIGNAL, {"name": "s", "value": 1})  # the other connection serves on
            await (await channel()).request(FrameKind.SIGNAL, {"name": "s", "value": 2})  # and new ones get in
        assert [s.value for s in routes.signals] == [1, 2]
        tg.cancel_scope.cancel()


class _ReleasingRoutes(_Routes):
    """Routes whose SIGNAL releases the client's channel while its reply is still to be sent
    (the client forgetting a peer that answered and then closed), and whose backend request
    never answers."""

    def __init__(self) -> None:
        super().__init__()
        self.client: Channel | None = None

    def signal(self, request: Any) -> None:
        super().signal(request)
        assert self.client is not None
        self.client.release(transport.PeerLostError("srv is gone"), grace=10)

    async def backend_request(self, meta: Any) -> Any:
        await anyio.sleep_forever()


async def test_a_reply_whose_waiter_gave_up_is_dropped_not_written():
    """A get whose wait was cancelled after its request went out (its deadline, an abort): its
    DATA, when it comes later, is read and dropped, never written into the buffer the caller
    may already reuse; the channel serves on, also once released."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    go = threading.Event()

    def serve() -> None:
        conn, _ = lsock.accept()
        with conn:
            conn.settimeout(20)

            def frame() -> int:
                _, _, _, _, rid, meta_len, _ = FRAME_HEADER.unpack(conn.recv(FRAME_HEADER.size, socket.MSG_WAITALL))
                conn.recv(meta_len, socket.MSG_WAITALL)
                return rid

            conn.sendall(encode_frame(FrameKind.OK, frame(), {}, 0))  # the HELLO
            late = frame()  # the get that will be given up on
            go.wait(20)
            conn.sendall(encode_frame(FrameKind.DATA, late, {}, 8) + b"LATEDATA")
            conn.sendall(encode_frame(FrameKind.DATA, frame(), {}, 8) + b"FRESHONE")
            conn.recv(1)  # until the client hangs up

    with lsock:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, serve)
            with anyio.fail_after(20):
                chan = await Channel.open(tg, lsock.getsockname(), peer="fake", peer_incarnation="x",
                                          hello=hello("me", "i", "control"), auth=Authenticator(None))
                buf = bytearray(8)
                with anyio.move_on_after(0.2):
                    await chan.request(TcpFrame.GET, {"k": 1}, into=memoryview(buf))
                buf[:] = b"RETRYOK!"  # the caller, told it failed, reuses the buffer
                go.set()
                other = bytearray(8)
                assert await chan.request(TcpFrame.GET, {"k": 2}, into=memoryview(other)) == {}
                assert bytes(other) == b"FRESHONE" and bytes(buf) == b"RETRYOK!"
                chan.release(transport.PeerLostError("fake is gone"))
                assert chan.broken
            tg.cancel_scope.cancel()


async def test_a_released_channel_still_takes_the_replies_on_their_way():
    """A peer forgotten (it left) while a request is in flight: the answer it sent before going
    still counts; what it never answers fails with PeerLostError after the grace period, and
    nothing new is sent."""
    routes = _ReleasingRoutes()
    server = AgentServer("srv", "inc", Authenticator(None), routes)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, tg)

        async def channel() -> Channel:
            return await Channel.open(tg, server.address, peer="srv", peer_incarnation="inc",
                                      hello=hello("me", "i", "control"), auth=Authenticator(None))

        with anyio.fail_after(20):
            routes.client = await channel()
            assert await routes.client.request(FrameKind.SIGNAL, {"name": "s", "value": 1}) == {}
            assert routes.client.broken
            with pytest.raises(transport.PeerLostError):
                await routes.client.request(FrameKind.SIGNAL, {"name": "s", "value": 2})
            assert [s.value for s in routes.signals] == [1]

            stuck = await channel()
            failed: list[BaseException] = []

            async def ask() -> None:
                try:
                    await stuck.request(FrameKind.BACKEND, {"backend": "x"})
                except transport.TransportError as exc:
                    failed.append(exc)

            tg.start_soon(ask)
            await anyio.wait_all_tasks_blocked()
            start = time.monotonic()
            stuck.release(transport.PeerLostError("srv is gone"), grace=0.3)
            while not failed:
                await anyio.sleep(0.01)
            assert isinstance(failed[0], transport.PeerLostError) and "srv is gone" in str(failed[0])
            assert time.monotonic() - start >= 0.25  # not before the grace period
        tg.cancel_scope.cancel()


async def test_connection_cap_closes_the_stalest_to_admit_a_new_one(monkeypatch, memory_store):
    """Four authenticated idle connections fill a cap of 4: a fifth is admitted, and the one
    that moved no byte for longest is closed, told first that nothing unanswered was carried
    out (an ERR of code GOING_AWAY with request id 0); the other three stay open."""
    monkeypatch.setenv("TRANSPORT_AGENT_MAX_CONNS", "4")
    async with transport.Transport("capped", store=memory_store, backends=("tcp",), timeout=10) as b:
        addr = b._agent.address
        frame = hello_frame("capped", b.incarnation)

        def reply_to_hello(s: socket.socket) -> bool:
            """Whether the agent answered our HELLO with OK (False: it closed the connection)."""
            try:
                head = s.recv(FRAME_HEADER.size, socket.MSG_WAITALL)
                s.recv(FRAME_HEADER.unpack(head)[5], socket.MSG_WAITALL)
                return FrameKind(FRAME_HEADER.unpack(head)[1]) == FrameKind.OK
            except (ConnectionResetError, struct.error):
                return False

        def read_to_end(s: socket.socket) -> bytes:
            data = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := s.recv(1 << 16):
                    data += chunk
            return data

        def attack() -> tuple[bool, bytes, int]:
            socks: list[socket.socket] = []
            try:
                for _ in range(4):  # one after the other: the first is the stalest
                    socks.extend(flood_idle(addr, 1, frame))
                    assert reply_to_hello(socks[-1])
                with flood_idle(addr, 1, frame)[0] as extra:
                    admitted = reply_to_hello(extra)
                    notice = read_to_end(socks[0])  # (the agent closed it before it answered the fifth)
                    still_open = sum(1 for s in socks[1:] if not select.select([s], [], [], 0)[0])
                return admitted, notice, still_open
            finally:
                for s in socks:
                    s.close()

        admitted, notice, still_open = await anyio.to_thread.run_sync(attack)
        assert admitted, "a fifth connection was refused although four sat idle"
        _, kind, _, _, rid, meta_len, plen = FRAME_HEADER.unpack(notice[: FRAME_HEADER.size])
        meta = json.loads(notice[FRAME_HEADER.size : FRAME_HEADER.size + meta_len])
        assert (FrameKind(kind), rid, meta["code"], plen) == (FrameKind.ERR, 0, ErrCode.GOING_AWAY, 0), notice
        assert len(notice) == FRAME_HEADER.size + meta_len
        assert still_open == 3


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "many"])
async def test_bad_agent_limits_in_the_environment_are_refused(monkeypatch, memory_store, value):
    monkeypatch.setenv("TRANSPORT_AGENT_MAX_PREAUTH", value)
    with pytest.raises(ValueError, match="TRANSPORT_AGENT_MAX_PREAUTH"):
        async with transport.Transport("limited", store=memory_store, backends=("tcp",), timeout=10):
            pass


# ---------------------------------------------------------------------------------------------
# the bounded decoder


@pytest.mark.parametrize(("doc", "depth"), [
    (b"[]", 1), (b"{}", 1), (b"1", 0), (b'"[[[["', 0), (b'{"a":[{"b":[]}]}', 4),
    (b'["\\\\", [["x"]]]', 3),  # an escaped backslash ends before the quote
    (b'["\\"[[[[", []]', 2),  # an escaped quote does not end the string
    (b'{"k\\\\\\"[{": [[1]]}', 3),
    (b'["\\u005b\\u005b", [[]]]', 3),
])
def test_loads_bounded_counts_depth_outside_strings(doc, depth):
    assert loads_bounded(doc, max_bytes=1000, max_depth=depth, what="doc") == json.loads(doc)
    if depth:
        with pytest.raises(WireError, match="deeper than"):
            loads_bounded(doc, max_bytes=1000, max_depth=depth - 1, what="doc")


def test_loads_bounded_refuses_deep_and_large_before_parsing():
    for deep in (b"[" * 100_000, b'{"a":' * 50_000, b"[" * 40 + b"]" * 40, (b"[" * 33 + b"]" * 33) * 1000):
        with pytest.raises(WireError, match="deeper than 32"):
            loads_bounded(deep, max_bytes=MAX_META, max_depth=32, what="meta")
    assert loads_bounded(b"[" * 32 + b"]" * 32, max_bytes=MAX_META, max_depth=32, what="meta") is not None
    with pytest.raises(WireError, match="exceeds the limit of 10"):
        loads_bounded(b"[1,2,3,4,5]", max_bytes=10, what="doc", max_depth=5)
    for junk in (b"\xff", b"[1,", b"", b"[" * 20, b"\xef\xbb\xbf{}", b"\x00" * 100):
        with pytest.raises(WireError):
            loads_bounded(junk, max_bytes=1000, max_depth=32, what="doc")


def test_decoders_are_bounded():
    with pytest.raises(WireError, match="deeper"):
        decode_meta(b"[" * 100_000)
    with pytest.raises(WireError, match="deeper"):
        PeerRecord.decode(b'{"format":"transport.peer","v":1,"regions":' + b"[" * 17 + b"]" * 17 + b"}")
    big = b'{"format":"transport.peer","v":1,"name":"' + b"x" * MAX_RECORD_BYTES + b'"}'
    with pytest.raises(WireError, match="exceeds"):
        PeerRecord.decode(big)


@pytest.mark.parametrize("endpoint", [b"", b"\x01" * 7, b"\x01" * 25], ids=["empty", "short", "long"])
async def test_a_malformed_ipc_endpoint_is_a_reason_not_a_crash(memory_store, endpoint):
    """A same-host peer's record whose ipc endpoint descriptor has the wrong size (another
    version, or hostile): the ipc backend says why it cannot reach the peer and reads no control
    word from it; nothing unpacks the bytes blindly (a struct.error would escape a put)."""
    import dataclasses

    from transport._tensors import MemoryKind

    async with transport.Transport("a", store=memory_store, backends=("ipc",)) as a:
        async with transport.Transport("b", store=memory_store, backends=("ipc",)) as b:
            b.empty("w", 64, torch.uint8)
            await a.peer("b", regions=["w"])
            ipc = a._backends[0]
            good = a._directory.known("b")
            assert good is not None and ipc.unreachable_reason(good, good.regions["w"], MemoryKind.CPU) is None
            bad = dataclasses.replace(good, incarnation=good.incarnation + "x",
                                      backends={**good.backends, "ipc": endpoint})
            why = ipc.unreachable_reason(bad, bad.regions["w"], MemoryKind.CPU)
            assert why is not None and "ipc endpoint descriptor has" in why, why
            assert ipc.live_seq(bad) is None
            assert ipc.cma_refusal(bad) is not None
