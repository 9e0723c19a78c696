"""The single place that talks to the native extension ``transport._C``.

It loads the extension lazily, turns native failures into the error tree, and runs the native
engines' completions into the event loop: one task per engine waits on its eventfd
(``anyio.wait_readable``), so no thread polls and no Python runs on the native threads. Two
engines: the copy engine (same-host copies, ``ipc``) and the UCX engine (``ucx``).
"""

from __future__ import annotations

import enum
import errno
import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence

import anyio
from anyio.abc import TaskStatus

from ._errors import ClosedError, TransportInternalError

log = logging.getLogger(__name__)

# The engine always finishes a job quickly once it is cancelled (at most one chunk per thread);
# this bounds the shielded wait for that, so a wedged engine cannot hang a close.
_ABORT_GRACE_S = 10.0
# Copies up to this size run inline on the event loop thread (a few microseconds at most).
INLINE_MAX_BYTES = 64 << 10


def load() -> Any:
    """The ``transport._C`` module.

    Raises:
        TransportInternalError: the extension is missing or does not load.
    """
    try:
        from . import _C
    except ImportError as exc:
        raise TransportInternalError(
            f"the native extension transport._C did not load ({exc}); reinstall with "
            "`pip install -e .` so that csrc/ is compiled"
        ) from exc
    return _C


class CopyKind(enum.IntEnum):
    LOCAL = 0  # both sides mapped here (memcpy)
    CMA_WRITE = 1  # dst lives in another process
    CMA_READ = 2  # src lives in another process


class CopyStatus(enum.IntEnum):
    OK = 0
    FAILED = 1
    ABORTED = 2


@dataclass(frozen=True)
class CopyResult:
    status: CopyStatus
    err: int
    nbytes: int

    def describe_errno(self) -> str:
        return f"{errno.errorcode.get(self.err, self.err)}: {os.strerror(self.err)}"


class _Pending:
    __slots__ = ("event", "result")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.result: CopyResult | None = None


class Copier:
    """Async front of the native ``CopyEngine`` (threads + eventfd).

    Start :meth:`run` in a task group before calling :meth:`copy`; call :meth:`close` after that
    task has ended.
    """

    def __init__(self, threads: int = 2, chunk_bytes: int = 8 << 20) -> None:
        self._C = load()
        self._engine = self._C.CopyEngine(threads, chunk_bytes)
        self._pending: dict[int, _Pending] = {}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        fd = self._engine.event_fd
        task_status.started()
        while True:
            await anyio.wait_readable(fd)
            for job_id, status, err, nbytes in self._engine.drain():
                pending = self._pending.pop(job_id, None)
                if pending is not None:
                    pending.result = CopyResult(CopyStatus(status), err, nbytes)
                    pending.event.set()

    async def copy(self, kind: CopyKind, pid: int, segments: Sequence[tuple[int, int, int]]) -> CopyResult:
        """Copies ``(dst, src, nbytes)`` segments on the engine's threads (a single small one
        is copied right here: that takes less time than waking a thread would).

        Cancellation: the job is stopped at its next chunk boundary and this waits (shielded,
        bounded) until the engine has let go of the memory; then the cancellation propagates.
        Some chunks may already have been copied.
        """
        if len(segments) == 1 and segments[0][2] <= INLINE_MAX_BYTES:
            dst, src, n = segments[0]
            err = self._C.copy_now(int(kind), pid, dst, src, n)
            await anyio.lowlevel.checkpoint()
            return CopyResult(CopyStatus.FAILED if err else CopyStatus.OK, err, 0 if err else n)
        try:
            job_id = self._engine.submit(int(kind), pid, list(segments))
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
        assert pending.result is not None
        return pending.result

    def close(self) -> None:
        """Aborts queued jobs and joins the threads. Call after :meth:`run` has stopped."""
        self._engine.shutdown()


# -- UCX engine ------------------------------------------------------------------------------

# What the native UCX engine raises: RuntimeError (a UCX or system failure, or shut down),
# ValueError / IndexError (bad arguments: a bug here).
_UCX_NATIVE_ERRORS = (RuntimeError, ValueError, IndexError)

# A cancelled UCX job stops at its next chunk; its chunks in flight normally finish at once.
# Past this wait the caller moves on, and the job's memory stays referenced until the engine
# reports it (or its endpoint or the engine is closed, which ends it).
_UCX_ABORT_GRACE_S = 0.5


