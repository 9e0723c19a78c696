"""``writable=False`` against an initiator that ignores it, wherever the OS or the transport can
enforce it: tcp (the target's agent checks), ucx (read-only alias mapping: UCX's cma transport
fails with EFAULT) and ipc (sealed memfd, read-only alias for cross-memory attach).

The attacker is honest about what it bypasses: it calls the backend object directly with a copy
of the published region record that says ``writable=True`` (the Transport's front-end check
never runs), or, on ipc, opens the target's memfd through ``/proc/<pid>/fd`` itself and writes
by ``process_vm_writev`` to the published address. The target is a separate process
(tests/peers/readonly_target.py); its bytes are checked after every attack, by a get and by the
target's own hash of its memory at the end.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import gc
import hashlib
import json
import mmap
import os
import subprocess
from pathlib import Path

import anyio
import pytest
import torch

import transport
from tests._support import PYTHON, ROOT, python_env
from tests.peers.readonly_target import VIEW, N, pattern
from transport import _native
from transport._native import CopyKind, copy_now
from transport._tensors import LocalBuffer, MemoryKind, RemoteTarget
from transport._wire import PeerRecord, TransferOp
from transport.backends.ipc import _REGION as IPC_REGION
from transport.backends.ucx import UcxBackend

needs_ucx = pytest.mark.skipif(
    UcxBackend.unavailable_reason() is not None, reason=f"ucx unavailable: {UcxBackend.unavailable_reason()}"
)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

# The regions' contents as the target fills them (salt = position in readonly_target's dict).
SALT = {"ro_shm": 0, "ro_plain": 1, "rw_shm": 2, "ro2": 3}


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


class ReadonlyTarget:
    """A running tests/peers/readonly_target.py, always reaped."""

    def __init__(self, tmp: Path, name: str, store: str, backends: list[str]) -> None:
        self.out = str(tmp / f"{name}.json")
        spec = {"name": name, "store": store, "backends": backends, "initiator": "attacker", "out": self.out}
        self.proc = subprocess.Popen([PYTHON, "-m", "tests.peers.readonly_target", json.dumps(spec)], env=python_env(),
                                     cwd=ROOT, stderr=subprocess.PIPE)

    async def result(self, timeout: float = 60) -> dict[str, str]:
        with anyio.fail_after(timeout):
            while self.proc.poll() is None:
                await anyio.sleep(0.02)
        assert self.proc.returncode == 0, self.proc.stderr.read().decode()[-3000:]  # type: ignore[union-attr]
        return json.loads(Path(self.out).read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc.stderr.close()  # type: ignore[union-attr]


@pytest.fixture
def readonly_target(tmp_path):
    made: list[ReadonlyTarget] = []

    def make(store: str, backends: list[str]) -> ReadonlyTarget:
        made.append(ReadonlyTarget(tmp_path, "owner", store, backends))
        return made[-1]

    yield make
    for t in made:
        t.close()


async def _connect(t: transport.Transport) -> tuple[int, PeerRecord]:
    pid = await t.wait_signal("ready", timeout=60)
    peer = await t.peer("owner", regions=["ro_shm", "ro_plain", "rw_shm", "ro2", "rw_view"])
    return pid, peer._record


async def _ignore_the_flag(t: transport.Transport, backend: str, record: PeerRecord, key: str) -> None:
    """A put into ``key`` straight through the backend, with a record that says it is writable."""
    region = dataclasses.replace(record.regions[key], writable=True)
    src = torch.full((region.nbytes,), 0xEE, dtype=torch.uint8)
    remote = RemoteTarget(record, region, 0, region.nbytes)
    (b,) = [b for b in t._backends if b.name == backend]
    with anyio.fail_after(20):
        await b.move(TransferOp.PUT, LocalBuffer(src, MemoryKind.CPU), remote)


async def _check_reads_and_writes(t: transport.Transport, backend: str) -> None:
    """Gets from read-only regions work, the front-end refuses puts into them, writable regions
    take puts: no regression."""
    for key in ("ro_shm", "ro_plain"):
        back = torch.zeros(N, dtype=torch.uint8)
        h = t.get(back, "owner", key=key)
        await h
        assert h.backend == backend
        assert torch.equal(back, pattern(N, SALT[key])), key
        with pytest.raises(transport.ReadOnlyRegionError):
            await t.put(back, "owner", key=key)
    src = pattern(N, 99)
    h = t.put(src, "owner", key="rw_shm")
    await h
    assert h.backend == backend
    back = torch.zeros(N, dtype=torch.uint8)
    await t.get(back, "owner", key="rw_shm")
    assert torch.equal(back, src)


async def _unchanged(t: transport.Transport, key: str) -> None:
    back = torch.zeros(N, dtype=torch.uint8)
    await t.get(back, "owner", key=key)
    assert torch.equal(back, pattern(N, SALT[key])), f"{key} was written"


# -- the native layer, in this process ----------------------------------------------------------


def test_a_read_only_buffer_is_sealed_for_everyone_but_its_own_mapping():
    buf = _native.shared_buffer(3 * 4096 + 5, "ro", read_only=True)
    assert buf.sealed
    ctypes.memset(buf.address, 0x5A, buf.nbytes)  # the owner's mapping stays writable
    fd = os.open(f"/proc/self/fd/{buf.fd}", os.O_RDWR)  # opening is allowed; writing is not
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        ro = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ)  # reading is
        assert ro[:2] == b"ZZ"
        ro.close()
    finally:
        os.close(fd)
    with pytest.raises(RuntimeError, match="Operation not permitted"):
        _native.PeerMapping(os.getpid(), buf.fd, 4096, writable=True)  # what a peer's ipc backend does


def test_the_read_only_alias_refuses_cross_memory_writes():
    buf = _native.shared_buffer(8192, "rw")
    ctypes.memset(buf.address, 1, 8192)
    alias = buf.read_only_address
    assert alias != buf.address and ctypes.string_at(alias, 4) == b"\x01" * 4
    src = torch.full((8,), 7, dtype=torch.uint8)
    assert copy_now(CopyKind.CMA_WRITE, os.getpid(), alias, src.data_ptr(), 8) == errno.EFAULT
    assert copy_now(CopyKind.CMA_WRITE, os.getpid(), buf.address, src.data_ptr(), 8) == 0  # the real one is writable
    assert ctypes.string_at(alias, 8) == b"\x07" * 8  # the same bytes
    assert not buf.sealed
    buf.seal_writes()
    buf.seal_writes()  # idempotent
    assert buf.sealed


def test_every_shared_buffer_has_a_sealed_size():
    buf = _native.shared_buffer(4096, "size")
    fd = os.open(f"/proc/self/fd/{buf.fd}", os.O_RDWR)
    try:
        for size in (0, 1 << 20):  # shrinking would make the owner's mapping raise SIGBUS
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
    finally:
        os.close(fd)


# -- per backend, against a separate target process ---------------------------------------------


async def test_tcp_agent_refuses_a_put_that_ignores_the_flag(readonly_target, file_store):
    target = readonly_target(file_store, ["tcp"])
    async with transport.Transport("attacker", store=file_store, backends=("tcp",), timeout=20) as t:
        _pid, record = await _connect(t)
        await _check_reads_and_writes(t, "tcp")
        for key in ("ro_shm", "ro_plain"):
            with pytest.raises(transport.ReadOnlyRegionError):
                await _ignore_the_flag(t, "tcp", record, key)
            await _unchanged(t, key)
        await t.signal("owner", "done", 1)
        info = await target.result()
    assert info["ro_shm"] == sha(pattern(N, 0)) and info["ro_plain"] == sha(pattern(N, 1))


@needs_ucx
async def test_ucx_put_through_the_published_rkey_fails_on_a_read_only_buffer(readonly_target, file_store):
    target = readonly_target(file_store, ["ucx", "tcp"])
    async with transport.Transport("attacker", store=file_store, backends=("ucx",), timeout=20) as t:
        _pid, record = await _connect(t)
        await _check_reads_and_writes(t, "ucx")
        # Last: UCX fails the endpoint with the put, so this Transport's link to the owner is gone.
        with pytest.raises(transport.TransportError):
            await _ignore_the_flag(t, "ucx", record, "ro_shm")
    async with transport.Transport("attacker", store=file_store, backends=("ucx",), timeout=20) as t:
        await _unchanged(t, "ro_shm")
        await t.signal("owner", "done", 1)
        info = await target.result()
    assert info["ro_shm"] == sha(pattern(N, 0))


async def test_ipc_memfd_and_cross_memory_attach_refuse_writes_into_a_read_only_buffer(readonly_target, file_store):
    target = readonly_target(file_store, ["ipc"])
    async with transport.Transport("attacker", store=file_store, backends=("ipc",), timeout=20) as t:
        pid, record = await _connect(t)
        await _check_reads_and_writes(t, "ipc")

        # 1. The backend, told the region is writable: the memfd cannot be mapped writable, and
        #    cross-memory attach to the published address fails.
        with pytest.raises(transport.ReadOnlyRegionError, match="read-only"):
            await _ignore_the_flag(t, "ipc", record, "ro_shm")
        await _unchanged(t, "ro_shm")

        # 2. By hand: the published memfd, opened read-write through /proc.
        address, nbytes, fd, offset, _inode = IPC_REGION.unpack(record.regions["ro_shm"].descriptors["ipc"])
        assert fd >= 0 and offset == 0 and nbytes == N
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(f, N, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(f, b"\xee" * 64, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(f, 0)
            # Mapped read-only first, then made writable: refused too.
            p = _libc.mmap(None, N, mmap.PROT_READ, mmap.MAP_SHARED, f, 0)
            assert p not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
            try:
                assert ctypes.string_at(p, 16) == pattern(N, 0)[:16].numpy().tobytes()
                assert _libc.mprotect(p, N, mmap.PROT_READ | mmap.PROT_WRITE) == -1
                assert ctypes.get_errno() == errno.EACCES
            finally:
                _libc.munmap(p, N)
        finally:
            os.close(f)

        # 3. By hand: process_vm_writev to the published address.
        src = torch.full((64,), 0xEE, dtype=torch.uint8)
        assert copy_now(CopyKind.CMA_WRITE, pid, address, src.data_ptr(), 64) == errno.EFAULT
        await _unchanged(t, "ro_shm")

        # A writable region registered over a sealed buffer degrades to cross-memory attach.
        assert IPC_REGION.unpack(record.regions["rw_view"].descriptors["ipc"])[2] == -1
        h = t.put(torch.full((VIEW,), 0xAB, dtype=torch.uint8), "owner", key="rw_view")
        await h
        assert h.backend == "ipc"
        await t.signal("owner", "done", 1)
        info = await target.result()
    assert info["ro_shm"] == sha(pattern(N, 0))
    expected_ro2 = pattern(N, 3)
    expected_ro2[:VIEW] = 0xAB
    assert info["ro2"] == sha(expected_ro2)


async def test_ipc_maps_a_region_anew_when_it_is_registered_again_elsewhere(memory_store):
    """The same key in a new buffer, under the memfd number and at the address of the old one,
    and now writable: the initiator's cached read-only mapping of the old memfd must not be used
    (that put would land in freed memory, or fault in the read-only mapping)."""
    async with transport.Transport("a", store=memory_store, backends=("ipc",), timeout=20) as a, \
            transport.Transport("b", store=memory_store, backends=("ipc",), timeout=20) as b:
        old = b.empty("k", 4096, torch.uint8, writable=False)
        old.fill_(1)
        back = torch.zeros(4096, dtype=torch.uint8)
        await a.peer("b", regions=["k"])
        await a.get(back, "b", key="k")  # maps the old memfd read-only
        assert int(back[0]) == 1
        b.unregister("k")
        del old
        gc.collect()  # frees the buffer: its memfd number (and often its address) is free again
        new = b.empty("k", 4096, torch.uint8)
        h = a.put(torch.full((4096,), 2, dtype=torch.uint8), "b", key="k")
        await h
        assert h.backend == "ipc"
        assert int(new[0]) == 2 and int(new[-1]) == 2
        b.unregister("k")  # and again, writable both times: only the memfd's inode tells them apart
        del new
        gc.collect()
        newer = b.empty("k", 4096, torch.uint8)
        await a.put(torch.full((4096,), 3, dtype=torch.uint8), "b", key="k")
        assert int(newer[0]) == 3 and int(newer[-1]) == 3


async def test_a_read_only_empty_buffer_is_sealed_at_creation_whatever_the_backends(memory_store):
    """Sealing does not wait for a backend to publish the buffer: a tcp-only Transport's
    read-only ``empty`` is sealed too, and its own writes still work."""
    async with transport.Transport("ro-tcp", store=memory_store, backends=("tcp",), timeout=10) as t:
        ro = t.empty("ro", 4096, torch.uint8, writable=False)
        assert t.regions["ro"].shared.sealed
        ro.fill_(7)  # the owner's mapping stays writable
        assert int(ro.sum()) == 7 * 4096
        t.empty("rw", 4096, torch.uint8)
        assert not t.regions["rw"].shared.sealed
