"""Faults injected by ``transport.testing.faulty`` into real backends: fail, stall, drop and kill
at a chosen call and byte. Each asserts the typed error within a bound (timeouts, never timing
thresholds), that the bytes before the fault point landed and none after it, that other peers
are unaffected, and what the flight recorder says. The faulty class replaces the built-in name
(``temporary_backend(..., replace=True)``), so its peers, in this process or others, run the
plain backend."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

import transport
from tests._support import sha
from transport._flight import analyze, load_dumps
from transport.backends import REGISTRY
from transport.testing import Fault, FaultKind, Injection, faulty, temporary_backend

N = 1 << 20
HOST_BACKENDS = [
    pytest.param(name, id=name, marks=[pytest.mark.skip(reason=f"{name} unavailable: {why}")] if why else [])
    for name in ("tcp", "ipc", "ucx")
    for why in [REGISTRY[name].unavailable_reason()]
]


@asynccontextmanager
async def trio_of(backend: str, store: str, fault: Fault, **kw: Any) -> AsyncIterator[tuple[Any, ...]]:
    """An initiator ``a`` whose backend injects ``fault``, and two plain targets ``b`` and ``c``
    with a zeroed N-byte region "w" each."""
    cls = faulty(REGISTRY[backend], fault)
    with temporary_backend(cls, replace=True):
        async with transport.Transport("a", store=store, backends=(backend,), timeout=20, **kw) as a, \
                transport.Transport("b", store=store, backends=(backend,), timeout=20) as b, \
                transport.Transport("c", store=store, backends=(backend,), timeout=20) as c:
            dst = {}
            for t in (b, c):
                dst[t.name] = torch.zeros(N, dtype=torch.uint8)
                t.register("w", dst[t.name])
                await a.peer(t.name, regions=["w"])
            yield a, dst, cls


def payload() -> torch.Tensor:
    return torch.randint(1, 256, (N,), dtype=torch.uint8)  # no zero byte: "untouched" is visible


def op_records(t: transport.Transport, peer: str) -> list[dict]:
    return [r for r in t.flight_record()["records"] if r["peer"] == peer and r["op"] in ("put", "get")]


@pytest.mark.parametrize("backend", HOST_BACKENDS)
async def test_stall_times_out_at_its_byte_and_others_continue(backend, memory_store):
    at = N // 2
    async with trio_of(backend, memory_store, Fault(FaultKind.STALL, at_byte=at, peer="b")) as (a, dst, cls):
        src = payload()
        with anyio.fail_after(30):
            stuck = a.put(src, "b", key="w", timeout=1.0)
            await a.put(src, "c", key="w")  # c is served while the put to b hangs
            assert torch.equal(dst["c"], src)
            with pytest.raises(transport.TransferTimeoutError, match=r"to b:'w'"):
                await stuck
        assert cls.injected == [Injection(cls.faults[0], transport.TransferOp.PUT, "b", "w", 0, N, at)]
        assert torch.equal(dst["b"][:at], src[:at]) and not dst["b"][at:].any(), "bytes past the stall point moved"
        [rec] = op_records(a, "b")
        assert (rec["state"], rec["error_type"], rec["backend"]) == ("aborted", "TransferTimeoutError", backend)
        assert [s for s, _ in rec["transitions"]] == ["started", "moving", "aborted"]
        # A timeout is not a loss: the fault struck once, the next put to b completes.
        await a.put(src, "b", key="w")
        assert torch.equal(dst["b"], src)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
async def test_drop_fails_with_peer_lost_at_its_byte(backend, memory_store):
    at = N // 4 + 3  # rounded down to a whole element: uint8, so exactly this byte
    async with trio_of(backend, memory_store, Fault(FaultKind.DROP, at_byte=at, peer="b")) as (a, dst, cls):
        src = payload()
        with anyio.fail_after(30):
            with pytest.raises(transport.PeerLostError, match=f"connection to b dropped .* after {at} bytes"):
                await a.put(src, "b", key="w")
            assert torch.equal(dst["b"][:at], src[:at]) and not dst["b"][at:].any(), "bytes past the drop moved"
            # The initiator treats a broken connection as a lost peer: later transfers fail at once ...
            with pytest.raises(transport.PeerLostError, match="b is lost"):
                await a.put(src, "b", key="w")
            # ... and only to that peer.
            await a.put(src, "c", key="w")
            back = torch.empty_like(src)
            await a.get(back, "c", key="w")
        assert torch.equal(dst["c"], src) and torch.equal(back, src)
        assert [i.moved for i in cls.injected] == [at]
        record = a.flight_record()
        first = op_records(a, "b")[0]
        assert (first["state"], first["error_type"], first["backend"]) == ("failed", "PeerLostError", backend)
        lost = [e for e in record["events"] if e["event"] == "peer-lost" and e["peer"] == "b"]
        assert len(lost) == 1 and "dropped" in lost[0]["detail"]
        assert all(r["state"] == "done" for r in op_records(a, "c"))


@pytest.mark.parametrize("backend", HOST_BACKENDS)
async def test_fail_raises_the_chosen_error_at_the_chosen_call(backend, memory_store):
    fault = Fault(FaultKind.FAIL, at_call=2, peer="b", error=transport.BackendUnavailableError)
    async with trio_of(backend, memory_store, fault) as (a, dst, cls):
        first, second = payload(), payload()
        with anyio.fail_after(30):
            await a.put(first, "b", key="w")  # call 1: fine
            with pytest.raises(transport.BackendUnavailableError, match=f"injected fault: put of {N} bytes to b:'w'"):
                await a.put(second, "b", key="w")  # call 2: fails before any byte moves
            assert torch.equal(dst["b"], first)
            await a.put(second, "b", key="w")  # call 3: fine again; b is not lost
            await a.put(second, "c", key="w")
        assert torch.equal(dst["b"], second) and torch.equal(dst["c"], second)
        assert [(i.peer, i.moved) for i in cls.injected] == [("b", 0)]
        states = [(r["state"], r["error_type"]) for r in op_records(a, "b")]
        assert states == [("done", None), ("failed", "BackendUnavailableError"), ("done", None)]


async def test_a_failed_get_leaves_the_rest_of_its_destination_untouched(memory_store):
    at = N // 2
    fault = Fault(FaultKind.FAIL, at_byte=at, op=transport.TransferOp.GET)
    async with trio_of("tcp", memory_store, fault) as (a, _dst, cls):
        src = payload()
        await a.put(src, "b", key="w")  # puts do not count
        back = torch.zeros(N, dtype=torch.uint8)
        with anyio.fail_after(30):
            with pytest.raises(transport.TransportInternalError, match=f"get of {N} bytes to b:'w' failed after {at}"):
                await a.get(back, "b", key="w")
        assert torch.equal(back[:at], src[:at]) and not back[at:].any()
        assert [(i.op, i.moved) for i in cls.injected] == [(transport.TransferOp.GET, at)]


async def test_a_kill_fault_needs_another_process(memory_store):
    async with trio_of("tcp", memory_store, Fault(FaultKind.KILL, peer="b")) as (a, dst, _cls):
        with anyio.fail_after(30):
            with pytest.raises(transport.TransportInternalError, match="not another process on this host"):
                await a.put(payload(), "b", key="w")
        assert not dst["b"].any()


# -- kill: real target processes ----------------------------------------------------------------


def spec(name: str, store: str, backend: str) -> dict:
    return {"name": name, "store": store, "backends": [backend], "initiator": "init", "mode": "serve",
            "regions": [{"key": "w", "dtype": "uint8", "numel": N * 16}]}


@pytest.mark.parametrize("backend", ["ipc", "tcp"])
async def test_kill_at_a_byte_is_peer_lost_and_the_other_target_is_unaffected(targets, file_store, tmp_path, backend):
    flight = tmp_path / "flight"
    n = N * 16
    cls = faulty(REGISTRY[backend], Fault(FaultKind.KILL, at_byte=n // 2, peer="victim"))
    with temporary_backend(cls, replace=True):
        async with transport.Transport("init", store=file_store, backends=(backend,), timeout=20,
                                       flight_dir=flight) as t:
            victim = targets(spec("victim", file_store, backend))
            other = targets(spec("other", file_store, backend))
            for name in ("victim", "other"):
                await t.peer(name, regions=["w"], timeout=60)
            src = torch.randint(0, 256, (n,), dtype=torch.uint8)
            with anyio.fail_after(60):
                with pytest.raises(transport.PeerLostError, match="victim"):
                    await t.put(src, "victim", key="w")
                returncode = await anyio.to_thread.run_sync(victim.proc.wait)
                assert returncode == -signal.SIGKILL  # the fault really killed the target
                await t.put(src, "other", key="w")
                back = torch.empty_like(src)
                await t.get(back, "other", key="w")
                assert torch.equal(back, src)
                await t.signal("other", "done", 1)
            assert (await other.result())["sha256"]["w"] == sha(src)
            assert [(i.peer, i.moved) for i in cls.injected] == [("victim", n // 2)]
            assert t.dump_flight_record("test end") is not None
    report = analyze(load_dumps(sorted(flight.glob("*.json"))))
    assert "peer-lost victim" in report and "init -> victim: ERRORS" in report and "PeerLostError" in report
    assert "init -> other: ok" in report
