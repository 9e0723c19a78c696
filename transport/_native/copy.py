"""Same-host memory: the native copy engine, shareable host buffers, peers' mappings and CMA.

The copy engine (``ipc``'s data path) runs copies on its own threads and reports completions
through an eventfd, which :meth:`Copier.run` waits on in the event loop (``anyio.wait_readable``),
so no thread polls and no Python runs on the native threads.
"""

from __future__ import annotations

import array
import ctypes
import enum
import errno
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus

from .._errors import TransportInternalError
from ._extension import _C

# The engine always finishes a job quickly once it is cancelled (at most one chunk per thread);
# this bounds the shielded wait for that, so a wedged engine cannot hang a close.
_ABORT_GRACE_S = 10.0
# Copies up to this size run inline on the event loop thread (a few microseconds at most).
INLINE_MAX_BYTES = 64 << 10

# One byte range to copy: (dst address, src address, nbytes). The one segment type of the host
# side: the copy engine's packed triples (csrc/copy_engine.h Segment) and the CUDA batched-copy
# kernel's table (csrc/kernels/transport_kernels.cu Segment) both lay its fields out in this order.
Segment = tuple[int, int, int]


class CopyKind(enum.IntEnum):
    """Where the two sides of a copy live (``CopyKind`` in csrc/copy_engine.h)."""

    LOCAL = 0  # both sides mapped here (memcpy)
    CMA_WRITE = 1  # dst lives in another process
    CMA_READ = 2  # src lives in another process


class CopyStatus(enum.IntEnum):
    """How a native job ended (``CopyStatus`` in csrc/copy_engine.h; the UCX engine's too)."""

    OK = 0
    FAILED = 1
    ABORTED = 2


@dataclass(frozen=True)
class CopyResult:
    """How a copy ended: ``err`` is the errno of its first failing chunk (0 if none), ``nbytes``
    the bytes of its completed chunks."""

    status: CopyStatus
    err: int
    nbytes: int

    def describe_errno(self) -> str:
        return f"{errno.errorcode.get(self.err, self.err)}: {os.strerror(self.err)}"


def pack_segments(segments: Sequence[Segment]) -> bytes:
    """``(dst, src, nbytes)`` segments in the engine's packed form (native-endian u64 triples)."""
    return array.array("Q", [v for seg in segments for v in seg]).tobytes()


def copy_now(kind: CopyKind, pid: int, dst: int, src: int, nbytes: int) -> int:
    """Copies ``nbytes`` from ``src`` to ``dst`` on the calling thread (the GIL released); for
    small copies only. ``pid`` is the other process of a CMA copy (0 for ``LOCAL``).

    Returns:
        0, or the errno of the failure (e.g. ``ESRCH``: the process is gone, ``EFAULT``: the
        range is not mapped there).
    """
    return _C.copy_now(int(kind), pid, dst, src, nbytes)


def stream_copy(dst: int, src: int, nbytes: int) -> None:
    """Copies ``nbytes`` from ``src`` to ``dst`` (no overlap) on the calling thread, the GIL
    released, with streaming stores that bypass the cache (x86-64; memcpy elsewhere): about 1.6x
    a memcpy for a copy far larger than the cache, slower for one that fits it or is read back
    soon. Ends with a store fence."""
    _C.stream_copy(dst, src, nbytes)


class RemoteWord:
    """An 8-byte buffer that reads one word of another process by cross-memory attach (e.g. a
    same-host peer's record seq), without a tensor per read."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = ctypes.c_uint64(0)

    def read(self, pid: int, address: int) -> int | None:
        """The word at ``address`` of process ``pid``, or None when it cannot be read."""
        if _C.copy_now(int(CopyKind.CMA_READ), pid, ctypes.addressof(self._buf), address, 8) != 0:
            return None
        return self._buf.value


def memory_fence() -> None:
    """A full (sequentially consistent) memory fence: orders this thread's store of a flag
    before its next load of another process's flag."""
    _C.memory_fence()


def cma_probe(pid: int, address: int, nbytes: int = 1) -> int:
    """Reads ``nbytes`` (at most 64) at ``address`` of process ``pid`` by cross-memory attach.

    Returns:
        0 when that worked, else the errno (``EPERM``: ptrace permission refused).
    """
    return _C.cma_probe(pid, address, nbytes)


