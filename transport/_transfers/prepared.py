"""The public handle of a prepared transfer: many segments, checked once, moved with one
completion per start.

A :class:`PreparedTransfer` is made by the transfer engine (``Transport.prepare_put`` /
``prepare_get`` / ``prepare_put_runs`` / ``prepare_get_runs``) over one
:class:`~transport._transfers.runs.RunList`. It holds nothing else: :meth:`~PreparedTransfer.start`
and :meth:`~PreparedTransfer.warm` forward to the engine, which owns the plan it builds for each
record of the peer (the backends' native lists) and drops it with the run list. The engine is
known here only by the two calls it answers (:class:`Starter`), so this module imports nothing
above it.
"""

from __future__ import annotations

from typing import Protocol

from .handle import Transfer
from .runs import RunList


class Starter(Protocol):
    """What a prepared transfer asks of the engine that made it."""

    def start_prepared(self, prepared: RunList, timeout: float | None, runs: object = None) -> Transfer: ...

    async def warm_prepared(self, runs: RunList, timeout: float | None) -> None: ...


class PreparedTransfer:
    """A reusable put or get of many segments to one peer, with one completion per start.

    Build with ``Transport.prepare_put`` / ``prepare_get`` (items) or ``prepare_put_runs`` /
    ``prepare_get_runs`` (an array of runs); the local tensors stay referenced (and are read,
    or written, at every :meth:`start`): fill them, start, await, repeat. The local checks ran
    when it was made; the checks against the peer's record run at the first start (or when it
    was made, if the peer was known then), and again only when the peer restarted, changed its
    regions, or a local tensor was given new memory.

    Attributes:
        op: PUT or GET.
        peer: the peer's name.
        nbytes: bytes moved by one start.
        segments: runs after coalescing (what the backends move).
        items: items (or runs) as given.
        runs: the runs, a :class:`~transport._tensors.Runs` per remote key and local base, in
            key order.
    """

    def __init__(self, runs: RunList, engine: Starter) -> None:
        """Made by the transfer engine (``Transport.prepare_*``), not by hand."""
        self._runs, self._engine = runs, engine
        self.op, self.peer, self.nbytes = runs.op, runs.peer, runs.nbytes
        self.segments, self.items, self.runs = runs.segments, runs.items, runs.runs

    def start(self, *, timeout: float | None = None, runs: object = None) -> Transfer:
        """Starts moving every segment (or, with ``runs``, some of their bytes); returns one
        handle for all of them.

        ``runs`` serves a transfer between two fixed buffers whose bytes to move change from
        start to start (e.g. the changed parts of a version): prepare it once with every run it
        may ever move (``prepare_put_runs`` / ``prepare_get_runs``), then start it with the
        rows of this time. Each row must lie inside one prepared run, at the same place on both
        sides; the rows are checked against the prepared runs here, vectorised, before
        anything starts, and the checks of the prepared runs against the peer's record (made
        once per record of the peer) cover them. Only the backends' lists are built again, for
        these rows.

        Args:
            timeout: seconds for the whole list (default: the Transport's timeout).
            runs: None (every segment), or an integer array of shape ``(N, 3)`` (numpy, or a
                torch tensor) of rows ``(local byte offset, remote byte offset, nbytes)``; empty
                rows are dropped, the rest coalesced. Only for a prepared transfer made by
                ``prepare_put_runs`` / ``prepare_get_runs``. The array is not kept.

        Returns:
            A :class:`~transport.Transfer` (``nbytes`` is the total; ``segments`` the rows
            moved, after coalescing); awaiting it returns once every segment is in place.

        Raises:
            As ``Transport.put`` / ``get`` (here, or when awaiting the handle; remote checks
            always before any byte moves). Segments already moved when one fails are not
            undone (``partial`` says so). With ``runs``, here, before any byte moves:
            TypeError (not an integer ``(N, 3)`` array), ValueError (no row with bytes, or
            this prepared transfer was made from items), BoundsError (a row negative, not
            aligned to the local tensor's items, inside no prepared run, or, for a put, two
            rows writing the same remote bytes).

        Cancellation: as a single transfer's (see :class:`~transport.Transfer`).
        """
        return self._engine.start_prepared(self._runs, timeout, runs)

    async def warm(self, *, timeout: float | None = None) -> None:
        """Readies the first start ahead of time, so that it costs what later starts do: builds
        the plan for the peer's current record and lets each backend set up what the first
        start would on its way (over ``ipc``: maps the peer's memory and fills this process's
        page tables for exactly the pages the runs touch, which a first copy would otherwise
        fault in one by one). Moves no byte; the peer sees nothing. Optional: call it where
        the time is free (e.g. while the trainer computes), not just before :meth:`start`.
        A single host segment (which starts as a plain put) has nothing to ready.

        Args:
            timeout: seconds (default: the Transport's timeout).

        Raises:
            ClosedError: the Transport is closed. TransferTimeoutError: not done in time.
            As :meth:`start` for the checks against the peer's record (unknown peer or region,
            bounds, dtype), which run here too.

        Cancellation: safe; what was readied stays readied (it only saves work later).
        """
        await self._engine.warm_prepared(self._runs, timeout)

    def __repr__(self) -> str:
        return (f"<PreparedTransfer {self.op.value} {self.peer} {self.items} items -> {self.segments} runs, "
                f"{self.nbytes} B>")