class UcxOp(enum.IntEnum):
    PUT = 0
    GET = 1


@dataclass(frozen=True)
class UcxPart:
    """One lane's share of a transfer: ``nbytes`` between local address ``local`` and remote
    address ``remote`` through endpoint ``ep`` and rkey ``rkey`` of ``lane``."""

    lane: int
    ep: int
    rkey: int
    local: int
    remote: int
    nbytes: int


@dataclass(frozen=True)
class UcxResult:
    """How a UCX transfer ended: ``ucs_status`` is UCX's first failure (0 if none), ``nbytes``
    the bytes of its completed chunks."""

    status: CopyStatus
    ucs_status: int
    nbytes: int

    def describe(self) -> str:
        return str(load().ucx_status_string(self.ucs_status))


class _UcxPending:
    __slots__ = ("event", "keep", "nbytes", "remaining", "status", "ucs_status")

    def __init__(self, parts: int, keep: object) -> None:
        self.event = anyio.Event()
        self.remaining = parts
        self.status = CopyStatus.OK
        self.ucs_status = 0
        self.nbytes = 0
        self.keep = keep  # the local memory of the transfer: alive until the engine lets go of it

    def add(self, status: CopyStatus, ucs_status: int, nbytes: int) -> None:
        self.nbytes += nbytes
        if status == CopyStatus.FAILED and self.status != CopyStatus.FAILED:
            self.status, self.ucs_status = status, ucs_status
        elif status == CopyStatus.ABORTED and self.status == CopyStatus.OK:
            self.status = status
        self.remaining -= 1
        if self.remaining == 0:
            self.event.set()

    @property
    def result(self) -> UcxResult:
        return UcxResult(self.status, self.ucs_status, self.nbytes)