def probe_address() -> int:
    """The address of a readable byte in this process: what a peer's :func:`cma_probe` reads."""
    return _C.probe_address()


def _check_word(offset: int, nbytes: int) -> None:
    if offset < 0 or offset % 8 or offset + 8 > nbytes:
        raise ValueError(f"no aligned 8-byte word at offset {offset} of {nbytes} bytes")


class _Mapped:
    """Host memory the extension mapped: its address and size here."""

    _native: _C.SharedBuffer | _C.PeerMapping

    @property
    def address(self) -> int:
        return self._native.address

    @property
    def nbytes(self) -> int:
        return self._native.nbytes


class SharedBuffer(_Mapped):
    """A zeroed, page-aligned host buffer in a memfd, which same-host peers map through
    ``/proc/<pid>/fd/<fd>`` (see :class:`PeerMapping`). Create it with :func:`shared_buffer`.

    The memory lives while this object or any array (or tensor) made by :meth:`array` does.
    Its size is sealed: no process that opens the memfd can truncate it under this mapping.
    Once :meth:`seal_writes` has run, no other process can write it either (see there).
    """

    def __init__(self, native: _C.SharedBuffer) -> None:
        self._native: _C.SharedBuffer = native

    @property
    def fd(self) -> int:
        """The memfd's descriptor number in this process."""
        return self._native.fd

    @property
    def inode(self) -> int:
        """The memfd's inode number: tells it from a later memfd under the same :attr:`fd`."""
        return self._native.inode

    def array(self) -> object:
        """A 1-D uint8 DLPack capsule over the whole buffer (``torch.from_dlpack``); it keeps
        the memory alive."""
        return self._native.array()

    @property
    def sealed(self) -> bool:
        """Whether :meth:`seal_writes` has run (or the buffer was made ``read_only``)."""
        return self._native.sealed

    def seal_writes(self) -> None:
        """Makes the memfd read-only for every other process, for good (``F_SEAL_FUTURE_WRITE``
        and ``F_SEAL_SEAL``; idempotent): this buffer's own mapping (:attr:`address`, arrays)
        stays writable, but a new writable shared mapping, ``write(2)`` or a hole punch of the
        memfd fails with ``EPERM`` whoever tries, root included. A peer that wants to write it
        afterwards must use cross-memory attach (see :attr:`read_only_address`).

        Raises:
            OSError: the kernel refused (``EINVAL``: Linux before 5.1; ``EPERM``: another process
                sealed the memfd's seals first).
        """
        err = self._native.seal_writes()
        if err:
            raise OSError(err, f"cannot seal the memfd of a shared buffer against writes: {os.strerror(err)}")

    @property
    def read_only_address(self) -> int:
        """Where a second, read-only (``PROT_READ``) mapping of the same bytes lies in this
        process; mapped on first use. A peer's ``process_vm_writev`` to it fails with
        ``EFAULT`` (the kernel never forces writes into a read-only shared mapping), reads work.
        It only protects these addresses: a process allowed to ``ptrace`` this one can find
        :attr:`address` in ``/proc/<pid>/maps`` and write there.

        Raises:
            RuntimeError: it could not be mapped (the message says why).
        """
        return self._native.read_only_address()

    def write_u64(self, offset: int, value: int) -> None:
        """Stores the 8-byte word at byte ``offset`` (8-aligned) with one store: a concurrent
        reader (e.g. a peer's :meth:`PeerMapping.read_u64`) sees the old or the new value.

        Raises:
            ValueError: no aligned word at ``offset`` inside the buffer.
        """
        _check_word(offset, self.nbytes)
        ctypes.c_uint64.from_address(self.address + offset).value = value


def shared_buffer(nbytes: int, name: str, *, read_only: bool = False) -> SharedBuffer:
    """A new :class:`SharedBuffer` of ``nbytes``; ``name`` shows in ``/proc/<pid>/fd``.

    ``read_only``: sealed against other processes' writes (:meth:`SharedBuffer.seal_writes`)
    before its memory is populated, i.e. microseconds after the memfd exists, so that no peer
    can map it writable in between.

    Raises:
        RuntimeError: the memfd could not be created, sealed or mapped (the message says why).
    """
    return SharedBuffer(_C.SharedBuffer(nbytes, name, read_only))


