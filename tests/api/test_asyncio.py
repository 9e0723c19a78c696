"""The asyncio subset: the same scenarios, run by asyncio.run instead of trio (vLLM/Ray users)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

import transport
from tests._support import scenarios


def run_pair(backend: str, scenario, *args) -> None:
    async def main() -> None:
        store = f"memory://{uuid.uuid4().hex}"
        async with transport.Transport("a", store=store, backends=(backend,), timeout=20) as a:
            async with transport.Transport("b", store=store, backends=(backend,), timeout=20) as b:
                await asyncio.wait_for(scenario(a, b, *args), timeout=60)

    asyncio.run(main())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool], ids=str)
def test_roundtrip(backend, dtype):
    run_pair(backend, scenarios.roundtrip, dtype, 100_003)


def test_many_in_flight(backend):
    run_pair(backend, scenarios.many_in_flight)


def test_signal_after_puts(backend):
    run_pair(backend, scenarios.signal_after_puts)


def test_error_cases(backend):
    run_pair(backend, scenarios.error_cases)


def test_cancel_through_asyncio_timeout(backend):
    async def scenario(a, b):
        dst = torch.zeros(64 << 20, dtype=torch.uint8)
        b.register("c", dst)
        await a.peer("b", regions=["c"])
        h = a.put(torch.ones(64 << 20, dtype=torch.uint8), "b", key="c")
        try:
            await asyncio.wait_for(h.wait(), timeout=0)
        except (asyncio.TimeoutError, transport.TransferAbortedError):
            pass
        while not h.done():
            await asyncio.sleep(0.001)
        assert h.exception() is None or isinstance(h.exception(), transport.TransferAbortedError)
        await a.put(torch.ones(64 << 20, dtype=torch.uint8), "b", key="c")
        assert bool((dst == 1).all())

    run_pair(backend, scenario)
