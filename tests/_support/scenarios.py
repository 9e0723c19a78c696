"""Backend-agnostic scenarios written with anyio, run under trio and under asyncio.

Each takes an initiator ``a`` and a target ``b`` (both open Transports in this process that
share a store), so the target's memory can be inspected directly after every operation.
"""

from __future__ import annotations

import anyio
import torch

import transport
from transport._conformance import warm_sync_route
from transport.backends import Backend, backend_class

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int64, torch.bool]


def random_tensor(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(low, high, (n,), generator=g, dtype=torch.int64).to(dtype)


def same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return (
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(x.view(torch.uint8) if x.numel() else x, y.view(torch.uint8) if y.numel() else y)
    )


async def roundtrip(
    a: transport.Transport, b: transport.Transport, dtype: torch.dtype, numel: int, seed: int = 0
) -> str:
    """put random data into b's region, check b's memory, get it back; returns the backend used."""
    dst = torch.zeros(numel, dtype=dtype)
    b.register("r", dst)
    await a.peer("b", regions=["r"])
    src = random_tensor(numel, dtype, seed)
    h = a.put(src, "b", key="r")
    await h
    assert h.done() and h.exception() is None
    assert h.nbytes == src.numel() * src.element_size()
    assert same_bytes(dst, src), "target memory differs from what was put"
    back = torch.empty(numel, dtype=dtype)
    await a.get(back, "b", key="r")
    assert same_bytes(back, src), "get returned different bytes"
    return h.backend or ""


async def many_in_flight(a: transport.Transport, b: transport.Transport, count: int = 128, chunk: int = 4096) -> None:
    dst = torch.zeros(count * chunk, dtype=torch.int64)
    b.register("many", dst)
    await a.peer("b", regions=["many"])
    srcs = [torch.full((chunk,), i + 1, dtype=torch.int64) for i in range(count)]
    synchronous = backend_class(a.backends[0]).mover is not Backend.mover  # ipc, ucx same host, tcp
    if synchronous:
        await warm_sync_route(a, "b", srcs[0], "many")
    handles = [a.put(s, "b", key="many", offset=i * chunk * 8) for i, s in enumerate(srcs)]
    if synchronous:
        # Small host puts on a known route complete inside put() (a ucx one that the lane does not
        # finish within its bound goes the asynchronous way, hence "most").
        assert sum(h.done() for h in handles) > count // 2, "small puts should complete inside put()"
    else:
        assert sum(not h.done() for h in handles) > 100, "transfers should be in flight concurrently"
    await transport.gather(*handles)
    expected = torch.arange(1, count + 1, dtype=torch.int64).repeat_interleave(chunk)
    assert torch.equal(dst, expected)


async def signal_after_puts(a: transport.Transport, b: transport.Transport, count: int = 32) -> None:
    """The doorbell is visible only after every earlier put: puts are not awaited before it."""
    n = 1 << 18
    dst = torch.zeros(count * n, dtype=torch.float32)
    b.register("sig", dst)
    await a.peer("b", regions=["sig"])
    for i in range(count):
        a.put(torch.full((n,), float(i + 1)), "b", key="sig", offset=i * n * 4)
    seen = {}

    async def target() -> None:
        seen["v"] = await b.wait_signal("version", at_least=7, timeout=20)
        seen["data"] = dst.clone()  # what the target sees the moment the doorbell rings

    async with anyio.create_task_group() as tg:
        tg.start_soon(target)
        await a.signal("b", "version", 7)
    assert seen["v"] == 7
    expected = torch.arange(1, count + 1, dtype=torch.float32).repeat_interleave(n)
    assert torch.equal(seen["data"], expected), "signal became visible before the puts before it"
    assert b.signal_value("version") == 7


async def error_cases(a: transport.Transport, b: transport.Transport) -> None:
    """Every bad input raises its typed error and leaves the target memory as it was."""
    dst = torch.arange(1024, dtype=torch.float32)
    ro = torch.arange(16, dtype=torch.float32)
    b.register("e", dst)
    b.register("ro", ro, writable=False)
    await a.peer("b", regions=["e", "ro"])
    before, ro_before = dst.clone(), ro.clone()
    src = torch.ones(16, dtype=torch.float32)
    cases = [
        (transport.BoundsError, lambda: a.put(src, "b", key="e", offset=1024 * 4 - 8)),
        (transport.BoundsError, lambda: a.put(torch.ones(2048), "b", key="e")),
        (transport.BoundsError, lambda: a.put(src, "b", key="e", offset=-4)),
        (transport.BoundsError, lambda: a.put(src, "b", key="e", offset=2)),  # misaligned
        (transport.DTypeMismatchError, lambda: a.put(src.double(), "b", key="e")),
        (transport.DTypeMismatchError, lambda: a.put(src.to(torch.bfloat16), "b", key="e")),
        (transport.RegistrationError, lambda: a.put(src, "b", key="no-such-key")),
        (transport.RegistrationError, lambda: a.put(src, "b")),  # src not registered, no key
        (transport.ReadOnlyRegionError, lambda: a.put(src, "b", key="ro")),
        (transport.PeerNotFoundError, lambda: a.put(src, "nobody", key="e")),
        (transport.BoundsError, lambda: a.get(torch.empty(2048), "b", key="e")),
        (transport.DTypeMismatchError, lambda: a.get(torch.empty(4, dtype=torch.int32), "b", key="e")),
        (transport.LayoutError, lambda: a.get(torch.empty(8, 8)[:, ::2], "b", key="e")),
        (transport.RegistrationError, lambda: a.get(torch.empty(4), "b", key="nope")),
    ]
    for i, (exc_type, op) in enumerate(cases):
        try:
            await op()
        except exc_type as exc:
            assert str(exc), f"case {i}: empty message"
        else:
            raise AssertionError(f"case {i}: expected {exc_type.__name__}")
        assert torch.equal(dst, before), f"case {i} changed the target region"
        assert torch.equal(ro, ro_before), f"case {i} changed the read-only region"
    # Reading a read-only region is fine.
    out = torch.empty(16)
    await a.get(out, "b", key="ro")
    assert torch.equal(out, ro)
