"""The synchronous path for small transfers (completed inside ``put``/``get``) and natively
batched prepared transfers, in one process and against real target processes."""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import pytest
import torch

import transport
from tests._support import LoopTicks, serving_target, sha


@pytest.fixture
async def ipc_pair(memory_store: str):
    async with transport.Transport("a", store=memory_store, backends=("ipc",), timeout=20) as a:
        async with transport.Transport("b", store=memory_store, backends=("ipc",), timeout=20) as b:
            yield a, b


@pytest.mark.parametrize("shared", [True, False], ids=["shm", "cma"])
async def test_a_small_put_on_a_known_route_is_done_when_put_returns(ipc_pair, shared):
    a, b = ipc_pair
    if shared:
        w = b.empty("w", 1024, torch.int32)
    else:
        w = torch.zeros(1024, dtype=torch.int32)
        b.register("w", w)
    await a.peer("b", regions=["w"])
    for i in range(3):  # the first transfer learns the route; later ones take it synchronously
        h = a.put(torch.full((16,), i, dtype=torch.int32), "b", key="w", offset=64)
        await h
    assert h.done() and h.exception() is None and h.backend == "ipc"
    assert torch.all(w[16:32] == 2) and torch.all(w[:16] == 0)  # landed before anything awaited
    h.cancel()  # no effect once done
    await h
    got = torch.zeros(16, dtype=torch.int32)
    g = a.get(got, "b", key="w", offset=64)
    assert g.done() and torch.all(got == 2)
    # The flight recorder has them, as done operations with their backend.
    records = a.flight_record()["records"]
    assert [r["state"] for r in records[-2:]] == ["done", "done"]
    assert {r["backend"] for r in records[-2:]} == {"ipc"} and records[-1]["op"] == "get"


async def test_the_synchronous_path_leaves_refusals_to_the_checked_path(ipc_pair):
    a, b = ipc_pair
    w = b.empty("w", 64, torch.float32)
    b.empty("ro", 64, torch.float32, writable=False)
    await a.peer("b", regions=["w", "ro"])
    await a.put(torch.ones(4), "b", key="w")  # the route is known now
    for bad, err in [
        (lambda: a.put(torch.ones(4, dtype=torch.float64), "b", key="w"), transport.DTypeMismatchError),
        (lambda: a.put(torch.ones(4), "b", key="w", offset=62 * 4), transport.BoundsError),
        (lambda: a.put(torch.ones(4), "b", key="w", offset=2), transport.BoundsError),
        (lambda: a.put(torch.ones(4), "b", key="ro"), transport.ReadOnlyRegionError),
        (lambda: a.put(torch.ones(4), "b", key="nope"), transport.RegistrationError),
    ]:
        h = bad()
        with pytest.raises(err):
            await h
    assert torch.equal(w[:4], torch.ones(4)) and torch.all(w[4:] == 0)


