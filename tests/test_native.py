"""The native core directly: copy engine, shareable buffers, CMA probe."""

from __future__ import annotations

import errno
import os
import subprocess

import anyio
import pytest
import torch

from transport._native import Copier, CopyKind, CopyStatus, load

C = load()


async def with_copier(fn):
    copier = Copier(threads=2, chunk_bytes=1 << 20)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(copier.run)
            try:
                return await fn(copier)
            finally:
                tg.cancel_scope.cancel()
    finally:
        copier.close()


async def test_copy_engine_memcpy_and_cma_self():
    src = torch.randint(0, 256, (5 << 20,), dtype=torch.uint8)

    async def body(copier):
        for kind, pid in ((CopyKind.LOCAL, 0), (CopyKind.CMA_WRITE, os.getpid()), (CopyKind.CMA_READ, os.getpid())):
            dst = torch.zeros_like(src)
            r = await copier.copy(kind, pid, [(dst.data_ptr(), src.data_ptr(), src.numel())])
            assert r.status == CopyStatus.OK and r.nbytes == src.numel()
            assert torch.equal(dst, src)

    await with_copier(body)


async def test_copy_engine_reports_a_dead_process():
    proc = subprocess.Popen(["true"])
    proc.wait()
    src = torch.ones(16, dtype=torch.uint8)

    async def body(copier):
        r = await copier.copy(CopyKind.CMA_WRITE, proc.pid, [(0x1000, src.data_ptr(), 16)])
        assert r.status == CopyStatus.FAILED and r.err == errno.ESRCH

    await with_copier(body)


async def test_copy_engine_cancel_stops_between_chunks():
    src = torch.ones(256 << 20, dtype=torch.uint8)
    dst = torch.zeros_like(src)

    async def body(copier):
        with anyio.move_on_after(0):  # the job is submitted, then cancelled at once
            await copier.copy(CopyKind.LOCAL, 0, [(dst.data_ptr(), src.data_ptr(), src.numel())])
        # The cancelled copy stopped early: part of dst was never written.
        assert int(dst.sum()) < src.numel()

    await with_copier(body)


def test_shared_buffer_is_visible_through_proc_fd():
    buf = C.SharedBuffer(10_000, "t")
    t = torch.from_dlpack(buf.array())
    t[:] = 9
    m = C.PeerMapping(os.getpid(), buf.fd, 10_000, True)  # what a same-host peer does
    assert m.address != buf.address and m.nbytes == 10_000
    got = torch.zeros(10_000, dtype=torch.uint8)
    C.memcpy(got.data_ptr(), m.address, 10_000)
    assert bool((got == 9).all())
    with pytest.raises(RuntimeError, match="No such file"):
        C.PeerMapping(os.getpid(), 99_999, 10, True)


def test_cma_probe():
    assert C.cma_probe(os.getpid(), C.probe_address(), 1) == 0
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert C.cma_probe(proc.pid, C.probe_address(), 1) == errno.ESRCH
