"""What a caller can find out without waiting or failing: peers as published now (``lookup``), a
store to rendezvous on (``serve_store``), and what this machine supports (``available_backends``,
``cuda_unavailable_reason``). The registry and the testing kit have their own files
(tests/backends/test_testing_kit.py)."""

from __future__ import annotations

import uuid

import pytest
import torch
import trio

import transport


def _store() -> str:
    return f"memory://{uuid.uuid4().hex}"


async def test_lookup_never_waits_and_sees_what_is_published_now() -> None:
    store = _store()
    async with transport.Transport("a", store=store, backends=("tcp",)) as a:
        with trio.fail_after(2):  # no polling: an absent peer is None at once
            assert await a.lookup("b") is None
        async with transport.Transport("b", store=store, backends=("tcp",)) as b:
            b.register("w", torch.zeros(4))
            peer = await a.lookup("b")
            assert peer is not None and peer.name == "b" and peer.incarnation == b.incarnation
            assert "w" in peer.regions and peer.backends == ("tcp",)
        assert await a.lookup("b") is None  # its record was withdrawn when it closed
    with pytest.raises(transport.ClosedError):
        await a.lookup("b")


async def test_a_record_read_again_unchanged_is_decoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A publisher looks its subscribers up on every version: the same record bytes verify and
    # decode alike, so they are decoded once; changed bytes are decoded anew, and bytes that do
    # not decode are refused (None), never answered from what the name held before.
    from transport._peers import PEER_PREFIX
    from transport._wire import PeerRecord

    decodes: list[str] = []
    plain = PeerRecord.decode

    def counted(data: bytes) -> PeerRecord:
        record = plain(data)
        decodes.append(record.name)
        return record

    monkeypatch.setattr(PeerRecord, "decode", staticmethod(counted))
    store = _store()
    async with transport.Transport("a", store=store, backends=("tcp",)) as a, \
            transport.Transport("b", store=store, backends=("tcp",)) as b:
        b.register("w", torch.zeros(4))
        first = await a.lookup("b")
        assert first is not None and "w" in first.regions
        before = decodes.count("b")
        for _ in range(5):
            again = await a.lookup("b")
            assert again is not None and "w" in again.regions
        assert decodes.count("b") == before  # the same bytes: not decoded again
        b.register("v", torch.zeros(4))
        changed = await a.lookup("b")
        assert changed is not None and {"w", "v"} <= set(changed.regions)
        assert decodes.count("b") == before + 1
        a._store.set(PEER_PREFIX + "b", b"{not a record")  # (b rewrites it at its next change)
        assert await a.lookup("b") is None


async def test_lookup_still_shows_a_peer_declared_lost() -> None:
    store = _store()
    async with transport.Transport("a", store=store, backends=("tcp",)) as a, \
            transport.Transport("b", store=store, backends=("tcp",)) as b:
        await a.peer("b")
        a.exclude("b")
        peer = await a.lookup("b")
        assert peer is not None and peer.incarnation == b.incarnation  # reported, not hidden
        b.register("w", torch.zeros(4))
        with pytest.raises(transport.PeerLostError):
            await a.put(torch.ones(4), "b", key="w")


async def test_serve_store_hosts_a_tcp_rendezvous() -> None:
    with transport.serve_store("127.0.0.1:0", timeout=10) as store:
        assert store.url.startswith("tcp://127.0.0.1:")
        async with transport.Transport("a", store=store.url, backends=("tcp",)) as a, \
                transport.Transport("b", store=store.url, backends=("tcp",)) as b:
            dst = torch.zeros(16)
            b.register("w", dst)
            await a.peer("b", regions=["w"])
            await a.put(torch.arange(16, dtype=torch.float32), "b", key="w")
            assert torch.equal(dst, torch.arange(16, dtype=torch.float32))


@pytest.mark.parametrize("address", ["127.0.0.1", ":80", "host:port", ""])
def test_serve_store_refuses_a_malformed_address(address: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        transport.serve_store(address)


def test_machine_support_is_answered_not_raised() -> None:
    backends = transport.available_backends()
    assert list(backends)[:4] == ["ipc", "ucx", "nccl", "tcp"]
    assert backends["tcp"] is None  # tcp runs everywhere
    reason = transport.cuda_unavailable_reason()
    assert reason is None or (isinstance(reason, str) and reason)