async def test_a_small_put_waits_for_an_overlapping_put_in_flight(ipc_pair):
    a, b = ipc_pair
    n = 16 << 20
    w = b.empty("w", n, torch.uint8)
    await a.peer("b", regions=["w"])
    await a.put(torch.zeros(8, dtype=torch.uint8), "b", key="w")
    big = a.put(torch.full((n,), 1, dtype=torch.uint8), "b", key="w")  # on the copy threads
    small = a.put(torch.full((8,), 2, dtype=torch.uint8), "b", key="w", offset=n // 2)
    assert not big.done() and not small.done()  # ordered after the big one: not synchronous
    await transport.gather(big, small)
    assert torch.all(w[n // 2 : n // 2 + 8] == 2) and w[0] == 1 and w[-1] == 1  # the later put wins


async def test_a_loop_of_synchronous_puts_still_yields_and_is_cancellable(ipc_pair):
    a, b = ipc_pair
    b.empty("w", 8, torch.uint8)
    await a.peer("b", regions=["w"])
    src = torch.ones(8, dtype=torch.uint8)
    other = LoopTicks()
    done = 0
    async with anyio.create_task_group() as tg:
        tg.start_soon(other.run)
        with anyio.move_on_after(0.2):
            while done < 10_000_000:  # bounded: this test cannot hang even if nothing yields
                await a.put(src, "b", key="w")
                done += 1
        tg.cancel_scope.cancel()
    assert done < 10_000_000, "the deadline never reached the loop"
    assert other.n > 1, "the other task never ran during the loop"


async def test_a_synchronous_put_to_a_killed_process_fails(targets, file_store):
    async with transport.Transport("init", store=file_store, backends=("ipc",)) as t:
        target = await serving_target(t, targets, file_store, "ipc",
                                      [{"key": "w", "dtype": "uint8", "numel": 64, "shared": True}], name="victim")
        src = torch.ones(8, dtype=torch.uint8)
        assert t.put(src, "victim", key="w").done()  # synchronous now
        target.proc.send_signal(signal.SIGKILL)
        target.proc.wait(timeout=30)
        with pytest.raises(transport.PeerLostError):
            await t.put(src, "victim", key="w")  # its memory is still mapped here: not a silent success
        # Once it is declared lost, nothing here maps its memory any more (no route, no mapping
        # keeps a dead process's memfd alive).
        with anyio.fail_after(10):
            while "transport:victim:w" in Path("/proc/self/maps").read_text():
                await anyio.sleep(0.05)


@pytest.mark.parametrize(("backend", "shared"), [("ipc", True), ("ipc", False), ("tcp", False), ("ucx", True)],
                         ids=["ipc-shm", "ipc-cma", "tcp", "ucx"])
async def test_a_large_batch_against_a_target_process(targets, file_store, backend, shared):
    if backend == "ucx" and (why := transport.backends.REGISTRY["ucx"].unavailable_reason()):
        pytest.skip(f"ucx unavailable: {why}")
    # 100,000 segments over ipc; 20,000 over the others (their per-segment cost is in Python).
    n, size, stride = 100_000 if backend == "ipc" else 20_000, 16, 48
    async with transport.Transport("init", store=file_store, backends=(backend,)) as t:
        target = await serving_target(t, targets, file_store, backend,
                                      [{"key": "w", "dtype": "uint8", "numel": n * stride, "shared": shared}],
                                      timeout=120)
        src = torch.randint(0, 256, (n, size), dtype=torch.uint8)
        prepared = t.prepare_put("server", [(src[i], "w", i * stride + (i % 3) * 8) for i in range(n)])
        assert prepared.segments == n
        for _ in range(2):  # the second start reuses the plan
            h = prepared.start(timeout=120)
            await h
        assert h.segments == n and h.nbytes == n * size
        back = torch.zeros(n, size, dtype=torch.uint8)
        await t.get_many("server", [(back[i], "w", i * stride + (i % 3) * 8) for i in range(n)], timeout=120)
        assert torch.equal(back, src)
        await t.signal("server", "done", 1)
        info = await target.result(timeout=120)
    expect = torch.zeros(n, stride, dtype=torch.uint8)
    for j in range(3):
        expect[j::3, j * 8 : j * 8 + size] = src[j::3]
    assert info["sha256"] == {"w": sha(expect.reshape(-1))}


async def test_a_prepared_put_follows_its_tensors_into_new_memory(ipc_pair):
    a, b = ipc_pair
    w = b.empty("w", 4096, torch.float32)
    await a.peer("b", regions=["w"])
    base = torch.zeros(4096)
    prepared = a.prepare_put("b", [(base[i : i + 64], "w", i * 4) for i in range(0, 4096, 128)])
    base.fill_(1.0)
    await prepared.start()
    assert torch.all(w.view(-1, 64)[::2] == 1.0)
    old = base.untyped_storage().data_ptr()
    base.untyped_storage().resize_(8 * 4096 * 4)  # new memory under the same tensors (old freed)
    assert base.untyped_storage().data_ptr() != old
    base.fill_(2.0)
    await prepared.start()
    assert torch.all(w.view(-1, 64)[::2] == 2.0) and torch.all(w.view(-1, 64)[1::2] == 0)


async def test_lookup_of_a_same_host_peer_reads_the_store_only_when_its_record_changed(file_store):
    async with transport.Transport("a", store=file_store, backends=("ipc",)) as a, \
            transport.Transport("b", store=file_store, backends=("ipc",)) as b:
        b.empty("w", 16, torch.uint8)
        first = await a.lookup("b")
        assert first is not None and "w" in first.regions
        record = next(Path(file_store.removeprefix("file://")).glob("peer%2Fb*"))
        record.write_bytes(b"not a record")  # whoever reads the store now gets nothing usable
        again = await a.lookup("b")  # its live seq (ipc control page) says the adopted one is current
        assert again is not None and again.incarnation == first.incarnation and "w" in again.regions
        b.empty("v", 16, torch.uint8)  # b republishes: a new seq, and a good record again
        with anyio.fail_after(10):
            while (fresh := await a.lookup("b")) is None or "v" not in fresh.regions:
                await anyio.sleep(0.02)
        assert fresh.incarnation == first.incarnation



async def ucx_server(t: transport.Transport, targets, file_store, big_n: int, other: tuple[str, int, bool]):
    """A ucx target process "server" with a shared region "big" of ``big_n`` bytes and another
    (key, bytes, shared), once ``t`` has learnt the route to it (a first small put)."""
    key, n, shared = other
    target = await serving_target(t, targets, file_store, "ucx",
                                  [{"key": "big", "dtype": "uint8", "numel": big_n, "shared": True},
                                   {"key": key, "dtype": "uint8", "numel": n, "shared": shared}], timeout=120)
    await t.put(torch.zeros(8, dtype=torch.uint8), "server", key=key)  # learns the route
    return target

async def test_synchronous_ucx_puts_drive_a_lane_that_carries_a_large_put(targets, file_store):
    # A synchronous ucx transfer is driven by the calling thread itself, on lane 0, while that
    # lane's own thread is moving chunks of a large asynchronous put: both must land intact.
    if why := transport.backends.REGISTRY["ucx"].unavailable_reason():
        pytest.skip(f"ucx unavailable: {why}")
    big_n, small_n = 64 << 20, 4096
    async with transport.Transport("init", store=file_store, backends=("ucx",)) as t:
        target = await ucx_server(t, targets, file_store, big_n, ("small", small_n, True))
        big = torch.randint(0, 256, (big_n,), dtype=torch.uint8)
        small = torch.randint(0, 256, (small_n,), dtype=torch.uint8)
        synchronous = 0
        for _ in range(3):
            large = t.put(big, "server", key="big", timeout=120)
            for i in range(0, small_n, 64):
                h = t.put(small[i : i + 64], "server", key="small", offset=i)
                synchronous += h.done()
                await h
            await large
        assert synchronous > 0, "no small put took the synchronous path"
        back = torch.zeros(small_n, dtype=torch.uint8)
        await t.get(back, "server", key="small")
        assert torch.equal(back, small)
        await t.signal("server", "done", 1)
        info = await target.result(timeout=120)
    assert info["sha256"] == {"big": sha(big), "small": sha(small)}


async def test_synchronous_ucx_transfers_from_256_kib_move_two_halves_at_once(targets, file_store):
    # From 256 KiB a synchronous ucx put or get is split over lanes 0 and 1, one half driven by
    # the caller, the other by the engine's assistant thread; odd sizes and offsets, also while
    # lane 1 carries a large asynchronous put. The target's sha256 checks every put byte.
    if why := transport.backends.REGISTRY["ucx"].unavailable_reason():
        pytest.skip(f"ucx unavailable: {why}")
    big_n, mid_n = 32 << 20, (1 << 20) + 8192
    async with transport.Transport("init", store=file_store, backends=("ucx",)) as t:
        target = await ucx_server(t, targets, file_store, big_n, ("mid", mid_n, False))
        big = torch.randint(0, 256, (big_n,), dtype=torch.uint8)
        mid = torch.zeros(mid_n, dtype=torch.uint8)
        synchronous = 0
        for round_ in range(4):
            large = t.put(big, "server", key="big", timeout=120) if round_ % 2 else None
            for offset, n in [(0, 256 << 10), (5, (256 << 10) + 3), (4096, 1 << 20), (8191, (1 << 20) - 1)]:
                src = torch.randint(0, 256, (n,), dtype=torch.uint8)
                h = t.put(src, "server", key="mid", offset=offset)
                synchronous += h.done()
                await h
                mid[offset : offset + n] = src
                back = torch.zeros(n, dtype=torch.uint8)
                await t.get(back, "server", key="mid", offset=offset)
                assert torch.equal(back, src), (round_, offset, n)
            if large is not None:
                await large
        assert synchronous > 0, "no transfer took the synchronous path"
        await t.signal("server", "done", 1)
        info = await target.result(timeout=120)
    assert info["sha256"] == {"big": sha(big), "mid": sha(mid)}
