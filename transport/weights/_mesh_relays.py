"""Per-host relays of mesh sync (:class:`MeshRelays`): a trainer rank's bytes of a version cross
the link to a generator host once per group of ranks there that need the very same bytes from
it, into one of them (the group's relay), and the others (its members) copy them from the
relay's slot over shared memory as its pieces land.

Who needs the same bytes: generator ranks whose byte runs from this trainer rank are the same
(:func:`._mesh_push.runs_fingerprint`): the ranks of one place in replicas of one layout, e.g.
rank 0 of every tp=2 replica on an 8-GPU host. A tp=8 host holding one replica shares nothing:
each rank needs its own slices, and every rank is pushed to directly.

How one version goes to a group (two or more ranks that take part, ``MeshSubscriber(relay=True)``,
on one host other than this rank's, reaching each other over ``ipc``):

1. Each is claimed as for a direct push (its done word says "writing": its replica cannot
   commit the slot). One still following an order of an earlier version is asked to stop
   first (the fence of :class:`._relay_order.Acks`).
2. The relay is the first of them by name that did not fail as a relay lately (one that
   failed goes last for ``ROTATE_S`` seconds). The others that get the version the same way
   (dense, or a delta: the same payload) are its members; the rest are pushed to directly.
3. The relay gets the version as pieces of ``PIECE_BYTES`` of its runs (:func:`._binding.cut_runs`),
   ``RELAY_WINDOW`` in flight, each counted in this trainer rank's section of its relay block
   once it landed (a delta: its payload, one piece). Each member gets an order in its own
   section: copy the pieces as they are counted (it cuts the same runs itself, from its own
   view of the plan, and refuses the order when their fingerprint differs), or the payload
   from the relay's delta area into its own.
4. A member acknowledges ``DONE`` once every piece is in its slot; only then, for that very
   order, does this rank mark its done word there. The relay's own done word is marked once
   its pieces landed; for a delta, only once its members copied the payload (its replica
   could otherwise commit the version, and the relay's apply consume the payload first). A
   relay that fails or stalls (nothing lands for ``stall`` seconds while a piece is on its
   way) is rotated out; its members are asked to stop and, once they acknowledged, are pushed
   to directly within the same publish. One that does not acknowledge is a straggler: its done
   word stays "writing" and its slots are not written until it acknowledges.

The flight recorder records each relayed version (``relay``), each failed relay
(``relay-failed``) and each member pushed to without it (``relay-fallback``); members record
what they copied (``relayed``).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio

from .. import _pieces
from .._errors import PeerLostError, TransportError
from .._host import host_id
from .._peers import host_key
from ._mesh_control import slot_of
from ._mesh_push import Claim, MeshPushes, ReplicaPlanMoves
from ._relay_block import RELAY_TRAINER_RANKS, Ack, MeshOrder, Order, mesh_block_words, order_spans, section
from ._relay_order import Acks, RelayLog
from ._report import SyncResult, SyncStatus

if TYPE_CHECKING:
    from .. import Peer, PreparedTransfer, Transport
    from ._codec.runs import Cut
    from ._mesh_control import MeshKeys

log = logging.getLogger(__name__)

PIECE_BYTES = 32 << 20  # a push into a relay goes (and is counted) in pieces this large
RELAY_WINDOW = 3  # pieces of a push into a relay in flight at once
ROTATE_S = 60.0  # a relay that failed goes last for this long

Work = tuple[str, "Peer", ReplicaPlanMoves]  # (label "replica/rank", generator rank, this rank's moves into it)
# A claimed rank of a group: its work, its claim, its delta area (offset, cap) and the payload it takes (None: dense).
Claimed = tuple[Work, Claim, "tuple[int, int] | None", "Cut | None"]


class MeshRelays:
    """Chooses the relays of each version for one trainer rank and serves the groups that have one.

    Args:
        transport: the trainer rank's Transport.
        keys: the stream's region names.
        rank: the trainer rank (its section in each relay block).
        pushes: its pushes (into the relays, and directly to members that fall back).
        deadline: seconds a push may take.
        stall: seconds a relay may go without a piece landing while one is on its way.
    """

    def __init__(self, transport: Transport, keys: MeshKeys, rank: int, pushes: MeshPushes, deadline: float,
                 stall: float) -> None:
        self.t, self.keys, self.rank, self._pushes = transport, keys, rank, pushes
        self.deadline, self.stall = deadline, stall
        self._base = section(rank)
        self._acks = Acks(transport, keys.relay, keys.relay_ack, deadline, stall, base=self._base)
        self._host = host_key(host_id())
        self._failed: dict[str, float] = {}  # relay name -> until when it goes last

    def groups(self, work: list[Work]) -> tuple[list[list[Work]], list[Work]]:
        """Splits the generator ranks to feed into relay groups (two or more that take part, on
        one host other than ours, reaching each other over ``ipc``, needing the very same bytes
        from here) and the rest."""
        if self.rank >= RELAY_TRAINER_RANKS:
            return [], work
        words = 8 * mesh_block_words()
        together: dict[tuple[str, int], list[Work]] = {}
        alone: list[Work] = []
        for item in work:
            peer = item[1]
            region = peer.regions.get(self.keys.relay)
            if region is None or region.nbytes != words or "ipc" not in peer.backends or peer.host == self._host:
                alone.append(item)
                continue
            _, fingerprint = self._pushes.runs_of(peer, item[2])
            together.setdefault((peer.host, fingerprint), []).append(item)
        groups = []
        for items in together.values():
            if len(items) >= 2:
                groups.append(sorted(items, key=lambda w: w[1].name))
            else:
                alone.extend(items)
        return groups, alone

    def forget(self, served: set[tuple[str, str]]) -> None:
        """Drops what is kept for generator ranks no longer served."""
        self._acks.forget(served)
        now = time.monotonic()
        for name in [n for n, until in self._failed.items() if until < now]:
            del self._failed[name]

    async def serve(self, group: list[Work], version: int, t0: float, results: dict[str, SyncResult]) -> None:
        """Serves one relay group: claims each rank, then pushes into the relay and orders the
        members to follow it (or pushes directly to those that cannot); ``results`` gets each
        rank's result by label. Bounded by the deadline and the stall watch.

        The round starts with the ranks claimed within ``stall`` seconds (or once all are): one
        slower to answer is no relay or member this time, and is pushed to directly once it
        is claimed (within the deadline), so it never holds up the others."""
        slot = slot_of(version)
        claimed: dict[str, Claimed] = {}
        started = False  # the round started: ranks claimed from now on are pushed to directly
        waiting = len(group)
        all_claimed = anyio.Event()

        async def direct(entry: Claimed) -> None:
            (label, peer, moves), got, _, _ = entry
            results[label] = await self._pushes.push(label, peer, moves, version, t0, claim=got)

        async def claim(item: Work) -> None:
            nonlocal waiting
            label, peer, _ = item
            entry: Claimed | None = None
            with anyio.move_on_after(self.deadline) as scope:
                try:
                    if not await self._acks.fenced(peer):
                        results[label] = self._result(peer, version, t0, SyncStatus.STRAGGLER,
                                                      "it did not stop following its relay's order within the "
                                                      "deadline (its slots are not written until it does)")
                    else:
                        area = await self._pushes.area(peer)
                        got = await self._pushes.claim(peer, slot, version)
                        if got.busy is not None:
                            results[label] = self._result(peer, version, t0, SyncStatus.STRAGGLER,
                                                          f"slot {slot} is {got.busy}")
                        else:
                            entry = (item, got, area, await self._pushes.cut_for(peer, slot, got, area))
                except TransportError as exc:
                    results[label] = self._result(peer, version, t0, SyncStatus.FAILED, f"{type(exc).__name__}: {exc}")
            if scope.cancelled_caught:
                results[label] = self._result(peer, version, t0, SyncStatus.STRAGGLER,
                                              f"its slot could not be claimed within {self.deadline:g}s")
            waiting -= 1
            if waiting == 0:
                all_claimed.set()
            if entry is not None and started:
                await direct(entry)
            elif entry is not None:
                claimed[peer.name] = entry

        async with anyio.create_task_group() as tg:
            for item in group:
                tg.start_soon(claim, item)
            with anyio.move_on_after(self.stall):
                await all_claimed.wait()
            started = True
            now = time.monotonic()
            order = sorted(claimed, key=lambda n: (self._failed.get(n, 0.0) > now, n))
            if not order:
                return
            relay = claimed[order[0]]
            delta = relay[3] is not None
            members = [claimed[n] for n in order[1:] if (claimed[n][3] is not None) == delta]
            others = [claimed[n] for n in order[1:] if (claimed[n][3] is not None) != delta]
            for entry in others if members else [relay, *others]:
                tg.start_soon(direct, entry)
            if members:
                tg.start_soon(self._round, relay, members, version, t0, results, direct)

    async def _round(self, relay: Claimed,
                     members: list[Claimed], version: int, t0: float,
                     results: dict[str, SyncResult], direct: Callable[[Claimed], Awaitable[None]]) -> None:
        """One relay and its members (see the module's docstring)."""
        slot = slot_of(version)
        (rlabel, rpeer, rmoves), _, rarea, made = relay
        _, fingerprint = self._pushes.runs_of(rpeer, rmoves)
        pieces = [] if made is not None else self._pushes.pieces(rpeer, slot, rmoves, PIECE_BYTES)
        epoch = secrets.randbits(62) + 1
        names = ", ".join(m[0][1].name for m in members)
        self.t._flight.event("relay", rpeer.name, f"version {version} (epoch {epoch}) from trainer rank {self.rank} "
                                                  f"to {names}")
        relay_failed = anyio.Event()
        same_host: list[bool] = []

        async def push_relay(rlog: RelayLog) -> None:
            result: SyncResult | None = None
            with anyio.CancelScope() as pushing:
                async with anyio.create_task_group() as watch:
                    async def watchdog() -> None:
                        while not rlog.stalled(self.stall):
                            await anyio.sleep(min(0.1, self.stall / 4))
                        pushing.cancel()

                    watch.start_soon(watchdog)
                    result = await self._push_relay(rpeer, rmoves, version, t0, rarea, made, pieces, rlog, same_host)
                    watch.cancel_scope.cancel()
            if result is None:
                result = self._result(rpeer, version, t0, SyncStatus.STRAGGLER,
                                      f"stalled as the relay of its host: nothing landed for {self.stall:g}s")
            results[rlabel] = result
            if result.status != SyncStatus.DONE:
                rlog.stop()
                self._failed[rpeer.name] = time.monotonic() + ROTATE_S
                self.t._flight.event("relay-failed", rpeer.name, f"version {version}: {result.error}")
                relay_failed.set()

        def late(rlog: RelayLog) -> bool:
            """Whether a member still without the version is taken over: the relay failed, or
            has held the version for ``stall`` seconds."""
            ended = rlog.ended_at
            return relay_failed.is_set() or (ended is not None and time.monotonic() - ended > self.stall)

        async def member(entry: Claimed, rlog: RelayLog) -> None:
            (label, peer, _), _, area, cut = entry
            if cut is not None and (area is None or rarea is None):
                raise AssertionError("a delta member without delta areas")
            extra = MeshOrder(fingerprint, PIECE_BYTES) if cut is None else \
                MeshOrder(fingerprint, PIECE_BYTES, rarea[0], area[0], cut.payload.numel())  # type: ignore[index]
            order = Order(epoch, version, rpeer.name, slot, slot, extra.words())
            result: SyncResult | None = None
            async with anyio.create_task_group() as wait:  # (the order goes out once the log is of its epoch)
                async def until(event: anyio.Event) -> None:
                    await event.wait()
                    wait.cancel_scope.cancel()

                wait.start_soon(until, rlog.begun)
                wait.start_soon(until, relay_failed)
            try:
                if rlog.begun.is_set():
                    if cut is None:
                        await self._pushes.clear_delta(peer, slot, area)
                    self._acks.ordering(peer, epoch)
                    for words, offset in order_spans(order, self._base):
                        await self.t.put(words, peer.name, key=self.keys.relay, offset=offset, timeout=self.deadline)
                    await self.t.signal(peer.name, self.keys.relay_wake, time.time_ns(), timeout=self.deadline)
                    ack: Ack | None = None
                    with anyio.move_on_after(2 * (self.deadline + self.stall)):  # (a bound of last resort)
                        ack = await self._acks.acked(peer, epoch, lambda: late(rlog))
                    if ack is None:
                        ack = await self._acks.take_over(peer, epoch)
                    if ack is None:
                        result = self._result(peer, version, t0, SyncStatus.STRAGGLER,
                                              f"still following relay {rpeer.name} after the {self.deadline:g}s "
                                              f"deadline")
                    elif ack is Ack.DONE and rlog.ended is not None:
                        await self._pushes.mark_done(peer, slot, version)
                        if cut is not None:
                            self._pushes.sent_delta(peer, slot, cut)
                        else:
                            await self._pushes.pushed_dense(peer, slot, all(same_host))
                        nbytes, as_delta = rlog.ended
                        result = SyncResult(peer.name, version, SyncStatus.DONE, nbytes, time.perf_counter() - t0,
                                            delta=as_delta, relayed_by=rpeer.name)
            except TransportError as exc:
                result = self._result(peer, version, t0, SyncStatus.FAILED, f"{type(exc).__name__}: {exc}")
                if isinstance(exc, PeerLostError):
                    results[label] = result
                    return
            if result is None:  # it did not get the version from the relay: pushed to directly
                if not self._acks.pending(peer):
                    self.t._flight.event("relay-fallback", peer.name, f"version {version} from trainer rank "
                                                                      f"{self.rank}: not through {rpeer.name}")
                    await direct(entry)
                    return
                result = self._result(peer, version, t0, SyncStatus.STRAGGLER, "it did not acknowledge its order")
            results[label] = result

        async with anyio.create_task_group() as tg:
            rlog = RelayLog(self.t, rpeer.name, self.keys.relay, epoch, max(1, len(pieces)), self.deadline, tg,
                            base=self._base, rows=False)
            tg.start_soon(push_relay, rlog)
            for entry in members:
                tg.start_soon(member, entry, rlog)
        rlog.close()
        got = results.get(rlabel)
        if made is not None and got is not None and got.status is SyncStatus.DONE:  # a delta: see _push_relay
            try:
                with anyio.fail_after(self.deadline):
                    await self._pushes.mark_done(rpeer, slot, version)
            except (TransportError, TimeoutError) as exc:
                results[rlabel] = self._result(rpeer, version, t0, SyncStatus.FAILED, f"{type(exc).__name__}: {exc}")

    async def _push_relay(self, peer: Peer, moves: ReplicaPlanMoves, version: int, t0: float,
                          area: tuple[int, int] | None, made: Cut | None, pieces: list[PreparedTransfer],
                          rlog: RelayLog, same_host: list[bool]) -> SyncResult:
        """Pushes the version into the relay (claimed), counting each piece in its log once it
        landed, then marks it done there (a dense version; a delta's payload is marked once
        the members copied it: the relay's apply consumes it); its result."""
        slot = slot_of(version)
        try:
            if made is not None and area is not None:
                await rlog.begin()
                handle = self.t.put(made.payload, peer.name, key=self.keys.deltas[slot], offset=area[0],
                                    timeout=self.deadline)
                rlog.follow(handle, [(0, made.payload.numel())])
                await handle
                await rlog.end(True, made.payload.numel())
                self._pushes.sent_delta(peer, slot, made)
                # Marked done only once its members copied the payload (:meth:`_round`): the
                # relay's replica could commit the version, and the relay apply and clear it.
                return SyncResult(peer.name, version, SyncStatus.DONE, made.payload.numel(),
                                  time.perf_counter() - t0, delta=True)
            else:
                await self._pushes.clear_delta(peer, slot, area)
                await rlog.begin()

                async def move(i: int) -> None:
                    handle = pieces[i].start(timeout=self.deadline)
                    rlog.follow(handle, [(i, 0)])
                    await handle
                    same_host.append(handle.same_host is True)

                await _pieces.run(range(len(pieces)), move, RELAY_WINDOW)
                nbytes = sum(m.nbytes for m in moves.moves)
                await rlog.end(False, nbytes)
                await self._pushes.pushed_dense(peer, slot, all(same_host))
                await self._pushes.mark_done(peer, slot, version)
        except TransportError as exc:
            return self._result(peer, version, t0, SyncStatus.FAILED, f"{type(exc).__name__}: {exc}")
        return SyncResult(peer.name, version, SyncStatus.DONE, nbytes, time.perf_counter() - t0)

    @staticmethod
    def _result(peer: Peer, version: int, t0: float, status: SyncStatus, why: str) -> SyncResult:
        return SyncResult(peer.name, version, status, 0, time.perf_counter() - t0, why)