class UcxEngine:
    """Async front of the native UCX engine: one UCP context and its lanes (a worker driven by
    a native progress thread each); completions of every lane arrive through one eventfd.

    Start :meth:`run` in a task group before calling :meth:`transfer`; call :meth:`close` once
    (it finishes every transfer still waiting). :meth:`connect` and :meth:`unpack_rkey` block
    the caller briefly while the lane's thread runs them.

    Args:
        library: libucp to load (a path, or a soname for the system loader); a process loads
            one libucp, the first one asked for.
        name: shows up in UCX's own diagnostics.
        lanes: workers (and progress threads); a transfer may be split across them.
        chunk_bytes: the largest single ``ucp_put_nbx``/``ucp_get_nbx``.
        window: chunks of one job in flight at once.

    Raises:
        TransportInternalError: libucp does not load or UCX cannot start.
    """

    def __init__(self, library: str, name: str, *, lanes: int = 1, chunk_bytes: int = 8 << 20, window: int = 4) -> None:
        self._C = load()
        try:
            self._engine = self._C.UcxEngine(library, name, lanes, chunk_bytes, window)
        except _UCX_NATIVE_ERRORS as exc:
            raise TransportInternalError(f"cannot start UCX from {library}: {exc}") from exc
        self.lanes = lanes
        self._pending: dict[int, _UcxPending] = {}  # job id -> its transfer (shared by its parts)
        self._closed = False

    def worker_address(self, lane: int) -> bytes:
        """The packed address peers create endpoints to ``lane`` from."""
        return bytes(self._engine.worker_address(lane))

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        if self._closed:
            raise ClosedError(f"{what}: the ucx engine is closed")
        try:
            return fn(*args)
        except _UCX_NATIVE_ERRORS as exc:
            if self._closed:
                raise ClosedError(f"{what}: the ucx engine is closed") from exc
            raise TransportInternalError(f"{what}: {exc}") from exc

    def _post(self, fn: Any, *args: Any) -> None:
        """Fire-and-forget calls (unmap, close, destroy): after close there is nothing left to
        release, and a lane shutting down releases everything itself."""
        if self._closed:
            return
        try:
            fn(*args)
        except _UCX_NATIVE_ERRORS as exc:
            log.debug("ucx engine: %s ignored: %s", getattr(fn, "__name__", fn), exc)

    def mem_map(self, address: int, nbytes: int) -> tuple[int, bytes]:
        """Registers host memory; returns (handle, packed rkey for peers)."""
        mem, rkey = self._call(f"ucp_mem_map of {nbytes} bytes", self._engine.mem_map, address, nbytes)
        return int(mem), bytes(rkey)

    def mem_unmap(self, mem: int) -> None:
        self._post(self._engine.mem_unmap, mem)

    def connect(self, lane: int, address: bytes) -> int:
        """An endpoint of ``lane`` to the worker at ``address`` (wire-up finishes in the
        background)."""
        return int(self._call("ucp_ep_create", self._engine.ep_create, lane, address))

    def disconnect(self, lane: int, ep: int, *, force: bool) -> None:
        """Closes an endpoint. ``force``: the peer is gone; its transfers in flight fail."""
        self._post(self._engine.ep_close, lane, ep, force)

    def unpack_rkey(self, lane: int, ep: int, packed: bytes) -> int:
        return int(self._call("ucp_ep_rkey_unpack", self._engine.rkey_unpack, lane, ep, packed))

    def read_word(self, lane: int, ep: int, rkey: int, remote: int, timeout: float) -> int | None:
        """Reads the 8-byte word at ``remote`` synchronously (the caller blocks, at most
        ``timeout`` seconds); None if it could not be read (timeout, closed endpoint)."""
        status, value = self._call("ucp_get_nbx of 8 bytes", self._engine.read_word, lane, ep, rkey, remote, max(1, int(timeout * 1000)))
        return int(value) if status == 0 else None

    def destroy_rkey(self, lane: int, rkey: int) -> None:
        self._post(self._engine.rkey_destroy, lane, rkey)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        fd = self._engine.event_fd
        task_status.started()
        while not self._closed:
            await anyio.wait_readable(fd)
            self._dispatch()

    def _dispatch(self) -> None:
        for job_id, status, ucs_status, nbytes in self._engine.drain():
            pending = self._pending.pop(job_id, None)
            if pending is not None:
                pending.add(CopyStatus(status), ucs_status, nbytes)

    async def transfer(self, op: UcxOp, parts: Sequence[UcxPart], keep: object) -> UcxResult:
        """Runs the parts of one transfer (on their lanes, concurrently); returns how it ended.
        A put has completed once its bytes are in the peer's memory (its endpoints were
        flushed).

        ``keep`` (the object owning the local memory) stays referenced until the engine has
        let go of that memory, even past a cancellation.

        Cancellation: the parts stop issuing chunks; this waits (shielded, bounded) for the
        chunks in flight, then the cancellation propagates. Some chunks may have landed.

        Raises:
            ClosedError: the engine is closed.
            TransportInternalError: the engine refused the parts (a bug).
        """
        if self._closed:
            raise ClosedError("the ucx engine is closed")
        pending = _UcxPending(len(parts), keep)
        jobs: list[tuple[int, int]] = []
        try:
            for part in parts:
                job = self._engine.submit(part.lane, int(op), part.ep, part.rkey, part.local, part.remote, part.nbytes)
                self._pending[job] = pending
                jobs.append((part.lane, job))
        except _UCX_NATIVE_ERRORS as exc:
            for _ in range(len(parts) - len(jobs)):
                pending.add(CopyStatus.ABORTED, 0, 0)
            self._abort(jobs)  # the parts already queued must let go of the memory first
            with anyio.CancelScope(shield=True), anyio.move_on_after(_UCX_ABORT_GRACE_S):
                await pending.event.wait()
            if isinstance(exc, RuntimeError):  # a lane is shut down: the transport is closing
                raise ClosedError(f"the ucx engine is closed ({exc})") from exc
            raise TransportInternalError(f"ucx engine refused a transfer: {exc}") from exc
        try:
            await pending.event.wait()
        except anyio.get_cancelled_exc_class():
            self._abort(jobs)
            with anyio.CancelScope(shield=True), anyio.move_on_after(_UCX_ABORT_GRACE_S):
                await pending.event.wait()
            raise
        return pending.result

    def _abort(self, jobs: Sequence[tuple[int, int]]) -> None:
        if self._closed:
            return
        for lane, job in jobs:
            self._post(self._engine.cancel, lane, job)  # a lane shutting down ends the job itself

    def close(self) -> None:
        """Aborts every job, closes every endpoint, destroys the workers and the context and
        joins the progress threads (bounded); then no native code touches this process's
        memory any more, and every waiting :meth:`transfer` returns (aborted). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._engine.shutdown()
        self._dispatch()
        for pending in self._pending.values():  # one entry per unreported job; a backstop
            pending.add(CopyStatus.ABORTED, 0, 0)
        self._pending.clear()
