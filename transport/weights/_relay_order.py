"""The publisher's side of one relay order, for both forms of weight sync (the stream
:mod:`._relays`, mesh sync :mod:`._mesh_relays`): the relay's log of what landed in it
(:class:`RelayLog`), and the members' acknowledgements with the fence they keep
(:class:`Acks`). The words are :mod:`._relay_block`'s."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

import anyio
import torch

from .._errors import TransferTimeoutError, TransportError
from ._relay_block import M_ACK_EPOCH, M_TAKEOVER, ROWS, S_COUNT, S_END, S_EPOCH, Ack, End

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from .. import Peer, Transfer, Transport

log = logging.getLogger(__name__)

ACK_LOOK_S = 0.02  # the longest a member's acknowledgement waits unseen (a signal says it sooner)
ROTATE_S = 60.0  # a relay that failed goes last for this long
PIECE_BYTES = 32 << 20  # a push into a relay goes (and is logged) in pieces of about this many bytes
RELAY_WINDOW = 3  # pieces of a push into a relay in flight at once: they land in order, one after another

T = TypeVar("T")


async def first_of(*events: anyio.Event) -> None:
    """Waits until one of ``events`` is set (e.g. a relay's log begun, or the relay failed)."""
    async with anyio.create_task_group() as tg:
        async def until(event: anyio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for event in events:
            tg.start_soon(until, event)


async def watched(rlog: RelayLog, stall: float, push: Callable[[], Awaitable[T]]) -> T | None:
    """``push()`` (the push into a relay, logging into ``rlog``) under a stall watch: cancelled
    once a piece has been on its way for ``stall`` seconds while none landed. Its result, or
    None when it stalled (its transfers were aborted with it)."""
    result: T | None = None
    with anyio.CancelScope() as pushing:
        async with anyio.create_task_group() as watch:
            async def watchdog() -> None:
                while not rlog.stalled(stall):
                    await anyio.sleep(min(0.1, stall / 4))
                pushing.cancel()

            watch.start_soon(watchdog)
            result = await push()
            watch.cancel_scope.cancel()
    return result


class RelayLog:
    """The log of one order in a relay's block: the ranges of its slot that are complete.

    Args:
        transport: the publisher's Transport.
        relay: the relay's name.
        key: its relay block's region name.
        epoch: the order's epoch.
        capacity: rows the block holds.
        timeout: seconds each write may take.
        tg: where the parts are followed (open while the push runs).
        base: the first word of the log's section in the block (mesh sync: the trainer rank's).
        rows: whether the rows are written (a stream's ranges); False: only their count (a
            mesh log counts pieces the member cuts itself).
    """

    def __init__(self, transport: Transport, relay: str, key: str, epoch: int, capacity: int, timeout: float,
                 tg: TaskGroup, *, base: int = 0, rows: bool = True) -> None:
        self.t, self.relay, self.key, self.epoch = transport, relay, key, epoch
        self._capacity, self._timeout, self._tg = capacity, timeout, tg
        self._base, self._rows = base, rows
        self._count = 0
        self._inflight = 1  # parts (and the log's start) not landed yet
        self._since = time.monotonic()  # when the last part landed, or the first of those in flight was sent
        self._send, self._recv = anyio.create_memory_object_stream[tuple["Transfer", list[tuple[int, int]]]](math.inf)
        self._pumped = anyio.Event()
        self.error: TransportError | None = None
        self.ended: tuple[int, bool] | None = None  # (bytes, as a delta) once every part is in the relay
        self.ended_at: float | None = None  # when (time.monotonic())
        self.begun = anyio.Event()  # set once this epoch's log is in the relay's block
        self._pumping = anyio.CancelScope()

    async def begin(self) -> None:
        """Starts this epoch's log (no rows, not ended) and the task that follows the parts."""
        words = torch.tensor([self.epoch, 0, int(End.PUSHING)], dtype=torch.int64)
        await self.t.put(words, self.relay, key=self.key, offset=8 * (self._base + S_EPOCH), timeout=self._timeout)
        self._landed()
        self.begun.set()
        self._tg.start_soon(self._pump)

    def follow(self, handle: Transfer, rows: list[tuple[int, int]]) -> None:
        """Logs ``rows`` (slot offset, nbytes) once ``handle`` (the put of their bytes) completed,
        in the order given. Once a part failed nothing more is logged (the push raises it)."""
        try:
            self._send.send_nowait((handle, rows))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return
        if self._inflight == 0:
            self._since = time.monotonic()
        self._inflight += 1

    def _landed(self) -> None:
        self._inflight -= 1
        self._since = time.monotonic()

    def stalled(self, limit: float) -> bool:
        """Whether a part has been on its way into the relay for ``limit`` seconds while none
        landed (waiting for the diff to hand out a part is not a stall)."""
        return self._inflight > 0 and time.monotonic() - self._since > limit

    def stop(self) -> None:
        """The push into the relay ended without it: logs nothing more (a log write to a relay
        that stalled would wait out its timeout)."""
        self._pumping.cancel()
        self.close()

    def close(self) -> None:
        """Closes the log's queue (idempotent)."""
        self._send.close()
        self._recv.close()

    async def _pump(self) -> None:
        try:
            with self._pumping:
                await self._follow()
        finally:
            self._pumped.set()

    async def _follow(self) -> None:
        try:
            async with self._recv:
                async for handle, rows in self._recv:
                    await handle  # its bytes are in the relay's memory (what it raises, the push raises too)
                    if self._count + len(rows) > self._capacity:
                        raise TransportError(f"the relay log of {self.relay} holds {self._capacity} rows")
                    if self._rows:
                        table = torch.tensor(rows, dtype=torch.int64).reshape(-1)
                        await self.t.put(table, self.relay, key=self.key,
                                         offset=8 * (self._base + ROWS + 2 * self._count), timeout=self._timeout)
                    self._count += len(rows)
                    await self.t.put(torch.tensor([self._count], dtype=torch.int64), self.relay, key=self.key,
                                     offset=8 * (self._base + S_COUNT), timeout=self._timeout)
                    self._landed()
        except TransportError as exc:
            self.error = exc

    async def end(self, delta: bool, nbytes: int) -> None:
        """Every part is in the relay (``nbytes`` in all, ``delta``: a delta's encodings and
        header): logs the rest, then how the version ended.

        Raises:
            TransportError: a part or a log write failed.
        """
        self._send.close()
        await self._pumped.wait()
        if self.error is not None:
            raise self.error
        self.ended, self.ended_at = (nbytes, delta), time.monotonic()
        end = torch.tensor([int(End.DELTA if delta else End.DENSE)], dtype=torch.int64)
        await self.t.put(end, self.relay, key=self.key, offset=8 * (self._base + S_END), timeout=self._timeout)


class Acks:
    """The members' acknowledgements of one publisher's relay orders, and the fence they
    keep: a member with an order it has not acknowledged may still be copying into a slot, so
    its slots are not written until it has (it is asked to stop first).

    Args:
        transport: the publisher's Transport.
        key: the members' relay block region name.
        signal: the publisher's signal a member rings once it acknowledged.
        deadline: seconds a member is given to acknowledge being asked to stop.
        stall: seconds each read of a member's acknowledgement may take.
        base: the first word of this publisher's section in a member's block.
    """

    def __init__(self, transport: Transport, key: str, signal: str, deadline: float, stall: float,
                 base: int = 0) -> None:
        self.t, self.key, self.signal, self.deadline, self.stall, self.base = (transport, key, signal, deadline,
                                                                              stall, base)
        # member name -> (incarnation, epoch) of an order it has not acknowledged
        self._unacked: dict[str, tuple[str, int]] = {}

    def ordering(self, peer: Peer, epoch: int) -> None:
        """``peer`` is being given order ``epoch``: unacknowledged from its first byte on (a put
        that fails may still have landed)."""
        self._unacked[peer.name] = (peer.incarnation, epoch)

    def pending(self, peer: Peer) -> bool:
        """Whether ``peer`` has an order it has not acknowledged (it may still be copying)."""
        got = self._unacked.get(peer.name)
        return got is not None and got[0] == peer.incarnation

    def forget(self, serving: set[tuple[str, str]]) -> None:
        """Drops the orders of members (name, incarnation) no longer served."""
        for name in [n for n, (inc, _) in self._unacked.items() if (n, inc) not in serving]:
            del self._unacked[name]

    async def fenced(self, peer: Peer) -> bool:
        """Whether ``peer``'s slots may be written: it has no order it has not acknowledged (one
        it has is taken over first: it is asked to stop, and waited for within the deadline)."""
        pending = self._unacked.get(peer.name)
        if pending is None or pending[0] != peer.incarnation:
            self._unacked.pop(peer.name, None)
            return True
        ack = await self.take_over(peer, pending[1])
        return ack is not None

    async def take_over(self, peer: Peer, epoch: int) -> Ack | None:
        """Asks ``peer`` to stop following order ``epoch``; its acknowledgement (None: none
        within the deadline; it stays unacknowledged)."""
        try:
            await self.t.put(torch.tensor([epoch], dtype=torch.int64), peer.name, key=self.key,
                             offset=8 * (self.base + M_TAKEOVER), timeout=self.deadline)
            with anyio.move_on_after(self.deadline):
                return await self.acked(peer, epoch, lambda: False)
        except TransportError as exc:
            log.info("%s: %s cannot be asked to stop following its relay: %s", self.t.name, peer.name, exc)
        return None

    async def acked(self, peer: Peer, epoch: int, give_up: Callable[[], bool]) -> Ack | None:
        """Waits for ``peer``'s acknowledgement of order ``epoch``; None once ``give_up()``
        says so (the caller then takes it over). Bounded by the caller's cancel scope.

        Raises:
            TransportError: its block cannot be read.
        """
        words = torch.zeros(2, dtype=torch.int64)
        seen = self.t.signal_value(self.signal) or 0
        while True:
            await self.t.get(words, peer.name, key=self.key, offset=8 * (self.base + M_ACK_EPOCH), timeout=self.stall)
            if int(words[0]) == epoch and int(words[1]) in (a.value for a in Ack):
                self._unacked.pop(peer.name, None)
                return Ack(int(words[1]))
            if give_up():
                return None
            try:
                seen = await self.t.wait_signal(self.signal, at_least=seen + 1, timeout=ACK_LOOK_S)
            except TransferTimeoutError:
                pass


class Rotation:
    """Which relay goes first: by name, but one that failed as a relay in the last ``ROTATE_S``
    seconds goes last (the next by name takes over)."""

    def __init__(self) -> None:
        self._failed: dict[str, float] = {}  # relay name -> until when it goes last

    def failed(self, name: str) -> None:
        """``name`` failed as a relay now."""
        self._failed[name] = time.monotonic() + ROTATE_S

    def order(self, names: Iterable[str]) -> list[str]:
        """``names`` in the order they are tried as relays."""
        now = time.monotonic()
        return sorted(names, key=lambda n: (self._failed.get(n, 0.0) > now, n))

    def expire(self) -> None:
        """Forgets the failures older than ``ROTATE_S``."""
        now = time.monotonic()
        for name in [n for n, until in self._failed.items() if until < now]:
            del self._failed[name]
