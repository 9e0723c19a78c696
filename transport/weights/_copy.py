"""Host copies split across the available cores.

Applying a version (and completing the publisher's snapshot) is one large host memcpy; one
thread does not reach the memory bandwidth of a many-core host, and torch's own intra-op
threads are often pinned to 1 in generator processes (``torch.set_num_threads(1)``). A
:class:`HostCopies` batch splits its copies into pieces and runs them on up to
:func:`available_threads` threads (the calling thread among them), with the GIL released
for the raw byte copies. A batch of ``STREAM_MIN_BYTES`` or more copies its raw pieces with
streaming stores (:func:`transport._native.stream_copy`): far larger than the cache, it is not
read back from there anyway, and skipping the read-for-ownership of every destination line
makes it about 1.6x faster.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import threading
from collections.abc import Callable

import numpy as np

from .._errors import TransportInternalError
from .._native import CopyKind, copy_now, stream_copy

PIECE_BYTES = 8 << 20  # a raw copy is split into pieces of at most this many bytes
MIN_SHARE = 4 << 20  # a batch gets one thread per this many bytes (up to the thread count)
MAX_THREADS = 8  # more threads than this add nothing to one memcpy
STREAM_MIN_BYTES = 16 << 20  # a batch this large copies its raw pieces with streaming stores

log = logging.getLogger(__name__)


def cores() -> int:
    """The cores this process may run on (its CPU affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def available_threads() -> int:
    """The cores this process may run on, at most ``MAX_THREADS``: the threads of one copy."""
    return max(1, min(MAX_THREADS, cores()))


class HostCopies:
    """A batch of host copies, run together across threads.

    Raw copies (``add_raw``: addresses, memcpy with the GIL released) are split into pieces of
    ``PIECE_BYTES``; other work (``add``: a torch conversion, say) stays one piece. The caller
    keeps every tensor behind an address alive until :meth:`run` returns.
    """

    def __init__(self) -> None:
        self._pieces: list[tuple[int, Callable[[], None]]] = []
        self._raw: list[tuple[int, int, int]] = []  # (dst, src, nbytes) pieces
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._pieces) + len(self._raw)

    def add_raw(self, dst: int, src: int, nbytes: int) -> None:
        """Copies ``nbytes`` from address ``src`` to address ``dst`` (no overlap)."""
        for a in range(0, nbytes, PIECE_BYTES):
            self._raw.append((dst + a, src + a, min(PIECE_BYTES, nbytes - a)))
        self.nbytes += nbytes

    def add(self, nbytes: int, work: Callable[[], None]) -> None:
        """Runs ``work`` (about ``nbytes`` of copying) as one piece."""
        self._pieces.append((nbytes, work))
        self.nbytes += nbytes

    def run(self, threads: int) -> None:
        """Runs every piece; returns when all are done, on at most ``threads`` threads (this
        one included; small batches run here alone).

        Raises:
            Exception: the first error a piece raised, once every thread has finished (the
                destinations are then partly written).
        """
        copy = _stream if self.nbytes >= STREAM_MIN_BYTES else copy_bytes
        pieces = self._pieces + [(n, functools.partial(copy, dst, src, n)) for dst, src, n in self._raw]
        k = max(1, min(threads, len(pieces), self.nbytes // MIN_SHARE))
        if k == 1:
            for _, work in pieces:
                work()
            return
        # One queue, largest piece first, that every thread takes its next piece from: a thread
        # that the host takes off its core (the 2-core VM runs the publisher's other threads and
        # the subscribers' processes beside a diff) holds back only the piece it is on, where
        # shares fixed up front left its whole share to finish after the others.
        queue = collections.deque(work for _, work in sorted(pieces, key=lambda p: -p[0]))
        errors: list[BaseException] = []

        def run_share() -> None:
            while not errors:
                try:
                    work = queue.popleft()  # atomic: each piece runs once
                except IndexError:
                    return
                try:
                    work()
                except BaseException as exc:  # noqa: BLE001 -- handed to the calling thread, raised there
                    errors.append(exc)

        helpers = [threading.Thread(target=run_share, name="transport-copy", daemon=True) for _ in range(k - 1)]
        for h in helpers:
            h.start()
        run_share()
        for h in helpers:
            h.join()
        if errors:
            raise errors[0]


class SharedRows:
    """The rows of one native batch call (the delta diff's ``encode_many``, the checked apply's
    ``apply_many``) shared by the copy threads of a :class:`HostCopies` batch: each thread
    calls it with the one cursor the rows are claimed from, so a thread takes the next row as
    it frees up, with the GIL released once per call rather than once per row.

    Args:
        call: ``call(cursor, taken)``: the native call on the rows, claiming from ``cursor``;
            returns how many rows it claimed (0: none was left), their indices at ``taken``.
        count: the rows.
        nbytes: what they weigh together, in bytes of copying.
    """

    def __init__(self, call: Callable[[np.ndarray, np.ndarray], int], count: int, nbytes: int) -> None:
        self._call = call
        self._count = count
        self._cursor = np.zeros(1, dtype=np.uint64)
        self.nbytes = nbytes
        self._failed = False  # a thread's call or ``done`` raised: the others claim no more rows

    def add_to(self, batch: HostCopies, threads: int, done: Callable[[list[int]], None] | None = None) -> None:
        """Adds to ``batch`` one piece per thread (at most one per row), each weighing its share:
        a thread that takes one runs rows until none is left, then takes the batch's other
        pieces. ``done`` is called with the rows each call claimed, once it returns."""
        n = max(1, min(threads, self._count))
        for _ in range(n):
            batch.add(self.nbytes // n, functools.partial(self._work, done))

    def _work(self, done: Callable[[list[int]], None] | None) -> None:
        taken = np.zeros(self._count, dtype=np.uint64)
        try:
            while not self._failed and (k := self._call(self._cursor, taken)):
                if done is not None:
                    done(taken[:k].tolist())
        except BaseException:
            self._failed = True  # (raised on: HostCopies.run raises the first error)
            raise


def _stream(dst: int, src: int, nbytes: int) -> None:
    stream_copy(dst, src, nbytes)


def copy_bytes(dst: int, src: int, nbytes: int) -> None:
    """Copies ``nbytes`` from address ``src`` to address ``dst`` on this thread (no overlap),
    with the GIL released.

    Raises:
        TransportInternalError: the copy failed.
    """
    err = copy_now(CopyKind.LOCAL, 0, dst, src, nbytes)
    if err:
        raise TransportInternalError(f"host copy of {nbytes} bytes failed: {os.strerror(err)}")
