"""The conformance suite: written once, run against every available backend (under trio).

Both endpoints live in this process so the target's memory is inspected directly; the
multi-process file runs the one-sided and fault cases with real separate processes.
"""

from __future__ import annotations

import anyio
import pytest
import torch

import transport

from . import scenarios
from .scenarios import DTYPES, random_tensor, same_bytes


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("numel", [0, 1, 7, 4097, 1_000_003])
async def test_roundtrip_dtypes_and_sizes(pair, backend, dtype, numel):
    a, b = pair
    used = await scenarios.roundtrip(a, b, dtype, numel, seed=numel)
    assert used == backend


@pytest.mark.slow
async def test_one_gib(pair, backend):
    a, b = pair
    n = 1 << 30
    dst = b.empty("big", n, torch.uint8) if backend == "ipc" else torch.zeros(n, dtype=torch.uint8)
    if backend != "ipc":
        b.register("big", dst)
    await a.peer("b", regions=["big"])
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    await a.put(src, "b", key="big")
    assert torch.equal(dst, src)
    del src
    back = torch.empty(n, dtype=torch.uint8)
    await a.get(back, "b", key="big")
    assert torch.equal(back, dst)


async def test_offsets_touch_only_their_range(pair):
    a, b = pair
    dst = torch.zeros(1000, dtype=torch.int64)
    b.register("o", dst)
    await a.peer("b", regions=["o"])
    src = random_tensor(100, torch.int64, 1)
    await a.put(src, "b", key="o", offset=300 * 8)
    assert torch.equal(dst[300:400], src)
    assert not dst[:300].any() and not dst[400:].any()
    part = torch.empty(10, dtype=torch.int64)
    await a.get(part, "b", key="o", offset=350 * 8)
    assert torch.equal(part, src[50:60])


async def test_non_contiguous_source_is_staged(pair):
    a, b = pair
    dst = torch.zeros(64, 32)
    b.register("nc", dst)
    await a.peer("b", regions=["nc"])
    base = torch.randn(32, 64)
    src = base.t()  # non-contiguous view, 64x32
    assert not src.is_contiguous()
    await a.put(src, "b", key="nc")
    assert torch.equal(dst, src)


async def test_key_defaults_to_local_registration(pair):
    a, b = pair
    b.register("w", torch.zeros(256))
    src = torch.randn(256)
    a.register("w", src)
    await a.peer("b", regions=["w"])
    h = a.put(src, "b")
    assert h.key == "w"
    await h
    assert torch.equal(b.regions["w"].tensor, src)


async def test_many_transfers_in_flight(pair):
    await scenarios.many_in_flight(*pair)


async def test_signal_is_ordered_after_puts(pair):
    await scenarios.signal_after_puts(*pair)


async def test_bad_input_raises_typed_errors_and_leaves_memory(pair):
    await scenarios.error_cases(*pair)


async def test_unknown_peer_times_out(pair):
    a, _ = pair
    with anyio.fail_after(10):
        t0 = anyio.current_time()
        with pytest.raises(transport.PeerNotFoundError, match="nobody"):
            await a.peer("nobody", timeout=0.3)
        assert anyio.current_time() - t0 >= 0.3


async def test_wait_signal_times_out(pair):
    _, b = pair
    with pytest.raises(transport.TransferTimeoutError, match="never"):
        await b.wait_signal("never", timeout=0.2)


async def test_closed_transport_raises(backend, memory_store):
    async with transport.Transport("b", store=memory_store, backends=(backend,)) as b:
        b.register("x", torch.zeros(4))
        async with transport.Transport("a", store=memory_store, backends=(backend,)) as a:
            await a.peer("b")
        with pytest.raises(transport.ClosedError):
            a.put(torch.zeros(4), "b", key="x")
        with pytest.raises(transport.ClosedError):
            await a.peer("b")
        with pytest.raises(transport.ClosedError):
            a.register("y", torch.zeros(1))
        assert not b.regions["x"].tensor.any()
    with pytest.raises(transport.ClosedError):
        b.register("z", torch.zeros(1))


async def test_cancel_before_start_moves_nothing(pair):
    a, b = pair
    dst = torch.zeros(1 << 20)
    b.register("c", dst)
    await a.peer("b", regions=["c"])
    h = a.put(torch.ones(1 << 20), "b", key="c")
    h.cancel()  # before the transfer task has had a chance to run
    with pytest.raises(transport.TransferAbortedError) as info:
        await h
    assert info.value.partial is False
    assert not dst.any()


