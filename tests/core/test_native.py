"""The native core directly: copy engine, shareable buffers, CMA probe."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess

import anyio
import pytest
import torch

import transport
from transport import _native
from transport._native import Copier, CopyKind, CopyStatus, PeerMapping, load

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


async def test_a_large_local_job_streams_every_byte_into_place():
    # A local job of 16 MiB or more is copied with streaming stores: destinations at every
    # alignment, odd lengths, pieces under the 4 KiB streaming minimum, and pieces cut at the
    # copier's 1 MiB chunks; the bytes around each destination stay as they were.
    rng = torch.Generator().manual_seed(7)
    src = torch.randint(0, 256, (20 << 20,), dtype=torch.uint8, generator=rng)
    dst = torch.full((21 << 20,), 0xAB, dtype=torch.uint8)
    segments, expect, s_off, d_off = [], dst.clone(), 0, 0
    for n in [1, 31, 33, 4095, 4097, 65_537, (3 << 20) + 129, 17, 127, (1 << 20) - 1, 12 << 20]:
        d_off += 1 + n % 61  # a gap, and every alignment of the destination
        s_off += n % 13
        segments.append((dst.data_ptr() + d_off, src.data_ptr() + s_off, n))
        expect[d_off : d_off + n] = src[s_off : s_off + n]
        d_off, s_off = d_off + n, s_off + n
    assert sum(n for *_, n in segments) >= 16 << 20  # the streaming path

    async def body(copier):
        r = await copier.copy(CopyKind.LOCAL, 0, segments)
        assert r.status == CopyStatus.OK and r.nbytes == sum(n for *_, n in segments)

    await with_copier(body)
    assert torch.equal(dst, expect)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


async def test_copy_engine_reports_a_dead_process():
    pid = dead_pid()
    src = torch.ones(16, dtype=torch.uint8)

    async def body(copier):
        r = await copier.copy(CopyKind.CMA_WRITE, pid, [(0x1000, src.data_ptr(), 16)])
        assert r.status == CopyStatus.FAILED and r.err == errno.ESRCH

    await with_copier(body)


async def test_a_copy_plan_is_cut_once_and_runs_again_and_again_also_twice_at_once():
    """A plan (what a prepared ipc transfer keeps) is cut at the engine's chunk size and grouped
    once; each run copies the bytes as they are then, two runs of one plan may overlap, and a
    plan outlives the Python names of what it was made from."""
    n_runs, run = 1536, 512  # runs of 512 B at a 1 KiB stride, plus one of 3 MiB (three 1 MiB chunks)
    src = torch.zeros(5 << 20, dtype=torch.uint8)
    dst = [torch.zeros_like(src) for _ in range(2)]
    idx = torch.arange(n_runs, dtype=torch.int64)

    def rows(d: torch.Tensor) -> bytes:
        table = torch.stack([d.data_ptr() + idx * 1024, src.data_ptr() + idx * 1024, torch.full_like(idx, run)], 1)
        big = torch.tensor([[d.data_ptr() + (1 << 20) * 3 // 2, src.data_ptr() + (1 << 20) * 3 // 2, 3 << 20]])
        return _native.pack_segments([tuple(int(v) for v in r) for r in torch.cat([table, big])])

    async def body(copier):
        plans = [copier.plan(CopyKind.LOCAL, 0, rows(d)) for d in dst]
        assert plans[0].segments == 1536 + 3 and plans[0].nbytes == 1536 * run + (3 << 20)
        for step in (1, 2):
            src.fill_(step)
            results: list = [None, None]

            async def one(i: int, results: list = results) -> None:
                results[i] = await copier.copy_plan(plans[i])

            async with anyio.create_task_group() as tg:  # both at once, and the first one twice
                tg.start_soon(one, 0)
                tg.start_soon(one, 1)
            again = await copier.copy_plan(plans[0])
            for r in (*results, again):
                assert r.status == CopyStatus.OK and r.nbytes == plans[0].nbytes
            for d in dst:
                assert torch.all(d[:512] == step) and torch.all(d[(1 << 20) * 3 // 2:(1 << 20) * 9 // 2] == step)
                assert int(d[512:1024].sum()) == 0  # between two runs: never written
        tiny = copier.plan(CopyKind.LOCAL, 0, rows(dst[0])[:24 * 4])  # 4 runs: copied right here
        src.fill_(7)
        r = await copier.copy_plan(tiny)
        assert r.status == CopyStatus.OK and r.nbytes == 4 * run and int(dst[0][3 * 1024]) == 7
        with pytest.raises(ValueError, match="whole number"):
            copier.plan(CopyKind.LOCAL, 0, b"\0" * 20)

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


def test_peer_mapping_refuses_a_file_that_could_fault_its_reads():
    """A hostile peer publishes a descriptor of its own: a file shorter than the mapping, or a
    memfd it can still shrink, would make our loads SIGBUS. Only a size-sealed memfd that covers
    the mapping is mapped."""
    short = os.memfd_create("short", os.MFD_ALLOW_SEALING)
    unsealed = os.memfd_create("unsealed")
    sealed_short = os.memfd_create("sealed-short", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(short, 100)  # mapping 4096 bytes of it: reads past 100 bytes fault
        fcntl.fcntl(short, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        os.ftruncate(unsealed, 4096)
        os.ftruncate(sealed_short, 0)
        fcntl.fcntl(sealed_short, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        for fd in (short, unsealed, sealed_short):
            with pytest.raises(RuntimeError, match="size-sealed memfd"):
                PeerMapping(os.getpid(), fd, 4096, False)
    finally:
        for fd in (short, unsealed, sealed_short):
            os.close(fd)
    buf = _native.shared_buffer(4096, "t")  # ours: sealed by construction
    assert PeerMapping(os.getpid(), buf.fd, 4096, False).read_u64() == 0


def test_cma_probe():
    assert C.cma_probe(os.getpid(), C.probe_address(), 1) == 0
    assert C.cma_probe(dead_pid(), C.probe_address(), 1) == errno.ESRCH


def test_typed_wrappers_share_a_word_between_a_buffer_and_a_peers_mapping():
    buf = _native.shared_buffer(8192, "t")
    view = PeerMapping(os.getpid(), buf.fd, 8192, False)  # what a same-host peer does
    assert view.nbytes == 8192 and view.address != buf.address
    buf.write_u64(8, 0x0123_4567_89AB_CDEF)
    assert view.read_u64(8) == 0x0123_4567_89AB_CDEF and view.read_u64() == 0
    assert torch.from_dlpack(buf.array())[8] == 0xEF  # little-endian: the array sees the same bytes
    for bad in (-8, 4, 8192):
        with pytest.raises(ValueError, match="aligned 8-byte word"):
            view.read_u64(bad)
        with pytest.raises(ValueError, match="aligned 8-byte word"):
            buf.write_u64(bad, 1)
    with pytest.raises(RuntimeError, match="No such file"):
        PeerMapping(os.getpid(), 99_999, 10, True)


def test_typed_copy_functions():
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    assert _native.copy_now(CopyKind.CMA_READ, os.getpid(), dst.data_ptr(), src.data_ptr(), 64) == 0
    assert torch.equal(dst, src)
    _native.memory_fence()
    assert _native.cma_probe(os.getpid(), _native.probe_address()) == 0


def test_extension_loads_lazily_and_is_typed_through_one_name():
    from transport._native._extension import _C

    assert _native.unavailable_reason() is None
    assert _C.copy_now is load().copy_now  # the stand-in hands out the extension's own objects
    assert os.path.samefile(_native.extension_path(), load().__file__)
    with pytest.raises(AttributeError):
        _C.__wrapped__  # noqa: B018 -- introspection does not load anything


def test_ipc_probe_from_an_unrelated_child():
    probe = _native.probe_ipc(timeout=30)
    assert isinstance(probe, _native.IpcProbe)
    assert probe.cma_errno in (0, errno.EPERM)
    assert probe.mapping_error is None or isinstance(probe.mapping_error, str)


def test_ucx_library_is_found_or_says_why():
    path, version, why = _native.ucx.library()
    assert (path is not None and version is not None and why is None) or (path is None and why)
    if path is not None:
        assert "Success" in _native.ucx.status_string(0)
    assert issubclass(_native.cuda.CudaError, transport.TransportInternalError)
