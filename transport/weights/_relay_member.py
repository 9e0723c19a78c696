"""A subscriber's part in per-host relays (:class:`RelayMember`): it follows the publisher's
orders in its relay block (:mod:`._relay_block`), copying a version from its host's relay's
slot into its own free slot as the relay's log grows, and acknowledges each order.

It runs as a service of the subscriber's Transport (:meth:`Transport._run_service`), from
``start`` to ``aclose``, woken by the publisher's signal (and looking every ``IDLE_LOOK_S``
seconds besides). It never makes a slot its front: the publisher does, once it has seen the
``DONE`` acknowledgement of that very order. It copies only rows of its order's epoch, checked
against its slot's size, stops at the publisher's ``M_TAKEOVER`` before the next row, and gives
up (``FAILED``) when the relay's log moves to another epoch, or does not grow
for ``STALL_S`` seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import torch

from .._errors import ClosedError, TransferTimeoutError, TransportError
from ._control import memory_barrier
from ._polling import PENDING, Pending, poll
from ._relay_block import (
    M_ACK,
    M_ACK_EPOCH,
    M_EPOCH,
    M_TAKEOVER,
    ROWS,
    S_COUNT,
    S_END,
    S_EPOCH,
    Ack,
    End,
    Order,
    check_rows,
    rows_capacity,
)

if TYPE_CHECKING:
    from .. import Peer, Transport
    from ._control import StreamKeys
    from ._layout import Layout

log = logging.getLogger(__name__)

IDLE_LOOK_S = 0.05  # between two looks at the block when no signal came
STALL_S = 60.0  # a relay log that does not grow for this long is given up on
FIRST_WAIT_S, LONGEST_WAIT_S = 0.0005, 0.005  # the backoff between two looks at the relay's log


class RelayMember:
    """Follows the relay orders in one subscriber's relay block.

    Args:
        transport: the subscriber's Transport.
        keys: the stream's region names.
        layout: the stream's packed layout.
        block: the subscriber's relay block (registered, int64).
        slots: its slots.
        headers: its delta header beside each slot (empty: it takes no deltas).
        publisher: the publisher's name (told of each acknowledgement).
    """

    def __init__(self, transport: Transport, keys: StreamKeys, layout: Layout, block: torch.Tensor,
                 slots: list[torch.Tensor], headers: list[torch.Tensor], publisher: str) -> None:
        self.t, self._keys, self.layout, self._block = transport, keys, layout, block
        self._slots, self._headers, self.publisher = slots, headers, publisher
        self._capacity = rows_capacity(layout)
        self._relays = RelayLookup(transport, [keys.relay, keys.slots[1]])
        self.followed = 0  # orders acknowledged DONE

    async def run(self) -> None:
        """Follows orders until cancelled, or until the Transport closes."""
        try:
            await self._run()
        except ClosedError:
            return

    async def _run(self) -> None:
        woken = 0
        while True:
            # Woken by the publisher's signal, or looking every IDLE_LOOK_S (any peer may set the
            # signal to a value no later wake reaches).
            try:
                woken = await self.t.wait_signal(self._keys.relay_wake, at_least=woken + 1, timeout=IDLE_LOOK_S)
            except TransferTimeoutError:
                pass
            block = self._block
            epoch = int(block[M_EPOCH])
            if epoch <= 0 or int(block[M_ACK_EPOCH]) == epoch:
                continue
            order = Order.read(block, len(self._slots))
            memory_barrier()
            if int(block[M_EPOCH]) != epoch:  # rewritten while it was read: look again
                continue
            ack = Ack.FAILED
            if order is None:
                log.warning("subscriber %s: a relay order of %r that does not fit (refused)", self.t.name,
                            self._keys.relay)
            else:
                try:
                    ack = await self._follow(order)
                except ClosedError:
                    raise
                except Exception as exc:  # noqa: BLE001 -- whatever an order (anyone's to write) leads to: refused
                    log.info("subscriber %s: cannot copy version %d from relay %s: %s", self.t.name, order.version,
                             order.relay, exc)
                if ack is not Ack.DONE:  # (a relay that restarted is looked up anew next time)
                    self._relays.forget(order.relay)
                self.t._flight.event("relayed", order.relay, f"version {order.version} from its slot {order.src} "
                                                             f"into slot {order.dst}: {ack.name}")
            await acknowledge(self.t, block, epoch, ack, self.publisher, self._keys.relay_ack)
            if ack is Ack.DONE:
                self.followed += 1

    async def _follow(self, order: Order) -> Ack:
        """Copies ``order``'s version into its slot as the relay's log grows; how it ended.

        Raises:
            TransferTimeoutError: the log did not grow for ``STALL_S`` seconds.
        """
        t, k = self.t, self._keys
        relay = await self._relays.get(order.relay)
        source = relay.regions.get(k.slots[order.src])
        if source is None or source.nbytes != self.layout.total:
            return Ack.FAILED
        slot = self._slots[order.dst]

        async def copy(lo: int, hi: int) -> bool:
            rows = torch.empty(2 * (hi - lo), dtype=torch.int64)
            await t.get(rows, relay, key=k.relay, offset=8 * (ROWS + 2 * lo))
            rows = rows.reshape(-1, 2)
            if not check_rows(rows, self.layout.total):
                return False
            await t.get_many(relay, [(slot[o:o + n], k.slots[order.src], o) for o, n in rows.tolist()])
            return True

        async def finish(end: End) -> Ack:
            return await self._finish(order, relay, end == End.DELTA)

        return await follow_log(t, relay, k.relay, 0, order, self._capacity, lambda: int(self._block[M_TAKEOVER]),
                                copy, finish)

    async def _finish(self, order: Order, relay: Peer, delta: bool) -> Ack:
        """The slot holds every row: its delta header (the relay's, for a delta; cleared for a
        dense version, so the bytes are never read as a delta)."""
        if not self._headers:
            return Ack.FAILED if delta else Ack.DONE
        header = self._headers[order.dst]
        if delta:
            region = relay.regions.get(self._keys.deltas[order.src])
            if region is None or region.nbytes != header.nbytes:
                return Ack.FAILED
            await self.t.get(header, relay, key=self._keys.deltas[order.src])
        else:
            header[:1].zero_()
        return Ack.DONE


class RelayLookup:
    """The relays a member follows, each as looked up last (anew when it was not seen yet, or
    restarted: its record lacks ``regions``, or it failed to be followed and was forgotten).

    Args:
        transport: the member's Transport.
        regions: the relay's regions a lookup waits for.
    """

    def __init__(self, transport: Transport, regions: list[str]) -> None:
        self.t, self._regions = transport, regions
        self._peers: dict[str, Peer] = {}

    async def get(self, name: str) -> Peer:
        """The relay ``name``.

        Raises:
            TransportError: it is not found within 5 s.
            ValueError: ``name`` is no peer name.
        """
        peer = self._peers.get(name)
        if peer is None or any(r not in peer.regions for r in self._regions):
            peer = await self.t.peer(name, regions=self._regions, timeout=5.0)
            if len(self._peers) > 64:
                self._peers.clear()
            self._peers[name] = peer
        return peer

    def forget(self, name: str) -> None:
        """Looks ``name`` up anew next time."""
        self._peers.pop(name, None)


async def follow_log(t: Transport, relay: Peer, key: str, base: int, order: Order, capacity: int,
                     takeover: Callable[[], int], copy: Callable[[int, int], Awaitable[bool]],
                     finish: Callable[[End], Awaitable[Ack]]) -> Ack:
    """Follows relay ``relay``'s log of ``order`` (in its block ``key``, the section from word
    ``base``) to its end: ``copy(lo, hi)`` copies parts ``lo .. hi - 1`` as the log's count
    grows past them (False: they do not fit: the order fails), ``finish(end)`` once the log
    ended with every part copied. Stops before the next part once ``takeover()`` names the
    order's epoch.

    Returns:
        How the order ended: ``finish``'s answer, ``STOPPED``, or ``FAILED`` (the log moved to
        another epoch, or its count went back or past ``capacity``).

    Raises:
        TransferTimeoutError: the log did not grow for ``STALL_S`` seconds (each wait is one
            :func:`._polling.poll`, begun anew after every part copied).
    """
    head = torch.zeros(3, dtype=torch.int64)
    copied = 0

    async def look() -> Ack | Pending | None:
        """One look at the relay's log: an end (Ack), parts copied (None), or nothing new."""
        nonlocal copied
        if takeover() == order.epoch:
            return Ack.STOPPED
        await t.get(head, relay, key=key, offset=8 * (base + S_EPOCH))
        if int(head[S_EPOCH]) != order.epoch:
            return Ack.FAILED  # the relay's log is another order's now
        count, end = int(head[S_COUNT]), int(head[S_END])
        if not copied <= count <= capacity:
            return Ack.FAILED
        if count > copied:
            if not await copy(copied, count):
                return Ack.FAILED
            copied = count
            return None
        if end in (End.DENSE, End.DELTA):
            # END is written after the last part's count: one more look at the count saw it all.
            memory_barrier()
            await t.get(head, relay, key=key, offset=8 * (base + S_EPOCH))
            if int(head[S_COUNT]) != copied or int(head[S_EPOCH]) != order.epoch:
                return None
            return await finish(End(end))
        return PENDING

    while (ack := await poll(look, timeout=STALL_S, what=f"{t.name}: relay {order.relay}'s log to grow",
                             first=FIRST_WAIT_S, longest=LONGEST_WAIT_S)) is None:
        pass
    return ack


async def acknowledge(t: Transport, words: torch.Tensor, epoch: int, ack: Ack, publisher: str | None,
                      signal: str) -> None:
    """Acknowledges order ``epoch`` in a member's block (``words``: its section, from word 0):
    how it ended first, then the epoch it is for; then rings the publisher's ``signal`` (which
    reads the words anyway: a signal that fails, or none where the publisher's name is not
    known, is not an error).

    Raises:
        ClosedError: the Transport closed.
    """
    words[M_ACK] = int(ack)
    memory_barrier()
    words[M_ACK_EPOCH] = epoch
    if publisher is None:
        return
    try:
        await t.signal(publisher, signal, time.time_ns(), timeout=2.0)
    except ClosedError:
        raise
    except TransportError:
        pass
