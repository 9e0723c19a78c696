"""Per-host relays of a stream publisher (:class:`Relays`): each version crosses the link to a
generator host once, into one subscriber there (the host's relay), and the host's other
subscribers (its members) copy it from the relay's slot over ``ipc`` as its parts land (shared
memory; CUDA IPC where the slots are on GPUs, ``Subscriber(device=..., relay=True)``).

How one version goes to a host whose subscribers take part (``Subscriber(relay=True)``; two
or more of them, on a host other than the publisher's, reached from each other over ``ipc``):

1. The relay is the first of them by name that did not fail as a relay lately (one that
   failed goes last for ``_relay_order.ROTATE_S`` seconds: the next by name takes over).
2. Each member gets an order in its relay block (:mod:`._relay_block`): copy the version from
   the relay's slot ``src`` into its own free slot ``dst``, following the relay's log of this
   order's epoch; a signal wakes it.
3. The version is pushed into the relay (dense in pieces of consecutive buckets, a few in
   flight, or a delta's parts as the diff hands them out), and each part is logged in the
   relay's block once it is in the relay's memory: the members copy each logged part at
   once (cut-through), so a relay adds about one part of latency.
4. A member acknowledges ``DONE`` once every part (and a delta's header) is in its slot; only
   then, and only for that very order, does the publisher make the slot its front.

Faults: when the push into the relay fails, or stalls (nothing lands for ``stall`` seconds
while a part is on its way; ``Publisher(relay_timeout=...)``), its members are asked
to stop (``M_TAKEOVER``) and, once they acknowledged, are served again within the same
publish, through the next relay by name (one member alone: pushed to directly); a member that
does not acknowledge is a straggler and its slots are not written (next publish asks again
first). Subscribers on other hosts are never waited for. A relay that failed is rotated out.
The flight recorder records each relayed version (``relay``) and each failed relay
(``relay-failed``) under the relay's name, and each member served without it
(``relay-fallback``) under the member's.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import torch

from .._errors import PeerLostError, TransportError
from .._host import host_id
from .._peers import host_key
from ._relay_block import Ack, Order, block_words, order_spans, rows_capacity
from ._relay_order import Acks, RelayLog, Rotation, first_of, watched
from ._report import SyncResult, SyncStatus

if TYPE_CHECKING:
    from .. import Peer, Transport
    from ._control import StreamKeys
    from ._delta_feed import DeltaFeed
    from ._layout import Layout
    from ._push import Look, Pushes

log = logging.getLogger(__name__)



class Relays:
    """Chooses the relays of each version and serves the hosts that have one.

    Args:
        transport: the publisher's Transport.
        keys: the stream's region names.
        layout: its packed layout.
        pushes: the publisher's pushes (into the relays, and directly to members that fall back).
        deadline: seconds a push may take.
        stall: seconds a relay may go without a part landing while one is on its way, after
            which it is taken for stalled (its push is aborted, its members served without it).
    """

    def __init__(self, transport: Transport, keys: StreamKeys, layout: Layout, pushes: Pushes,
                 deadline: float, stall: float) -> None:
        self.t, self._keys, self.layout, self._pushes, self.deadline = transport, keys, layout, pushes, deadline
        self.stall = stall
        self._host = host_key(host_id())
        self._words = block_words(layout)
        self._capacity = rows_capacity(layout)
        self._acks = Acks(transport, keys.relay, keys.relay_ack, deadline, stall)
        self._rotation = Rotation()

    def groups(self, serve: Mapping[str, Peer]) -> tuple[list[list[Peer]], list[Peer]]:
        """Splits the subscribers to serve into host groups that get a relay (two or more that
        take part, on one host other than ours, reaching each other over ``ipc``) and the rest.
        Members not acknowledged yet go with their host all the same (they are asked first)."""
        hosts: dict[str, list[Peer]] = {}
        alone: list[Peer] = []
        for peer in serve.values():
            region = peer.regions.get(self._keys.relay)
            if (region is None or region.nbytes != 8 * self._words or "ipc" not in peer.backends
                    or peer.host == self._host or self._keys.slots[2] in peer.regions):
                alone.append(peer)
            else:
                hosts.setdefault(peer.host, []).append(peer)
        groups = []
        for members in hosts.values():
            if len(members) >= 2:
                groups.append(sorted(members, key=lambda p: p.name))
            else:
                alone.extend(members)
        return groups, alone

    def forget(self, serving: set[tuple[str, str]]) -> None:
        """Drops what is kept for subscribers no longer served."""
        self._acks.forget(serving)
        self._rotation.expire()

    async def fenced(self, peer: Peer) -> bool:
        """Whether ``peer``'s slots may be written (:meth:`Acks.fenced`)."""
        return await self._acks.fenced(peer)

    async def serve(self, group: list[Peer], version: int, snap: torch.Tensor, t0: float, feed: DeltaFeed | None,
                    chosen: Mapping[str, float], done: Callable[[Peer, SyncResult, bool], None],
                    direct: Callable[[Peer], Coroutine[Any, Any, None]]) -> None:
        """Serves one host group: its relay, and each member through it (or directly, when it
        cannot follow). When the relay fails, the members it left without the version are
        served again, through the next relay (or directly, one alone), within the same
        publish. ``done(peer, result, lost)`` is told each subscriber's result; ``direct(peer)``
        pushes to one directly (and tells ``done`` itself)."""
        again = await self._round(group, version, snap, t0, feed, chosen, done, direct)
        while len(again) >= 2:
            log.info("publisher %s: version %d to %s through a new relay", self.t.name, version,
                     ", ".join(p.name for p in again))
            again = await self._round(again, version, snap, t0, feed, chosen, done, direct)
        for peer in again:
            await direct(peer)

    async def _round(self, group: list[Peer], version: int, snap: torch.Tensor, t0: float, feed: DeltaFeed | None,
                     chosen: Mapping[str, float], done: Callable[[Peer, SyncResult, bool], None],
                     direct: Callable[[Peer], Coroutine[Any, Any, None]]) -> list[Peer]:
        """One relay for ``group`` (see :meth:`serve`); the members to serve again: those its
        failure left without the version, once they stopped following it."""
        looks: dict[str, Look] = {}
        fallback: list[Peer] = []

        async def look(peer: Peer) -> None:
            if not await self.fenced(peer):
                done(peer, self.unfenced(peer, version, t0), False)
                return
            with anyio.move_on_after(self.stall):  # one that does not answer now is no relay or member now
                try:
                    looks[peer.name] = await self._pushes.look(peer)
                    return
                except TransportError:
                    pass
            fallback.append(peer)  # its own push says why (it looks again)

        async with anyio.create_task_group() as tg:
            for peer in group:
                tg.start_soon(look, peer)
        by_name = {p.name: p for p in group}
        relay = next((by_name[n] for n in self._rotation.order(by_name) if n in looks), None)
        members: list[Peer] = []
        if relay is not None:
            kind = self._pushes.wants_delta(relay, looks[relay.name], feed, chosen)
            for peer in group:
                if peer is relay or peer.name not in looks:
                    continue
                if self._pushes.wants_delta(peer, looks[peer.name], feed, chosen) == kind:
                    members.append(peer)
                else:
                    fallback.append(peer)
        if relay is None or not members:  # nobody to relay to: each as any subscriber
            async with anyio.create_task_group() as tg:
                for peer in group:
                    if peer.name in looks or peer in fallback:
                        tg.start_soon(direct, peer)
            return []
        again: list[Peer] = []
        epoch = secrets.randbits(62) + 1
        names = ", ".join(m.name for m in members)
        self.t._flight.event("relay", relay.name, f"version {version} (epoch {epoch}) to {names}")
        log.debug("publisher %s: version %d through %s to %s", self.t.name, version, relay.name, names)
        relay_failed, relay_ended = anyio.Event(), anyio.Event()

        async def push_relay(rlog: RelayLog) -> None:
            got = await watched(rlog, self.stall, lambda: self._pushes.push(relay, version, snap, t0, feed, chosen,
                                                                            relay_log=rlog, look=looks[relay.name]))
            if got is None:  # stalled: its transfers were aborted with the push
                why = f"stalled as the relay of its host: nothing landed for {self.stall:g}s"
                got = SyncResult(relay.name, version, SyncStatus.STRAGGLER, 0, time.perf_counter() - t0, why), False
            result, lost = got
            done(relay, result, lost)
            if result.status != SyncStatus.DONE:
                rlog.stop()
                self._rotation.failed(relay.name)
                self.t._flight.event("relay-failed", relay.name, f"version {version}: {result.error}")
                relay_failed.set()  # its members are taken over (it may never read its log again)
            relay_ended.set()

        def late(rlog: RelayLog) -> bool:
            """Whether a member still without the version should be taken over: the relay
            failed, or it has held the version for ``stall`` seconds."""
            return relay_failed.is_set() or (rlog.ended_at is not None
                                             and time.monotonic() - rlog.ended_at > self.stall)

        async def member(peer: Peer, rlog: RelayLog) -> None:
            order = Order(epoch, version, relay.name, looks[relay.name].back, looks[peer.name].back)
            result: SyncResult | None = None
            # The order goes out once the relay's log is of its epoch (a member that looked
            # before would take the old log for a failed relay).
            await first_of(rlog.begun, relay_failed)
            if not rlog.begun.is_set():
                again.append(peer)
                return
            try:
                self._acks.ordering(peer, epoch)
                for words, offset in order_spans(order):
                    await self.t.put(words, peer.name, key=self._keys.relay, offset=offset, timeout=self.deadline)
                await self.t.signal(peer.name, self._keys.relay_wake, time.time_ns(), timeout=self.deadline)
                # Its wait: as long as the relay's push runs (bounded by its deadline and its stall
                # watch), then ``stall`` seconds for the last part's copy.
                ack: Ack | None = None
                with anyio.move_on_after(2 * (self.deadline + self.stall)):  # (a bound of last resort)
                    ack = await self._acks.acked(peer, epoch, functools.partial(late, rlog))
                if ack is None:  # the relay failed or stalled: ask the member to stop, then push to it
                    ack = await self._acks.take_over(peer, epoch)
                if ack is None:
                    result = SyncResult(peer.name, version, SyncStatus.STRAGGLER, 0, time.perf_counter() - t0,
                                        f"still following relay {relay.name} after the {self.deadline:g}s deadline")
                elif ack is Ack.DONE and rlog.ended is not None:
                    await self._pushes.commit(peer, order.dst, version)
                    self._pushes.relayed(peer, order.dst)
                    nbytes, delta = rlog.ended
                    result = SyncResult(peer.name, version, SyncStatus.DONE, nbytes, time.perf_counter() - t0,
                                        delta=delta, relayed_by=relay.name)
            except TransportError as exc:
                result = SyncResult(peer.name, version, SyncStatus.FAILED, 0, time.perf_counter() - t0,
                                    f"{type(exc).__name__}: {exc}")
                if isinstance(exc, PeerLostError):
                    done(peer, result, True)
                    return
            if result is None:  # it did not get the version from the relay: did the relay fail?
                await relay_ended.wait()  # (bounded by the relay's own push)
            if result is None and relay_failed.is_set():  # the relay left it without the version
                self.t._flight.event("relay-fallback", peer.name, f"version {version}: not through {relay.name}")
                again.append(peer)
            elif result is None:  # it could not follow a relay that holds the version: pushed to directly
                self.t._flight.event("relay-fallback", peer.name, f"version {version}: pushed directly, not "
                                                                  f"through {relay.name}")
                await direct(peer)
            else:
                done(peer, result, False)

        async with anyio.create_task_group() as tg:
            rlog = RelayLog(self.t, relay.name, self._keys.relay, epoch, self._capacity, self.deadline, tg)
            tg.start_soon(push_relay, rlog)
            for peer in members:
                tg.start_soon(member, peer, rlog)
            for peer in fallback:
                tg.start_soon(direct, peer)
        rlog.close()
        return again

    def unfenced(self, peer: Peer, version: int, t0: float) -> SyncResult:
        """The result of a subscriber whose slots cannot be written: it did not acknowledge
        being asked to stop following its relay's order (it may still copy into a slot)."""
        return SyncResult(peer.name, version, SyncStatus.STRAGGLER, 0, time.perf_counter() - t0,
                          "it did not stop following its relay's order within the deadline (its slots are not "
                          "written until it does)")