class PeerMapping(_Mapped):
    """This process's mapping of another same-host process's memfd (its :class:`SharedBuffer`),
    through ``/proc/<pid>/fd/<fd>``; unmapped when this object is garbage.

    Args:
        pid: the process owning the memfd.
        fd: the memfd's descriptor number in that process.
        nbytes: how much of it to map, from its start.
        writable: map read-write (else read-only).
        inode: the memfd's :attr:`SharedBuffer.inode` as its owner published it (0: not
            checked); another file under that descriptor number is refused.

    Raises:
        RuntimeError: the memfd cannot be opened or mapped (the process is gone, ptrace
            permission is refused, the memfd is sealed against writes, the descriptor number
            now holds another file, ...; the message says why).
    """

    def __init__(self, pid: int, fd: int, nbytes: int, writable: bool, inode: int = 0) -> None:
        # Every argument comes from a peer's record: out-of-range numbers are refused here, as
        # the native constructor refuses what is not a size-sealed memfd.
        if not (0 < pid < 1 << 31 and 0 <= fd < 1 << 31 and 0 <= nbytes < 1 << 62 and 0 <= inode < 1 << 64):
            raise RuntimeError(f"no memfd can be mapped from pid {pid}, fd {fd}, {nbytes} bytes, inode {inode}")
        self._native: _C.PeerMapping = _C.PeerMapping(pid, fd, nbytes, writable, inode)
        self._words: ctypes.Array[ctypes.c_uint64] | None = None  # its whole words, made on first read

    def read_u64(self, offset: int = 0) -> int:
        """The 8-byte word at byte ``offset`` (8-aligned), read with one load: a concurrent
        writer's aligned store is seen entirely or not at all.

        Raises:
            ValueError: no aligned word at ``offset`` inside the mapping.
        """
        _check_word(offset, self.nbytes)
        if self._words is None:
            self._words = (ctypes.c_uint64 * (self.nbytes // 8)).from_address(self.address)
        return self._words[offset // 8]

    def populate(self, packed: bytes, column: int, write: bool) -> int:
        """Fills this mapping's page tables for the pages that packed ``(dst, src, nbytes)``
        rows (:func:`pack_segments`) touch on side ``column`` (0: dst, 1: src), for writing or
        reading, so that copies through them take no page faults. Only the pages of the rows:
        populating a hole of the owner's memfd allocates it, as a write into it would. Blocks
        (the GIL released): call it from a worker thread.

        Returns:
            0, or the errno of the first refusal: ``ERANGE`` for a row outside the mapping
            (before any page is touched), ``EINVAL`` on a kernel before Linux 5.14.
        """
        return int(self._native.populate(packed, column, write))


class _Pending:
    __slots__ = ("event", "result")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.result: CopyResult | None = None


class CopyPlan:
    """A copy job's segments, cut and grouped once by the native engine (:meth:`Copier.plan`);
    immutable, started any number of times (:meth:`Copier.copy_plan`)."""

    __slots__ = ("native", "nbytes", "segments")

    def __init__(self, native: _C.CopyPlan) -> None:
        self.native = native
        self.nbytes = native.nbytes  # bytes in all
        self.segments = native.segments  # after cutting large ones into chunks

    def __repr__(self) -> str:
        return f"<CopyPlan {CopyKind(self.native.kind).name} {self.segments} segments, {self.nbytes} B>"


class Copier:
    """Async front of the native ``CopyEngine`` (threads + eventfd).

    Start :meth:`run` in a task group before calling :meth:`copy`; call :meth:`close` after that
    task has ended.

    Args:
        threads: the engine's copy threads.
        chunk_bytes: a job is copied (and can be stopped) in chunks of this size.

    Raises:
        TransportInternalError: the native extension does not load.
    """

    def __init__(self, threads: int = 2, chunk_bytes: int = 8 << 20) -> None:
        self._engine = _C.CopyEngine(threads, chunk_bytes)
        self._pending: dict[int, _Pending] = {}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Delivers the engine's completions to the waiting :meth:`copy` calls, until cancelled."""
        fd = self._engine.event_fd
        task_status.started()
        while True:
            await anyio.wait_readable(fd)
            for job_id, status, err, nbytes in self._engine.drain():
                pending = self._pending.pop(job_id, None)
                if pending is not None:
                    pending.result = CopyResult(CopyStatus(status), err, nbytes)
                    pending.event.set()

    async def copy(self, kind: CopyKind, pid: int, segments: Sequence[Segment]) -> CopyResult:
        """Copies ``(dst, src, nbytes)`` segments on the engine's threads (a single small one
        is copied right here: that takes less time than waking a thread would).

        Cancellation: the job is stopped at its next chunk boundary and this waits (shielded,
        bounded) until the engine has let go of the memory; then the cancellation propagates.
        Some chunks may already have been copied.

        Raises:
            TransportInternalError: the engine refused the job (e.g. it is shut down).
        """
        if len(segments) == 1 and segments[0][2] <= INLINE_MAX_BYTES:
            dst, src, n = segments[0]
            err = _C.copy_now(int(kind), pid, dst, src, n)
            await anyio.lowlevel.checkpoint()
            return CopyResult(CopyStatus.FAILED if err else CopyStatus.OK, err, 0 if err else n)
        return await self._run_job(lambda: self._engine.submit(int(kind), pid, list(segments)))

    async def copy_packed(self, kind: CopyKind, pid: int, packed: bytes, nbytes: int) -> CopyResult:
        """As :meth:`copy`, for segments packed by :func:`pack_segments` (``nbytes`` in all):
        the form a prepared transfer keeps, so that starting it costs no per-segment Python.
        Up to ``INLINE_MAX_BYTES`` in all are copied right here."""
        if nbytes <= INLINE_MAX_BYTES:
            err, copied = _C.copy_packed_now(int(kind), pid, packed)
            await anyio.lowlevel.checkpoint()
            return CopyResult(CopyStatus.FAILED if err else CopyStatus.OK, err, copied)
        return await self._run_job(lambda: self._engine.submit_packed(int(kind), pid, packed))

    def plan(self, kind: CopyKind, pid: int, packed: bytes) -> CopyPlan:
        """Segments packed by :func:`pack_segments`, cut into chunks and grouped into units of
        work once, for :meth:`copy_plan` to run again and again: what a prepared transfer keeps,
        so that a start hands the engine one handle, not its segments (copied, cut and grouped
        again at every start before).

        Raises:
            ValueError: an unknown kind, or ``packed`` not a whole number of u64 triples.
        """
        return CopyPlan(self._engine.plan_packed(int(kind), pid, packed))

    async def copy_plan(self, plan: CopyPlan) -> CopyResult:
        """As :meth:`copy`, for a plan (:meth:`plan`) of this copier. Up to ``INLINE_MAX_BYTES``
        in all are copied right here.

        Cancellation: as :meth:`copy`.
        """
        if plan.nbytes <= INLINE_MAX_BYTES:
            err, copied = _C.copy_plan_now(plan.native)
            await anyio.lowlevel.checkpoint()
            return CopyResult(CopyStatus.FAILED if err else CopyStatus.OK, err, copied)
        return await self._run_job(lambda: self._engine.submit_plan(plan.native))

    async def _run_job(self, submit: Callable[[], int]) -> CopyResult:
        try:
            job_id = submit()
        except RuntimeError as exc:
            raise TransportInternalError(f"copy engine refused the job: {exc}") from exc
        pending = _Pending()
        self._pending[job_id] = pending
        try:
            await pending.event.wait()
        except anyio.get_cancelled_exc_class():
            self._engine.cancel(job_id)
            with anyio.CancelScope(shield=True), anyio.move_on_after(_ABORT_GRACE_S):
                await pending.event.wait()
            raise
        if pending.result is None:  # the result is set before the event
            raise TransportInternalError(f"copy engine: job {job_id} ended without a result")
        return pending.result

    def close(self) -> None:
        """Aborts queued jobs and joins the threads. Call after :meth:`run` has stopped."""
        self._engine.shutdown()
