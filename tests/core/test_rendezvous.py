"""Rendezvous stores (real file system, real torch TCPStore) and the peer-record encoding."""

from __future__ import annotations

import json
import os
import textwrap

import anyio
import pytest
import torch

import transport
from tests._support import PYTHON, python_env
from transport._errors import StoreError, WireError
from transport._rendezvous import FileStore, MemoryStore, TCPStore, open_store
from transport._wire import HostId, PeerRecord, RegionRecord


@pytest.fixture(params=["file", "memory", "tcp"])
def store(request, tmp_path):
    if request.param == "file":
        s = open_store(f"file://{tmp_path}/s")
    elif request.param == "memory":
        s = open_store(f"memory://{tmp_path.name}")
    else:
        s = open_store("tcp://127.0.0.1:0?host=1", timeout=10)
    yield s
    s.close()


def test_store_set_get_keys_delete(store):
    assert store.get("peer/x") is None
    store.set("peer/x", b"1")
    store.set("peer/y/z", b"\x00\xff")
    store.set("other", b"3")
    store.set("peer/x", b"2")
    assert store.get("peer/x") == b"2"
    assert store.get("peer/y/z") == b"\x00\xff"
    assert store.keys("peer/") == ["peer/x", "peer/y/z"]
    store.delete("peer/x")
    assert store.get("peer/x") is None
    assert store.keys("peer/") == ["peer/y/z"]
    store.delete("never-set")


def test_open_store_urls(tmp_path):
    assert isinstance(open_store(f"file://{tmp_path}"), FileStore)
    assert isinstance(open_store("memory://x"), MemoryStore)
    for bad in ("http://x", "tcp://nohostport", "file://"):
        with pytest.raises(StoreError):
            open_store(bad)
    with pytest.raises(StoreError, match="cannot join"):
        TCPStore("127.0.0.1", 1, is_host=False, timeout=1)


def test_tcp_store_port_zero_reports_real_port():
    s = open_store("tcp://127.0.0.1:0?host=1", timeout=10)
    assert s.url.startswith("tcp://127.0.0.1:") and not s.url.endswith(":0")
    joined = open_store(s.url, timeout=10)
    s.set("k", b"v")
    assert joined.get("k") == b"v"


def _record(**over) -> PeerRecord:
    base = {
        "name": "gen-0", "incarnation": "ab12", "seq": 3, "pid": 42, "pid_start": 99,
        "host": HostId("h", "boot", 7), "agent": ("127.0.0.1", 5000),
        "backends": {"ipc": b"\x01\x02", "tcp": b""},
        "regions": {"w": RegionRecord("w", "bfloat16", (2, 3), 12, True, {"ipc": b"\x00" * 32})},
    }
    base.update(over)
    return PeerRecord(**base)


def test_peer_record_roundtrip_is_json_not_pickle():
    rec = _record()
    data = rec.encode()
    doc = json.loads(data)
    assert doc["format"] == "transport.peer" and doc["v"] == 1
    assert PeerRecord.decode(data) == rec


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.update(v=2), "version 2"),
        (lambda d: d.update(format="x"), "not a transport peer record"),
        (lambda d: d.pop("incarnation"), "malformed"),
        (lambda d: d.update(seq="3"), "malformed"),
        (lambda d: d["regions"][0].update(nbytes=True), "malformed"),
        (lambda d: d["backends"].update(ipc="***"), "malformed"),
    ],
)
def test_peer_record_rejects_bad_input(mutate, match):
    doc = json.loads(_record().encode())
    mutate(doc)
    with pytest.raises(WireError, match=match):
        PeerRecord.decode(json.dumps(doc).encode())
    with pytest.raises(WireError):
        PeerRecord.decode(b"\xff not json")


async def test_transports_meet_through_a_tcp_store_across_processes(tmp_path):
    """One process hosts the TCPStore (?host=1); another joins it and puts into the host."""
    host_store = open_store("tcp://127.0.0.1:0?host=1", timeout=10)
    url = host_store.url
    child = textwrap.dedent(f"""
        import trio, torch, transport
        async def main():
            async with transport.Transport("joiner", store={url!r}, backends=("tcp",)) as t:
                await t.peer("hoster", regions=["w"])
                await t.put(torch.arange(10.0), "hoster", key="w")
                await t.signal("hoster", "done", 1)
        trio.run(main)
    """)
    async with transport.Transport("hoster", store=url, backends=("tcp",)) as t:
        w = torch.zeros(10)
        t.register("w", w)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: anyio.run_process([PYTHON, "-c", child], env=python_env()))
            await t.wait_signal("done", timeout=60)
        assert torch.equal(w, torch.arange(10.0))
    host_store.close()


async def test_name_in_use_by_a_live_process_is_refused(memory_store):
    async with transport.Transport("same", store=memory_store):
        # A record with our own pid is overwritten (same process); a live foreign pid is not.
        pass
    store = open_store(memory_store)
    from transport._host import host_id, pid_start

    rec = _record(name="taken", pid=os.getppid(), pid_start=pid_start(os.getppid()), host=host_id())
    store.set("peer/taken", rec.encode())
    with pytest.raises(transport.RegistrationError, match="in use"):
        async with transport.Transport("taken", store=memory_store):
            pass
