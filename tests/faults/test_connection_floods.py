"""Floods of authenticated connections: a legitimate peer is always served.

A token holder (or anyone, where no token is set) can say a valid HELLO under as many names as
it likes, so the cap per peer name cannot stop it from filling the agent. The agent makes room
instead: the connection that moved no byte for longest is closed (and told so first, when it sat
between frames, so that its peer may send an unanswered request again elsewhere), and watch
connections, which are never closed that way, may take half the slots at most. Each scenario runs
against a real target process (tests/peers/hostile_target.py, with a token) flooded from this
process's sockets; a legitimate Transport then looks the target up, puts 64 KiB and reads them
back. Before the agent made room, each legitimate put failed (``PeerLostError: ... connection
closed with 28 bytes outstanding``, or no answer to its HELLO at all).
"""

from __future__ import annotations

import json
import socket
import threading
import uuid

import anyio
import anyio.to_thread
import pytest
import torch

import transport
from tests.peers import resource_probe as probe
from tests.peers.resource_probe import TOKEN
from transport._auth import Authenticator
from transport._channel import ChannelPool, hello
from transport._wire import FRAME_HEADER, ErrCode, FrameKind, encode_frame

CAP = 48


@pytest.fixture
def target(tmp_path, request):
    """A target process with a token; ``request.param``: its keyword arguments (env, ...)."""
    t = probe.Target(tmp_path, f"file://{tmp_path / 'store'}", token=TOKEN, **request.param)
    try:
        yield t
    finally:
        t.close()


def flood(addr: tuple[str, int], to: str, incarnation: str, n: int, lane: str = "control",
          wait: bool = True) -> tuple[list[socket.socket], int]:
    """``n`` connections that say a valid HELLO, each under its own name (so the cap per peer
    does not stop them), then idle; with ``wait``, each HELLO's answer is read first (refused
    ones are counted and closed). Returns the sockets and how many were refused."""
    socks, refused = [], 0
    for i in range(n):
        if not wait:
            s = socket.create_connection(addr, timeout=10)
            s.sendall(probe.hello_frame(to, incarnation, f"flood-{i}", TOKEN, lane))
            socks.append(s)
            continue
        try:
            socks.append(probe.greeted(addr, to, incarnation, f"flood-{i}", TOKEN, lane))
        except ConnectionError:
            refused += 1
    return socks, refused


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


@pytest.mark.parametrize("target", [{"env": {"TRANSPORT_AGENT_MAX_CONNS": str(CAP)}}], indirect=True)
async def test_idle_authenticated_connections_never_lock_out_a_legit_peer(target):
    addr, inc = await probe.agent_of(target.store, target.name, TOKEN)
    socks, refused = await anyio.to_thread.run_sync(flood, addr, target.name, inc, CAP)
    try:
        assert refused == 0
        legit = await probe.legit_put_timed(target.store, target.name, TOKEN)
        print(f"{CAP} idle authenticated connections: the legit put took {legit}")
        assert target.alive()
        assert "to make room" in target.log.read_text()
    finally:
        close_all(socks)


@pytest.mark.parametrize("target", [{"nofile_headroom": 24}], indirect=True)
async def test_a_legit_peer_gets_in_when_a_flood_runs_the_target_out_of_descriptors(target):
    """The target's descriptors run out (RLIMIT_NOFILE lowered to 24 above what it holds)
    long before its cap of connections: accept fails with EMFILE, and the agent makes room."""
    addr, inc = await probe.agent_of(target.store, target.name, TOKEN)
    socks, _ = await anyio.to_thread.run_sync(lambda: flood(addr, target.name, inc, CAP, wait=False))
    try:
        with anyio.fail_after(60):
            while "accept failed" not in target.log.read_text():
                assert target.alive(), target.log.read_text()[-3000:]
                await anyio.sleep(0.05)
        assert "Too many open files" in target.log.read_text()
        legit = await probe.legit_put_timed(target.store, target.name, TOKEN)
        print(f"out of descriptors: the legit put took {legit}")
        assert target.alive()
    finally:
        close_all(socks)


@pytest.mark.parametrize("target", [{"env": {"TRANSPORT_AGENT_MAX_CONNS": "16"}}], indirect=True)
async def test_watch_connections_take_half_the_slots_at_most(target):
    """Watch connections are never closed to make room (that would tell their peers this
    process died), so at most half the cap of them are taken; the rest are refused."""
    addr, inc = await probe.agent_of(target.store, target.name, TOKEN)
    socks, refused = await anyio.to_thread.run_sync(lambda: flood(addr, target.name, inc, 16, lane="watch"))
    try:
        assert (len(socks), refused) == (8, 8)
        await probe.legit_put_timed(target.store, target.name, TOKEN)
        assert target.alive()
    finally:
        close_all(socks)


