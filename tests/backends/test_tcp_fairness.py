"""A peer that stops reading holds up nobody else's tcp transfers.

Staged frames (many small runs packed into one buffer) borrow a staging buffer while they are
sent. The buffers were one pool of four per Transport: a peer that stopped reading (SIGSTOP)
held all four, and every staged transfer to every other peer waited until the stalled one was
given up on (a trainer's relay pushes to one host waited for a stopped relay on another). Now a
frame waits only for its own peer's frames.

Real processes: two targets, one stopped; the staged put to the live one must complete while
the put to the stopped one is still pending (no timing threshold: the order of events is what
is checked)."""

from __future__ import annotations

import os
import signal

import anyio
import numpy as np
import torch

import transport
from tests._support import serving_target

RUN = 4 << 10  # staged runs (STAGE_RUN_MAX is 64 KiB)
TOTAL = 24 << 20  # six staged frames of 4 MiB per transfer
STALLED = 3  # transfers to the stopped peer at once: their frames in flight outnumber the old pool's four buffers


def runs() -> np.ndarray:
    """Every other RUN of a 2*TOTAL region: runs that cannot coalesce."""
    n = TOTAL // RUN
    src = np.arange(n, dtype=np.int64) * RUN
    return np.stack([src, 2 * src, np.full(n, RUN, dtype=np.int64)], axis=1)


async def test_a_stopped_peer_does_not_hold_staged_transfers_to_others(file_store, targets):
    regions = [{"key": f"w{i}", "numel": 2 * TOTAL, "dtype": "uint8"} for i in range(STALLED)]
    async with transport.Transport("init", store=file_store, backends=("tcp",), timeout=30) as t:
        stalled = await serving_target(t, targets, file_store, "tcp", regions, name="stalled")
        await serving_target(t, targets, file_store, "tcp", regions, name="live")
        src = torch.randint(0, 256, (TOTAL,), dtype=torch.uint8)
        to_stalled = [t.prepare_put_runs("stalled", src, f"w{i}", runs()) for i in range(STALLED)]
        to_live = t.prepare_put_runs("live", src, "w0", runs())
        await to_live.start()  # both connections open, the frames built
        await to_stalled[0].start()
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        try:
            pending = [p.start(timeout=20) for p in to_stalled]
            await anyio.sleep(0.5)  # their frames take their buffers and fill the socket
            live = to_live.start(timeout=20)
            await live
            assert not any(p.done() for p in pending), "a put to the stopped peer ended: the test proves nothing"
            back = torch.zeros(2 * TOTAL, dtype=torch.uint8)
            await t.get(back, "live", key="w0")
            assert torch.equal(back.view(-1, 2 * RUN)[:, :RUN].reshape(-1), src)
        finally:
            os.kill(stalled.proc.pid, signal.SIGCONT)
        for p in pending:
            p.cancel()