async def test_cancel_in_flight_is_never_silent(pair):
    a, b = pair
    n = 256 << 20
    dst = torch.zeros(n, dtype=torch.uint8)
    b.register("c", dst)
    await a.peer("b", regions=["c"])
    src = torch.full((n,), 7, dtype=torch.uint8)
    outcomes = set()
    for delay in (0.0005, 0.002, 0.01):
        h = a.put(src, "b", key="c")
        await anyio.sleep(delay)
        h.cancel()
        try:
            await h
            outcomes.add("completed")
            assert torch.equal(dst, src)
        except transport.TransferAbortedError:
            outcomes.add("aborted")
        assert h.done()
    # Afterwards the pair still works and a complete write defines the contents again.
    await a.put(src, "b", key="c")
    assert torch.equal(dst, src)
    assert outcomes


async def test_cancelling_the_awaiting_task_cancels_the_transfer(pair):
    a, b = pair
    dst = torch.zeros(1 << 20)
    b.register("c", dst)
    await a.peer("b", regions=["c"])
    h = a.put(torch.ones(1 << 20), "b", key="c")
    with anyio.move_on_after(0):
        await h
    with anyio.fail_after(10):
        while not h.done():
            await anyio.sleep(0.001)
    assert h.exception() is None or isinstance(h.exception(), transport.TransferAbortedError)


async def test_transfer_handle_fields(pair, backend):
    a, b = pair
    b.register("f", torch.zeros(100))
    await a.peer("b", regions=["f"])
    h = a.put(torch.ones(10), "b", key="f", offset=40)
    assert (h.peer, h.key, h.nbytes, h.offset) == ("b", "f", 40, 40)
    await h
    assert h.backend == backend and h.done() and h.elapsed >= 0
    assert "done" in repr(h)


async def test_fence_waits_for_earlier_puts(pair):
    a, b = pair
    dst = torch.zeros(8, 1 << 18)
    b.register("fe", dst)
    await a.peer("b", regions=["fe"])
    hs = [a.put(torch.full((1 << 18,), float(i)), "b", key="fe", offset=i * (1 << 20)) for i in range(8)]
    await a.fence("b")
    assert all(h.done() for h in hs)
    assert torch.equal(dst, torch.arange(8.0).unsqueeze(1).expand(8, 1 << 18))


async def test_fence_reports_an_earlier_failure(pair):
    a, b = pair
    b.register("ff", torch.zeros(4))
    await a.peer("b", regions=["ff"])
    a.put(torch.zeros(8), "b", key="ff")  # out of bounds, not awaited
    with pytest.raises(transport.BoundsError):
        await a.fence("b")


async def test_unregister_withdraws_the_region(pair):
    a, b = pair
    b.register("u", torch.zeros(4))
    await a.peer("b", regions=["u"])
    await a.put(torch.ones(4), "b", key="u")
    b.unregister("u")
    with pytest.raises(transport.RegistrationError):
        await a.put(torch.ones(4), "b", key="u")
    with pytest.raises(transport.RegistrationError):
        b.unregister("u")


async def test_register_many_and_reregistration_is_seen(pair):
    a, b = pair
    sd = {"l1.w": torch.zeros(3, 4), "l1.b": torch.zeros(4), "l2.w": torch.zeros(4, 2, dtype=torch.bfloat16)}
    regions = b.register_many(sd, prefix="policy.")
    assert set(regions) == {"policy.l1.w", "policy.l1.b", "policy.l2.w"}
    peer = await a.peer("b", regions=list(regions))
    assert peer.regions["policy.l2.w"].dtype == "bfloat16"
    assert peer.regions["policy.l1.w"].shape == (3, 4)
    # Re-register with a larger tensor: the initiator's cached record is refreshed on demand.
    b.unregister("policy.l1.b")
    bigger = torch.zeros(16)
    b.register("policy.l1.b", bigger)
    await a.put(torch.ones(16), "b", key="policy.l1.b")
    assert bigger.sum() == 16


async def test_registration_errors(pair):
    _, b = pair
    with pytest.raises(transport.RegistrationError, match="contiguous"):
        b.register("nc", torch.zeros(4, 4).t())
    b.register("dup", torch.zeros(1))
    with pytest.raises(transport.RegistrationError, match="already"):
        b.register("dup", torch.zeros(1))
    with pytest.raises(transport.RegistrationError):
        b.register("", torch.zeros(1))
    with pytest.raises(transport.RegistrationError, match="already"):
        b.register_many({"fresh": torch.zeros(1), "dup": torch.zeros(1)})
    assert "fresh" not in b.regions, "a failed register_many must register nothing"
    with pytest.raises(TypeError):
        b.register("t", [1, 2, 3])  # type: ignore[arg-type]


async def test_empty_allocates_registered_shareable_memory(pair):
    a, b = pair
    t = b.empty("shm", (16, 16), torch.bfloat16)
    assert t.shape == (16, 16) and t.dtype == torch.bfloat16 and not t.float().any()
    await a.peer("b", regions=["shm"])
    src = torch.randn(16, 16).to(torch.bfloat16)
    await a.put(src, "b", key="shm")
    assert same_bytes(t, src)