@pytest.mark.parametrize("target", [{"env": {"TRANSPORT_AGENT_MAX_CONNS": "8"}}], indirect=True)
async def test_an_honest_channel_closed_to_make_room_is_reopened_unnoticed(target, tmp_path):
    """A legitimate Transport's channel goes idle, then a flood fills the agent and its channel
    is the one closed to make room: its next put opens a new one, and the target is not
    taken for lost."""
    t, store = target, target.store
    socks: list[socket.socket] = []
    src = torch.randint(0, 256, (probe.TARGET_NUMEL,), dtype=torch.uint8)
    try:
        async with transport.Transport(f"legit-{uuid.uuid4().hex[:6]}", store=store, backends=("tcp",), timeout=30,
                                       token=TOKEN, flight_dir=tmp_path / "flight") as a:
            peer = await a.peer(t.name, regions=["w"])
            addr, inc = tuple(peer._record.agent), peer.incarnation
            prepared = a.prepare_put(t.name, [(src[:4096], "w", 0), (src[8192:12288], "w", 8192)])
            await prepared.start()  # a PUTR on its tcp channel
            await a.signal(t.name, "n", 1)  # on its control channel
            socks, refused = await anyio.to_thread.run_sync(flood, addr, t.name, inc, 8)  # type: ignore[arg-type]
            assert refused == 0
            for i in range(3):  # the same channels' requests: each goes on a new connection
                await prepared.start()
                await a.signal(t.name, "n", 2 + i)
                back = torch.zeros(probe.TARGET_NUMEL, dtype=torch.uint8)
                await a.get(back, t.name, key="w")
                assert torch.equal(back[:4096], src[:4096]) and torch.equal(back[8192:12288], src[8192:12288])
            events = [e.get("event") for e in a.flight_record()["events"]]
            assert "peer-lost" not in events, events
        assert "to make room" in t.log.read_text()
    finally:
        close_all(socks)


# ---------------------------------------------------------------------------------------------
# the client's side of a GOING_AWAY notice, against a scripted agent


def _scripted_agent(script: list[str]) -> tuple[socket.socket, threading.Thread, list[str]]:
    """A listening socket whose i-th connection gets a HELLO's OK and then, per ``script[i]``,
    its first request answered (``"answer"``) or the agent's GOING_AWAY notice instead, and a
    close (``"go-away"``). Returns what each connection's first request was."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)
    seen: list[str] = []

    def frame_head(conn: socket.socket) -> tuple[int, int, dict, int]:
        _, kind, _, _, rid, meta_len, plen = FRAME_HEADER.unpack(conn.recv(FRAME_HEADER.size, socket.MSG_WAITALL))
        meta = json.loads(conn.recv(meta_len, socket.MSG_WAITALL) or b"{}")
        return kind, rid, meta, plen

    def serve() -> None:
        for step in script:
            conn, _ = lsock.accept()
            with conn:
                conn.settimeout(20)
                _, rid, _, _ = frame_head(conn)
                conn.sendall(encode_frame(FrameKind.OK, rid, {"incarnation": "inc"}, 0))
                kind, rid, meta, plen = frame_head(conn)
                if plen:
                    conn.recv(plen, socket.MSG_WAITALL)
                seen.append(f"{FrameKind(kind).name} {meta.get('name')}")
                if step == "answer":
                    conn.sendall(encode_frame(FrameKind.OK, rid, {}, 0))
                    conn.recv(1)  # until the client hangs up
                else:
                    conn.sendall(encode_frame(FrameKind.ERR, 0, {"code": ErrCode.GOING_AWAY, "message": "room"}, 0))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return lsock, thread, seen


async def test_a_request_the_agent_went_away_from_goes_again_on_a_new_connection():
    """The agent reads a request, then says GOING_AWAY (it carried out nothing unanswered) and
    closes: the request is sent again on a new connection and answered there; the pool then
    holds that connection."""
    lsock, thread, seen = _scripted_agent(["go-away", "answer"])
    with lsock:
        async with anyio.create_task_group() as tg:
            pool = ChannelPool(tg, hello("client", "c" * 16, "control"), Authenticator(None))
            with anyio.fail_after(30):
                chan = await pool.get("agent", "inc", lsock.getsockname())
                assert await chan.request(FrameKind.SIGNAL, {"name": "s", "value": 1}) == {}
                heir = await pool.get("agent", "inc", lsock.getsockname())
            assert heir is not chan and not heir.broken
            assert seen == ["SIGNAL s", "SIGNAL s"]
            pool.close()
        await anyio.to_thread.run_sync(thread.join, 10)
