"""What stalled, idle, name-flooding and departing peers may cost: bounded.

The memory scenarios run tests/peers/resource_probe.py's attacks against real target processes and
read the target's resident memory from ``/proc`` (before the bounds, 100 stalled connections
cost +400 MiB, 100 announced metadata frames +100 MiB, 2000 16 KiB signal names +31 MiB, and
100 departed peers kept 25 MiB of shared memory and 200 mappings). The limits on connections
run against a real agent in this process with real sockets.
"""

from __future__ import annotations

import socket
import uuid

import anyio
import anyio.to_thread
import pytest
import torch

import transport
from tests.peers import resource_probe as probe
from transport import _signals
from transport._wire import FRAME_HEADER, FrameKind, encode_frame
from transport.backends.tcp._frames import TcpFrame


@pytest.fixture
def target(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    t = probe.Target(tmp_path, store)
    try:
        addr, incarnation = anyio.run(probe.agent_of, store, t.name)
        yield t, addr, incarnation
    finally:
        t.close()


def grew(doc: dict) -> float:
    return doc["after"]["VmRSS"] - doc["before"]["VmRSS"]


async def legit_put(store: str, name: str) -> None:
    src = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint8)
    back = torch.zeros_like(src)
    async with transport.Transport(f"legit-{uuid.uuid4().hex[:6]}", store=store, backends=("tcp",), timeout=20) as t:
        await t.put(src, name, key="w")
        await t.get(back, name, key="w")
    assert torch.equal(back, src)


def test_stalled_payloads_cost_no_buffer_each(target):
    t, addr, inc = target
    doc = probe.stalled(addr, t.name, inc, 100, t.pid)
    assert doc["refused"] == 0 and t.alive()
    assert grew(doc) < 48, f"100 connections stalled in a refused payload cost {grew(doc):.0f} MiB"
    anyio.run(legit_put, t.store, t.name)


def test_announced_metadata_costs_what_arrived(target):
    t, addr, inc = target
    doc = probe.meta_stall(addr, t.name, inc, 100, t.pid)
    assert doc["refused"] == 0 and t.alive()
    assert grew(doc) < 32, f"100 connections announcing 1 MiB of metadata cost {grew(doc):.0f} MiB"


def test_long_signal_names_are_refused_and_cost_nothing(target):
    t, addr, inc = target
    doc = probe.signal_flood(addr, t.name, inc, 2000, t.pid)
    assert doc["answers"] == {"ERR": 2000}
    assert grew(doc) < 16, f"2000 refused 16 KiB signal names cost {grew(doc):.0f} MiB"


def test_departed_peers_are_forgotten(tmp_path):
    doc = probe.run("departed", 100, tmp_path)
    assert doc["records"] == 0 and doc["mappings"] == 0, doc
    assert doc["after"]["RssShmem"] - doc["before"]["RssShmem"] < 4, doc


# ---------------------------------------------------------------------------------------------
# The signal table and the connection limits, in this process


async def test_the_signal_table_keeps_the_newest_and_the_awaited(monkeypatch, memory_store):
    monkeypatch.setattr(_signals, "MAX_SIGNALS", 50)
    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=10) as a, \
            transport.Transport("b", store=memory_store, backends=("tcp",), timeout=10) as b:
        got: list[int] = []
        async with anyio.create_task_group() as tg:
            async def waiter() -> None:
                got.append(await b.wait_signal("awaited", 2, timeout=20))
            tg.start_soon(waiter)
            await a.signal("b", "awaited", 1)
            for i in range(120):
                await a.signal("b", f"s{i}", i)
            assert b.signal_value("awaited") == 1  # kept while someone waits for it
            await a.signal("b", "awaited", 2)
        assert got == [2]
        assert b.signal_value("s119") == 119 and b.signal_value("s0") is None
        assert len(b._signals._values) <= 50
        with pytest.raises(ValueError, match="signal name"):
            await a.signal("b", "x" * 257, 1)


def hello_from(addr: tuple[str, int], to: str, incarnation: str, who: str, lane: str = "control") -> tuple[
        socket.socket, FrameKind]:
    s = socket.create_connection(addr, timeout=10)
    s.sendall(encode_frame(FrameKind.HELLO, 1, {"from": who, "from_incarnation": "0" * 16, "lane": lane, "to": to,
                                                 "to_incarnation": incarnation}, 0))
    _, kind, _, _, _, meta_len, plen = FRAME_HEADER.unpack(s.recv(FRAME_HEADER.size, socket.MSG_WAITALL))
    s.recv(meta_len + plen, socket.MSG_WAITALL)
    return s, FrameKind(kind)


def closed_within(s: socket.socket, timeout: float) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


async def test_one_peer_cannot_take_every_connection(monkeypatch, memory_store):
    monkeypatch.setenv("TRANSPORT_AGENT_MAX_CONNS", "8")
    monkeypatch.setenv("TRANSPORT_AGENT_MAX_CONNS_PER_PEER", "3")
    async with transport.Transport("capped", store=memory_store, backends=("tcp",), timeout=10) as b:
        addr, inc = b._agent.address, b.incarnation

        def attack() -> tuple[list[FrameKind], FrameKind]:
            socks, kinds = [], []
            try:
                for _ in range(5):
                    s, kind = hello_from(addr, "capped", inc, "hog")
                    socks.append(s)
                    kinds.append(kind)
                s, other = hello_from(addr, "capped", inc, "someone-else")
                socks.append(s)
                return kinds, other
            finally:
                for s in socks:
                    s.close()

        kinds, other = await anyio.to_thread.run_sync(attack)
        assert kinds == [FrameKind.OK] * 3 + [FrameKind.ERR] * 2
        assert other == FrameKind.OK


async def test_idle_connections_time_out_and_clients_never_notice(monkeypatch, memory_store):
    monkeypatch.setenv("TRANSPORT_AGENT_IDLE_TIMEOUT", "1")
    async with transport.Transport("idle", store=memory_store, backends=("tcp",), timeout=10) as b, \
            transport.Transport("user", store=memory_store, backends=("tcp",), timeout=10) as a:
        region = b.empty("w", 1024, torch.uint8)
        addr, inc = b._agent.address, b.incarnation

        def raw() -> tuple[bool, bool, bool]:
            idle, _ = hello_from(addr, "idle", inc, "raw-idle")
            watch, _ = hello_from(addr, "idle", inc, "raw-watch", lane="watch")
            stalled, _ = hello_from(addr, "idle", inc, "raw-stalled")
            stalled.sendall(encode_frame(TcpFrame.PUT, 2, {"key": "w", "dtype": "uint8", "offset": 0,
                                                            "nbytes": 1024}, 1024) + bytes(100))
            with idle, watch, stalled:
                return closed_within(idle, 5), closed_within(stalled, 5), closed_within(watch, 2.5)

        idle_closed, stalled_closed, watch_closed = await anyio.to_thread.run_sync(raw)
        assert idle_closed and stalled_closed
        assert not watch_closed, "a watch connection was closed for being idle"
        for i in range(3):  # each put and signal after more than the agent's idle timeout
            await a.put(torch.full((1024,), i + 1, dtype=torch.uint8), "idle", key="w")
            await a.signal("idle", "n", i + 1)
            assert int(region[0]) == i + 1 and b.signal_value("n") == i + 1
            await anyio.sleep(1.3)
