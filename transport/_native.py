"""The single place that talks to the native extension ``transport._C``.

It loads the extension lazily, turns native failures into the error tree, and runs the copy
engine's completions into the event loop: one task waits on the engine's eventfd
(``anyio.wait_readable``), so no thread polls and no Python runs on the copy threads.
"""

from __future__ import annotations

import enum
import errno
import os
from dataclasses import dataclass
from typing import Any, Sequence

import anyio
from anyio.abc import TaskStatus

from ._errors import TransportInternalError

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
