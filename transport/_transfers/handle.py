"""The ``Transfer`` handle returned by ``Transport.put`` / ``Transport.get``."""

from __future__ import annotations

import time
from typing import Any

import anyio

from .._errors import TransportError
from .._timeouts import seconds
from .._wire import TransferOp

# Awaiting a transfer that has already ended does not yield to the event loop (that would cost
# more than a small transfer), except once this long after the previous such yield: a loop of
# small synchronous puts still lets other tasks run, and sees cancellation, every millisecond.
_FAIR_YIELD_S = 0.001
_last_yield = 0.0


async def _fair_checkpoint() -> None:
    global _last_yield
    now = time.perf_counter()
    if now - _last_yield >= _FAIR_YIELD_S:
        _last_yield = now
        await anyio.lowlevel.checkpoint()


class Transfer:
    """One put or get in flight. Await it (or :func:`gather` many) to learn how it ended.

    The transfer runs in its Transport's task group from the moment ``put``/``get`` returns;
    awaiting only observes it. A small host transfer whose peer and route are known may already
    be complete when ``put``/``get`` returns (it was copied synchronously): awaiting it then
    returns at once, yielding to the event loop at most once per millisecond.

    Attributes:
        op: PUT or GET.
        peer: the peer's name.
        key: the remote region's key.
        nbytes: bytes moved by this transfer.
        offset: byte offset into the remote region.
        backend: name of the backend that carries it (None until chosen; "a,b" when a prepared
            transfer's segments go over two).
        segments: ranges it moves (1, or a prepared transfer's coalesced segment count).
        one_sided: True when every backend that carries it moves the bytes without the peer's
            process taking part (``ipc``, ``ucx``); False when the peer's agent serves them
            (``tcp``); None until a backend is chosen.
        same_host: True when every backend that carries it moves the bytes through this host's
            memory (``ipc``: a link as fast as a pass over the bytes); False when one goes over
            a network path (``ucx``, ``tcp``, ``nccl``); None until a backend is chosen.

    Waiting is not aborting: ``await h`` and ``await h.wait(timeout=...)`` only observe. A
    ``wait`` that times out raises the builtin :class:`TimeoutError` and leaves the transfer
    running (its own deadline, the ``timeout`` given to ``put``/``get``, still applies).

    Cancellation: :meth:`cancel` aborts the transfer. Cancelling a task that awaits this handle
    aborts it only when that task was its last waiter; while other tasks still wait for it, it
    keeps running for them. If no byte has moved, the remote region is untouched; if some have,
    awaiting raises :class:`TransferAbortedError` with ``partial=True`` and the remote range is
    undefined until the next complete write. A transfer whose bytes are all on the wire may
    still complete; then awaiting it returns normally.
    """

    __slots__ = ("_abort_error", "_cancel_requested", "_done", "_error", "_event", "_finished", "_incarnation",
                 "_moving", "_rec", "_scope", "_started", "_waiters", "backend", "key", "nbytes", "offset", "one_sided",
                 "op", "peer", "same_host", "segments")

    def __init__(self, op: TransferOp, peer: str, key: str, nbytes: int, offset: int, *, segments: int = 1,
                 rec: Any = None) -> None:
        self.op = op
        self.peer = peer
        self.key = key
        self.nbytes = nbytes
        self.offset = offset
        self.backend: str | None = None
        self.one_sided: bool | None = None
        self.same_host: bool | None = None
        self.segments = segments  # ranges moved (more for a prepared transfer)
        self._done = False
        self._event: anyio.Event | None = None  # made by the first task that has to wait
        self._error: TransportError | None = None
        self._started = time.monotonic()
        self._finished: float | None = None
        self._cancel_requested = False
        self._moving = False  # set once bytes may have started to move
        self._incarnation: str | None = None  # the peer incarnation the bytes go to
        self._abort_error: TransportError | None = None  # set when the Transport aborts it
        self._rec: Any = rec  # its flight-recorder record
        self._scope: anyio.CancelScope | None = None
        self._waiters = 0  # tasks awaiting this handle now (wait() or gather())

    @classmethod
    def _completed(cls, op: TransferOp, peer: str, key: str, nbytes: int, offset: int, backend: str,
                   one_sided: bool, same_host: bool, started: float) -> Transfer:
        """A handle for a transfer that already completed when it was started (the engine's
        synchronous path for small transfers); ``started``: its ``time.monotonic()``."""
        x = cls(op, peer, key, nbytes, offset)
        x.backend, x.one_sided, x.same_host = backend, one_sided, same_host
        x._started = started
        x._finished = time.monotonic()
        x._moving = True
        x._done = True
        return x

    # -- what the transfer engine tells the handle (it changes the handle's state only so) ---

    def _routed(self, backend: str, one_sided: bool, same_host: bool) -> None:
        """The backend(s) that carry it were chosen."""
        self.backend, self.one_sided, self.same_host = backend, one_sided, same_host

    def _began(self, incarnation: str) -> None:
        """Bytes may start to move now, to that incarnation of the peer."""
        self._moving, self._incarnation = True, incarnation

    def _running_in(self, scope: anyio.CancelScope) -> None:
        """It runs in ``scope`` (cancelled by :meth:`cancel`, at once if it was already asked)."""
        self._scope = scope
        if self._cancel_requested:
            scope.cancel()

    def _abort(self, error: TransportError) -> None:
        """The Transport aborts it (peer lost or excluded, or closing): it ends with ``error``."""
        if self._done:
            return
        self._abort_error = error
        if self._scope is not None:
            self._scope.cancel()
        else:
            self.cancel()

    def done(self) -> bool:
        """True once the transfer has completed, failed or been aborted."""
        return self._done

    async def _ended(self) -> None:
        """Returns once the transfer has ended (observing only: no waiter counted)."""
        if self._done:
            return
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()

    @property
    def elapsed(self) -> float:
        """Seconds from start to completion (or until now, while running)."""
        end = self._finished if self._finished is not None else time.monotonic()
        return end - self._started

    def exception(self) -> TransportError | None:
        """The error the transfer ended with; None while running or after success."""
        return self._error

    def cancel(self) -> None:
        """Requests an abort (see the class docstring). No effect once done."""
        if self.done():
            return
        self._cancel_requested = True
        if self._scope is not None:
            self._scope.cancel()

    async def wait(self, timeout: float | None = None) -> None:
        """Waits until the transfer ends.

        Args:
            timeout: seconds to wait (a finite number > 0), or None to wait until the transfer
                ends (it always does: by its own deadline at the latest).

        Raises:
            TimeoutError: the builtin, when ``timeout`` passed first; the transfer keeps running.
            TransportError: the error the transfer failed with.
            ValueError: ``timeout`` is not a finite number > 0.

        Cancellation: cancelling the waiting task aborts the transfer if no other task waits
        for it (see the class docstring).
        """
        if timeout is not None:
            timeout = seconds(timeout, "timeout")
        if self._done:  # e.g. completed synchronously when it was started
            await _fair_checkpoint()
            if self._error is not None:
                raise self._error
            return
        self._waiters += 1
        try:
            with anyio.move_on_after(timeout) as scope:
                await self._ended()
        except anyio.get_cancelled_exc_class():
            self._unwait(cancelled=True)
            raise
        self._unwait(cancelled=False)
        if scope.cancelled_caught and not self._done:
            raise TimeoutError(f"{self!r} still running after waiting {timeout:g}s")
        if self._error is not None:
            raise self._error

    def _unwait(self, *, cancelled: bool) -> None:
        """One waiter stops waiting; a cancelled last waiter aborts the transfer."""
        self._waiters -= 1
        if cancelled and self._waiters == 0:
            self.cancel()

    def __await__(self):  # type: ignore[no-untyped-def]
        return self.wait().__await__()

    def _finish(self, error: TransportError | None = None) -> None:
        if self._done:
            return
        self._error = error
        self._finished = time.monotonic()
        self._done = True
        if self._event is not None:
            self._event.set()

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "done")
        return (
            f"<Transfer {self.op.value} {self.peer}:{self.key!r} {self.nbytes}B @{self.offset} "
            f"via {self.backend} {state}>"
        )


async def gather(*transfers: Transfer) -> list[Transfer]:
    """Waits for every transfer to end, then raises the first error, if any.

    Args:
        transfers: handles from ``put``/``get``.

    Returns:
        The same handles, all done.

    Raises:
        TransportError: the first failure (in argument order), after all have ended.

    Cancellation: aborts every transfer not yet done that no other task waits for (as
    cancelling ``await h`` would).
    """
    if all(t._done for t in transfers):
        await _fair_checkpoint()
        for t in transfers:
            if t._error is not None:
                raise t._error
        return list(transfers)
    for t in transfers:
        t._waiters += 1
    try:
        for t in transfers:
            await t._ended()
    except anyio.get_cancelled_exc_class():
        for t in transfers:
            t._unwait(cancelled=True)
        raise
    for t in transfers:
        t._unwait(cancelled=False)
    for t in transfers:
        if t._error is not None:
            raise t._error
    return list(transfers)
