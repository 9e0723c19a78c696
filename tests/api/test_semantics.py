"""Semantics a careless caller relies on: timeouts checked at the call, waiting without
aborting, draining on close, overlapping puts in order, registered storage that moves,
exclusion over tcp, and argument types."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import anyio
import numpy as np
import pytest
import torch

import transport
from tests._support import PYTHON, sha

BIG = 64 << 20  # large enough that a put to a SIGSTOPped tcp target fills the socket buffers


def spec(name: str, store: str, backends: list[str], numel: int = BIG) -> dict:
    return {"name": name, "store": store, "backends": backends, "initiator": "init", "mode": "serve",
            "regions": [{"key": "w", "dtype": "uint8", "numel": numel}]}


# -- timeouts ---------------------------------------------------------------------------------

BAD_TIMEOUTS = [float("nan"), math.inf, -math.inf, -1, 0, 0.0, "1", True, [1]]


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=repr)
async def test_bad_timeouts_are_refused_at_the_call_and_nothing_is_submitted(bad, memory_store):
    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=10) as a:
        async with transport.Transport("b", store=memory_store, backends=("tcp",), timeout=10) as b:
            region = b.empty("w", 64, torch.uint8)
            src = torch.full((64,), 7, dtype=torch.uint8)
            before = len(a.flight_record()["records"])
            calls = [
                lambda: a.put(src, "b", key="w", timeout=bad),
                lambda: a.get(src, "b", key="w", timeout=bad),
            ]
            for call in calls:
                with pytest.raises(ValueError, match="timeout"):
                    call()
            for acall in (lambda: a.fence("b", timeout=bad), lambda: a.peer("b", timeout=bad),
                          lambda: a.wait_signal("x", timeout=bad), lambda: a.signal("b", "x", 1, timeout=bad)):
                with pytest.raises(ValueError, match="timeout"):
                    await acall()
            h = a.put(src, "b", key="w")
            with pytest.raises(ValueError, match="timeout"):
                await h.wait(timeout=bad)
            await h
            assert len(a.flight_record()["records"]) == before + 1  # only the good put was started
            assert torch.equal(region, src)
            with pytest.raises(ValueError, match="timeout"):
                await a.aclose(drain=True, timeout=bad)
            assert repr(a).startswith("<Transport 'a' open")  # a refused close closes nothing


def test_bad_default_timeout_is_refused_at_construction():
    for bad in (float("nan"), math.inf, 0, -5, "60"):
        with pytest.raises(ValueError, match="timeout"):
            transport.Transport("a", timeout=bad)  # type: ignore[arg-type]


def test_numpy_numbers_are_accepted_as_timeouts_and_offsets():
    assert transport.Transport("a", timeout=np.float32(2.5)).timeout == 2.5


def test_transfer_timeout_error_is_a_builtin_timeout_error_with_partial():
    err = transport.TransferTimeoutError("late", partial=True)
    assert isinstance(err, TimeoutError) and isinstance(err, transport.TransportError)
    assert err.partial is True and transport.TransferTimeoutError("late").partial is False


# -- waiting is not aborting; draining --------------------------------------------------------


async def _stopped_target(targets, file_store, t):
    """A tcp target process, ready, then SIGSTOPped: a big put to it stalls until SIGCONT."""
    target = targets(spec("slow", file_store, ["tcp"]))
    await t.wait_signal("ready", timeout=60)
    await t.peer("slow", regions=["w"])
    os.kill(target.proc.pid, signal.SIGSTOP)
    return target


async def test_wait_with_timeout_leaves_the_transfer_running(targets, file_store):
    async with transport.Transport("init", store=file_store, backends=("tcp",), timeout=60) as t:
        target = await _stopped_target(targets, file_store, t)
        src = torch.randint(0, 256, (BIG,), dtype=torch.uint8)
        try:
            h = t.put(src, "slow", key="w")
            with pytest.raises(TimeoutError) as info:
                await h.wait(timeout=0.3)
            assert not isinstance(info.value, transport.TransportError)  # the wait timed out, not the put
            assert not h.done()
            # Cancelling one of two waiters does not abort it either.
            async with anyio.create_task_group() as tg:
                tg.start_soon(h.wait)
                with anyio.move_on_after(0.2):
                    await h.wait()
                assert not h.done()
                os.kill(target.proc.pid, signal.SIGCONT)
            await h  # it completes once the target runs again
        finally:
            os.kill(target.proc.pid, signal.SIGCONT)
        assert h.done() and h.exception() is None
        await t.signal("slow", "done", 1)
        assert (await target.result())["sha256"]["w"] == sha(src)


async def test_cancelling_the_only_waiter_aborts(targets, file_store):
    async with transport.Transport("init", store=file_store, backends=("tcp",), timeout=60) as t:
        target = await _stopped_target(targets, file_store, t)
        try:
            h = t.put(torch.ones(BIG, dtype=torch.uint8), "slow", key="w")
            with anyio.move_on_after(0.3):
                await h
            with anyio.fail_after(30):
                with pytest.raises(transport.TransferAbortedError) as info:
                    await h.wait()
            assert info.value.partial  # bytes had started to move
        finally:
            os.kill(target.proc.pid, signal.SIGCONT)


async def test_aclose_drain_waits_for_transfers_in_flight(targets, file_store):
    t = transport.Transport("init", store=file_store, backends=("tcp",), timeout=60)
    async with t:
        target = await _stopped_target(targets, file_store, t)
        src = torch.randint(0, 256, (BIG,), dtype=torch.uint8)
        try:
            h = t.put(src, "slow", key="w")
            # aclose must run where the Transport was entered (not in a nested task group).
            threading.Timer(0.5, os.kill, (target.proc.pid, signal.SIGCONT)).start()
            await t.aclose(drain=True, timeout=30)
        finally:
            os.kill(target.proc.pid, signal.SIGCONT)
        assert h.exception() is None  # drained, not aborted
        with pytest.raises(transport.ClosedError):
            t.put(src, "slow", key="w")


async def test_aclose_drain_aborts_what_is_still_running_at_its_timeout(targets, file_store):
    t = transport.Transport("init", store=file_store, backends=("tcp",), timeout=60)
    async with t:
        target = await _stopped_target(targets, file_store, t)
        try:
            h = t.put(torch.ones(BIG, dtype=torch.uint8), "slow", key="w")
            await t.aclose(drain=True, timeout=0.3)
        finally:
            os.kill(target.proc.pid, signal.SIGCONT)
        assert isinstance(h.exception(), transport.ClosedError)


# -- exclusion over tcp -----------------------------------------------------------------------


async def test_exclude_over_tcp_aborts_with_transfer_aborted_error(targets, file_store):
    async with transport.Transport("init", store=file_store, backends=("tcp",), timeout=60) as t:
        target = await _stopped_target(targets, file_store, t)
        try:
            h = t.put(torch.ones(BIG, dtype=torch.uint8), "slow", key="w")
            with anyio.move_on_after(0.3):
                await h.wait()
            t.exclude("slow")
            with anyio.fail_after(30):
                with pytest.raises(transport.TransferAbortedError, match="excluded") as info:
                    await h
            assert info.value.partial
            with pytest.raises(transport.PeerLostError):
                await t.put(torch.ones(8, dtype=torch.uint8), "slow", key="w")
        finally:
            os.kill(target.proc.pid, signal.SIGCONT)


# -- ordering ---------------------------------------------------------------------------------


async def test_a_later_overlapping_put_always_lands_after_an_earlier_one(pair):
    """1,000 times two back-to-back overlapping puts, never awaited in between: the later one
    wins in the overlap, the earlier one stays outside it, and nothing is torn."""
    a, b = pair
    n = 1 << 14
    region = b.empty("w", n, torch.uint8)
    first = torch.empty(n, dtype=torch.uint8)
    second = torch.empty(n // 2, dtype=torch.uint8)
    for i in range(1000):
        first.fill_((2 * i) % 251)
        second.fill_((2 * i + 1) % 251)
        h1 = a.put(first, "b", key="w")
        h2 = a.put(second, "b", key="w", offset=n // 4)
        await transport.gather(h1, h2)
        assert torch.all(region[n // 4 : 3 * n // 4] == second[0]), f"iteration {i}: the earlier put won"
        assert torch.all(region[: n // 4] == first[0]) and torch.all(region[3 * n // 4 :] == first[0])


async def test_non_overlapping_puts_do_not_wait_for_each_other(pair):
    a, b = pair
    region = b.empty("w", 1 << 20, torch.uint8)
    halves = [torch.full((1 << 19,), v, dtype=torch.uint8) for v in (3, 4)]
    h1 = a.put(halves[0], "b", key="w")
    h2 = a.put(halves[1], "b", key="w", offset=1 << 19)
    await transport.gather(h1, h2)
    assert torch.equal(region, torch.cat(halves))


async def test_a_get_after_an_overlapping_put_reads_what_it_wrote(pair):
    a, b = pair
    b.empty("w", 4096, torch.int32)
    src = torch.arange(4096, dtype=torch.int32)
    back = torch.zeros(4096, dtype=torch.int32)
    for _ in range(50):
        src += 1
        await transport.gather(a.put(src, "b", key="w"), a.get(back, "b", key="w"))
        assert torch.equal(back, src)


# -- registered storage that moves ------------------------------------------------------------


async def test_replaced_storage_is_refused_at_the_next_transfer(backend, memory_store):
    async with transport.Transport("a", store=memory_store, backends=(backend,), timeout=20) as a:
        async with transport.Transport("b", store=memory_store, backends=(backend,), timeout=20,
                                       heartbeat=0.1, lease=5) as b:
            w = torch.zeros(1024, dtype=torch.float32)
            b.register("w", w)
            await a.put(torch.ones(1024), "b", key="w")
            assert torch.equal(w, torch.ones(1024))
            w.set_(torch.full((1024,), 5.0).untyped_storage())  # e.g. an optimizer swapping .data
            # Locally, at once: the tensor itself names the region it no longer lives in.
            with pytest.raises(transport.RegistrationError, match="new storage"):
                a_local = b.put(w, "a")  # key=None: looked up by the registered tensor
                await a_local
            # Remotely, at the latest once the owner has republished (every heartbeat).
            with anyio.fail_after(10):
                while True:
                    try:
                        await a.put(torch.full((1024,), 2.0), "b", key="w")
                    except transport.RegistrationError as exc:
                        assert "new storage" in str(exc)
                        break
                    await anyio.sleep(0.05)
            assert torch.equal(w, torch.full((1024,), 5.0))  # the new storage was never written
            b.unregister("w")
            b.register("w", w)  # registering again makes it usable
            await a.put(torch.full((1024,), 3.0), "b", key="w")
            assert torch.equal(w, torch.full((1024,), 3.0))


async def test_replaced_storage_is_noticed_at_the_owners_next_call(backend, memory_store):
    """With heartbeats far apart, the owner's next call that is not a transfer notices the
    replaced storage and republishes: the very next put into it is refused, not lost in the
    old storage."""
    async with transport.Transport("a", store=memory_store, backends=(backend,), timeout=20) as a:
        async with transport.Transport("b", store=memory_store, backends=(backend,), timeout=20,
                                       heartbeat=60, lease=120) as b:
            w = torch.zeros(1024, dtype=torch.float32)
            b.register("w", w)
            await a.put(torch.ones(1024), "b", key="w")
            w.set_(torch.full((1024,), 5.0).untyped_storage())
            assert b.signal_value("anything") is None  # the owner's next local call
            with pytest.raises(transport.RegistrationError, match="new storage"):
                await a.put(torch.full((1024,), 2.0), "b", key="w")
            assert torch.equal(w, torch.full((1024,), 5.0))


# -- argument types ---------------------------------------------------------------------------


async def test_numpy_integer_offsets_work(memory_store):
    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=10) as a:
        async with transport.Transport("b", store=memory_store, backends=("tcp",), timeout=10) as b:
            region = b.empty("w", 16, torch.int64)
            await a.put(torch.tensor([9], dtype=torch.int64), "b", key="w", offset=np.int64(8 * 3))
            assert region[3] == 9
            with pytest.raises(TypeError, match="offset"):
                a.put(torch.tensor([9], dtype=torch.int64), "b", key="w", offset=8.0)  # type: ignore[arg-type]


async def test_bad_shapes_in_empty_are_clear_errors(memory_store):
    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=10) as a:
        with pytest.raises(ValueError, match="negative"):
            a.empty("w", (4, -1))
        with pytest.raises(ValueError, match="negative"):
            a.empty("w", -3)
        with pytest.raises(TypeError, match="shape"):
            a.empty("w", 2.5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="dtype"):
            a.empty("w", 4, "float32")  # type: ignore[arg-type]
        assert a.empty("w", np.int64(4)).shape == (4,)
        assert "w" in a.regions


@pytest.mark.parametrize(("timeout", "error"), [(math.nan, ValueError), (math.inf, ValueError), (-1.0, ValueError),
                                                (0, ValueError), ("1", ValueError), (True, ValueError)])
async def test_a_bad_timeout_is_refused_at_the_call_and_harms_nothing(timeout: object, error: type) -> None:
    store = f"memory://{uuid.uuid4().hex}"
    async with transport.Transport("a", store=store, backends=("tcp",)) as a, \
            transport.Transport("b", store=store, backends=("tcp",)) as b:
        dst = torch.zeros(8)
        b.register("w", dst)
        await a.peer("b", regions=["w"])
        src = torch.ones(8)
        for call in (lambda: a.put(src, "b", key="w", timeout=timeout),  # type: ignore[arg-type]
                     lambda: a.get(src, "b", key="w", timeout=timeout)):  # type: ignore[arg-type]
            with pytest.raises(error):
                call()
        with pytest.raises(error):
            await a.fence("b", timeout=timeout)  # type: ignore[arg-type]
        with pytest.raises(error):
            await a.wait_signal("s", timeout=timeout)  # type: ignore[arg-type]
        assert torch.equal(dst, torch.zeros(8))  # nothing moved
        await a.put(src, "b", key="w")  # and the Transport still works
        assert torch.equal(dst, src)
    with pytest.raises(error):
        transport.Transport("c", store=store, timeout=timeout)  # type: ignore[arg-type]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_process_watch_sees_exit_and_pid_reuse_like_proc_does():
    """The pidfd liveness check agrees with /proc: alive while running, dead once exited
    (before and after reaping), and a wrong start time is never taken for the process."""
    from transport._host import ProcessWatch, pid_start

    watch = ProcessWatch(limit=2)
    child = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(60)"])
    try:
        start = pid_start(child.pid)
        assert start > 0 and watch.alive(child.pid, start) and watch.alive(child.pid, start)
        assert not watch.alive(child.pid, start + 1)  # another process that had this pid
        child.kill()
        deadline = time.monotonic() + 30
        while pid_start(child.pid) != -1 and time.monotonic() < deadline:  # a zombie until reaped
            time.sleep(0.01)
        assert pid_start(child.pid) == -1
        assert not watch.alive(child.pid, start)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert not watch.alive(child.pid, start)
    assert watch.alive(os.getpid(), pid_start(os.getpid()))
    watch.close()
