"""What an ended transfer reports is true: ``partial`` whenever bytes may still land, and
``ClosedError`` when we closed, against real target processes (tests/peers/peer_target.py).

Before: a prepared tcp put of 512 x 64 KiB to a target SIGSTOPped after its frames began timed
out with ``partial=False`` although the resumed target then wrote a third of them; and closing
a Transport with prepared puts in flight ended some with PeerLostError (and "peer ... lost").
"""

from __future__ import annotations

import logging
import os
import signal

import anyio
import pytest
import torch

import transport
from tests._support import serving_target

SEG = 64 << 10
NSEG = 512


def segments(src: torch.Tensor) -> list[tuple[torch.Tensor, str, int]]:
    return [(src[i * SEG : (i + 1) * SEG], "w", i * SEG) for i in range(NSEG)]


async def test_a_prepared_tcp_put_cut_by_a_stopped_target_says_partial(targets, file_store):
    async with transport.Transport("init", store=file_store, backends=("tcp",), timeout=30) as t:
        target = await serving_target(t, targets, file_store, "tcp",
                                      [{"key": "w", "numel": SEG * NSEG, "dtype": "uint8"}])
        src = torch.randint(0, 256, (SEG * NSEG,), dtype=torch.uint8)
        prepared = t.prepare_put(target.name, segments(src))
        await prepared.start()  # the connection is up: the next start's frames go out at once
        os.kill(target.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(transport.TransferTimeoutError) as err:
                await prepared.start(timeout=2)
            assert err.value.partial, f"a timed-out put whose frames were on the wire said partial=False: {err.value}"
        finally:
            os.kill(target.proc.pid, signal.SIGCONT)


@pytest.mark.parametrize("backend", ["tcp", "ucx"])
async def test_closing_with_prepared_puts_in_flight_is_closed_error(targets, file_store, backend, caplog):
    caplog.set_level(logging.WARNING, logger="transport")
    handles = []
    async with transport.Transport("init", store=file_store, backends=(backend,), timeout=30) as t:
        target = await serving_target(t, targets, file_store, backend,
                                      [{"key": "w", "numel": SEG * NSEG, "dtype": "uint8"}])
        src = torch.randint(0, 256, (SEG * NSEG,), dtype=torch.uint8)
        prepared = t.prepare_put(target.name, segments(src))
        await prepared.start()
        if backend == "tcp":
            os.kill(target.proc.pid, signal.SIGSTOP)  # its socket buffers fill: the puts stay in flight
        handles = [prepared.start() for _ in range(20)]  # they overlap: each waits for the one before
        await anyio.sleep(0.005)  # the first is moving when we close
    try:
        outcomes = []
        for h in handles:
            try:
                await h
                outcomes.append("done")
            except transport.TransportError as exc:
                outcomes.append(type(exc).__name__)
        assert set(outcomes) <= {"done", "ClosedError"}, outcomes
        assert "ClosedError" in outcomes, outcomes
        lost = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
        assert not lost, lost
    finally:
        if backend == "tcp":
            os.kill(target.proc.pid, signal.SIGCONT)
