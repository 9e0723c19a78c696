"""A generator rank's part in mesh relays (:class:`MeshRelayMember`): it follows the orders
trainer ranks write into its relay block (one section per trainer rank, :mod:`._relay_block`),
copying that trainer rank's bytes of a version from its host's relay's slot into its own as
the relay's log counts their pieces (or a delta's payload from the relay's delta area into its
own), and acknowledges each order.

It runs as a service of the rank's Transport, from ``start`` to ``aclose``, woken by a trainer
rank's signal (and looking every ``IDLE_LOOK_S`` seconds besides); the orders of several
trainer ranks are followed at once. It never marks a slot done: the trainer rank does, once
it saw the ``DONE`` acknowledgement of that very order. The pieces are cut from this rank's own
runs from that trainer rank (its view of the plan); an order whose fingerprint of those runs
differs, or that does not fit its slots and areas, is refused (``FAILED``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
import numpy as np
import torch

from .._errors import ClosedError, TransferTimeoutError
from ._binding import cut_runs
from ._control import memory_barrier
from ._mesh_control import slot_of
from ._mesh_push import runs_fingerprint
from ._relay_block import (
    M_ACK_EPOCH,
    M_EPOCH,
    M_TAKEOVER,
    MAX_PIECES,
    MESH_EXTRA,
    RELAY_TRAINER_RANKS,
    RELAYS_ON,
    S_COUNT,
    S_END,
    S_EPOCH,
    SECTION_WORDS,
    Ack,
    End,
    MeshOrder,
    Order,
    section,
)
from ._relay_member import IDLE_LOOK_S, RelayLookup, acknowledge, follow_log

if TYPE_CHECKING:
    from .. import Peer, PreparedTransfer, Transport
    from ._mesh_control import MeshKeys

log = logging.getLogger(__name__)

# What the rank knows of a trainer rank: (its byte runs into this rank, its peer name), or None
# (it does not feed this rank under the plan, or the plan is not known).
Source = Callable[[int], Awaitable["tuple[np.ndarray, str] | None"]]


class MeshRelayMember:
    """Follows the mesh relay orders in one generator rank's relay block.

    Args:
        transport: the rank's Transport.
        keys: the stream's region names.
        block: its relay block (registered, int64, ``mesh_block_words()``).
        slots: its two slots.
        areas: its two delta areas, once made (empty: it takes no deltas).
        source: trainer rank -> its runs into this rank and its name (:data:`Source`).
    """

    def __init__(self, transport: Transport, keys: MeshKeys, block: torch.Tensor, slots: list[torch.Tensor],
                 areas: Callable[[], list[torch.Tensor]], source: Source) -> None:
        self.t, self._keys, self._block, self._slots = transport, keys, block, slots
        self._areas, self._source = areas, source
        self._sections = block.view(RELAY_TRAINER_RANKS, SECTION_WORDS)
        self._following: set[int] = set()  # trainer ranks whose order is being followed
        self._relays = RelayLookup(transport, [keys.relay, keys.slots[1]])
        # (relay, incarnation, slot, fingerprint, piece bytes) -> the prepared gets of its pieces
        self._gets: dict[tuple[str, str, int, int, int], list[PreparedTransfer]] = {}
        self.followed = 0  # orders acknowledged DONE

    async def run(self) -> None:
        """Follows orders until cancelled, or until the Transport closes."""
        try:
            async with anyio.create_task_group() as tg:
                woken = 0
                while True:
                    try:
                        woken = await self.t.wait_signal(self._keys.relay_wake, at_least=woken + 1,
                                                         timeout=IDLE_LOOK_S)
                    except TransferTimeoutError:
                        pass
                    epochs, acks = self._sections[:, M_EPOCH], self._sections[:, M_ACK_EPOCH]
                    for rank in torch.nonzero((epochs > 0) & (epochs != acks)).flatten().tolist():
                        if rank not in self._following:
                            self._following.add(rank)
                            tg.start_soon(self._one, rank)
        except ClosedError:
            return

    async def _one(self, rank: int) -> None:
        """Follows trainer rank ``rank``'s order and acknowledges it (until the Transport closes)."""
        try:
            await self._order(rank)
        except ClosedError:
            return
        finally:
            self._following.discard(rank)

    async def _order(self, rank: int) -> None:
        """Reads trainer rank ``rank``'s order, follows it, and acknowledges it."""
        words = self._sections[rank]
        epoch = int(words[M_EPOCH])
        order = Order.read(words, 2, MESH_EXTRA)
        memory_barrier()
        if int(words[M_EPOCH]) != epoch:  # rewritten while it was read: look again
            return
        ack, trainer, why = Ack.FAILED, None, ""
        if order is None:
            log.warning("%s: a relay order of trainer rank %d that does not fit (refused)", self.t.name, rank)
        else:
            try:
                ack, trainer, why = await self._follow(rank, order)
            except ClosedError:
                raise
            except Exception as exc:  # noqa: BLE001 -- whatever an order (anyone's to write) leads to: refused
                why = f"{type(exc).__name__}: {exc}"
            if why:
                log.info("%s: cannot copy version %d of trainer rank %d from relay %s: %s", self.t.name,
                         order.version, rank, order.relay, why)
            if ack is not Ack.DONE:
                self._relays.forget(order.relay)
            self.t._flight.event("relayed", order.relay, f"version {order.version} of trainer rank {rank} into "
                                                         f"slot {order.dst}: {ack.name}{': ' + why if why else ''}")
        if ack is Ack.DONE:
            self.followed += 1
        await acknowledge(self.t, words, epoch, ack, trainer, self._keys.relay_ack)

    async def _follow(self, rank: int, order: Order) -> tuple[Ack, str | None, str]:
        """Copies trainer rank ``rank``'s bytes of the order's version as the relay's log
        counts them; how it ended, the trainer rank's name (None: not known here), and why it
        was refused (empty: it was not)."""
        mo = MeshOrder.of(order.extra)
        s = slot_of(order.version)
        if order.src != s or order.dst != s or not 0 < mo.piece_bytes:
            return Ack.FAILED, None, f"slots {order.src} -> {order.dst} or pieces of {mo.piece_bytes} bytes do not fit"
        got = await self._source(rank)
        if got is None:
            return Ack.FAILED, None, f"trainer rank {rank} does not feed this rank (or is not listed)"
        runs, trainer = got
        if runs_fingerprint(runs) != mo.fingerprint:
            return Ack.FAILED, trainer, "the relay's runs are not this rank's"  # (the trainer rank pushes here)
        relay = await self._relays.get(order.relay)
        k = self._keys
        if mo.nbytes:  # a delta: its payload, as one piece
            copy, want, capacity = self._payload(relay, s, mo), End.DELTA, 1
        else:
            source = relay.regions.get(k.slots[s])
            total = int(runs[:, 2].sum()) if len(runs) else 0
            if source is None or source.nbytes != self._slots[s].nbytes or total > MAX_PIECES * mo.piece_bytes:
                return Ack.FAILED, trainer, "the relay's slot is not of this rank's size"
            gets = self._prepared(relay, s, runs, mo)
            copy, want, capacity = self._pieces(gets), End.DENSE, max(1, len(gets))

        async def ended(end: End) -> Ack:
            return Ack.DONE if end == want else Ack.FAILED

        finish: Callable[[End], Awaitable[Ack]] = ended

        base = section(rank)
        if mo.flags & RELAYS_ON:  # a link of a chain: what it copied is logged for its own followers
            own = self._sections[rank]
            if int(own[S_EPOCH]) != order.epoch:
                return Ack.FAILED, trainer, "its own log is not of the order's epoch"
            copy, finish = _logging(own, copy, finish)
        ack = await follow_log(self.t, relay, k.relay, base, order, capacity,
                               lambda: int(self._block[base + M_TAKEOVER]), copy, finish)
        return ack, trainer, ""

    def _prepared(self, relay: Peer, s: int, runs: np.ndarray, mo: MeshOrder) -> list[PreparedTransfer]:
        """The prepared gets of the pieces, from the relay's slot into this rank's (made once
        per relay incarnation, slot, runs and piece size)."""
        key = (relay.name, relay.incarnation, s, mo.fingerprint, mo.piece_bytes)
        gets = self._gets.get(key)
        if gets is None:
            if len(self._gets) > 16:
                self._gets.clear()
            gets = self._gets[key] = [self.t.prepare_get_runs(relay, self._slots[s], self._keys.slots[s],
                                                              p[:, [1, 1, 2]]) for p in cut_runs(runs, mo.piece_bytes)]
        return gets

    @staticmethod
    def _pieces(gets: list[PreparedTransfer]) -> Callable[[int, int], Awaitable[bool]]:
        async def copy(lo: int, hi: int) -> bool:
            if hi > len(gets):
                return False
            handles = [gets[i].start() for i in range(lo, hi)]
            for h in handles:
                await h
            return True

        return copy

    def _payload(self, relay: Peer, s: int, mo: MeshOrder) -> Callable[[int, int], Awaitable[bool]]:
        async def copy(lo: int, hi: int) -> bool:
            areas = self._areas()
            if not areas or hi != 1 or not (0 <= mo.dst_off and 0 < mo.nbytes <= areas[s].numel() - mo.dst_off):
                return False
            await self.t.get(areas[s][mo.dst_off:mo.dst_off + mo.nbytes], relay, key=self._keys.deltas[s],
                             offset=mo.src_off)
            return True

        return copy


def _logging(own: torch.Tensor, copy: Callable[[int, int], Awaitable[bool]], finish: Callable[[End], Awaitable[Ack]]
             ) -> tuple[Callable[[int, int], Awaitable[bool]], Callable[[End], Awaitable[Ack]]]:
    """``copy`` and ``finish`` that also log in ``own`` (this rank's section, as a relay of a
    chain): the count of parts copied once their bytes are here, then how the version ended."""

    async def copied(lo: int, hi: int) -> bool:
        if not await copy(lo, hi):
            return False
        memory_barrier()  # the parts' bytes before the count that says they are here
        own[S_COUNT] = hi
        return True

    async def finished(end: End) -> Ack:
        ack = await finish(end)
        if ack is Ack.DONE:
            memory_barrier()
            own[S_END] = int(end)
        return ack

    return copied, finished
