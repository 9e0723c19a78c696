"""Per-host relays (and chains of them) of mesh sync (:class:`MeshRelays`): a trainer rank's
bytes of a version cross the link to a generator host once per group of ranks there that need
the very same bytes from it, into one of them (the group's relay), and the others (its members)
copy them from the relay's slot over shared memory as its pieces land.

Who needs the same bytes: generator ranks whose byte runs from this trainer rank are the same
(:func:`._mesh_push.runs_fingerprint`): the ranks of one place in replicas of one layout, e.g.
rank 0 of every tp=2 replica on an 8-GPU host (the trainer layout's ``balance`` makes the
planner take a part several trainer ranks hold from the same one for all of them). A tp=8
host holding one replica shares nothing: each rank needs its own slices, and every rank is
pushed to directly.

A chain (``mode="chain"``) is one tree over every host whose ranks need the same bytes: the
first host's relay is pushed to, each next host's relay follows the previous one over the
network (its order says ``RELAYS_ON``: it counts what it copied in its own section, which its
own followers read), and each host's members follow their host's relay.

How one version goes to a group (two or more ranks that take part, ``MeshSubscriber(relay=True)``,
on one host other than this rank's, reaching each other over ``ipc``):

1. Each is claimed as for a direct push (its done word says "writing": its replica cannot
   commit the slot). One still following an order of an earlier version is asked to stop
   first (the fence of :class:`._relay_order.Acks`).
2. The relay is the first of them by name that did not fail as a relay lately (one that
   failed goes last for ``_relay_order.ROTATE_S`` seconds). The others that get the version the same way
   (dense, or a delta: the same payload) are its members; the rest are pushed to directly.
3. The relay gets the version as pieces of ``PIECE_BYTES`` of its runs
   (:func:`._binding.cut_runs`), ``RELAY_WINDOW`` in flight, each counted in this trainer
   rank's section of its relay block once it landed (a delta: its payload, one piece). Each
   member gets an order in its own section: copy the pieces as they are counted (it cuts the
   same runs itself, from its own view of the plan, and refuses the order when their
   fingerprint differs), or the payload from the relay's delta area into its own.
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
import torch

from .. import _pieces
from .._errors import PeerLostError, TransportError
from .._host import host_id
from .._peers import host_key
from ._mesh_control import slot_of
from ._mesh_push import Claim, MeshPushes, ReplicaPlanMoves
from ._relay_block import (
    RELAY_TRAINER_RANKS,
    RELAYS_ON,
    S_EPOCH,
    Ack,
    End,
    MeshOrder,
    Order,
    mesh_block_words,
    order_spans,
    section,
)
from ._relay_order import PIECE_BYTES, RELAY_WINDOW, Acks, RelayLog, Rotation, first_of, watched
from ._report import SyncResult, SyncStatus

if TYPE_CHECKING:
    from .. import Peer, PreparedTransfer, Transport
    from ._codec.runs import Cut
    from ._mesh_control import MeshKeys

log = logging.getLogger(__name__)


Work = tuple[str, "Peer", ReplicaPlanMoves]  # (label "replica/rank", generator rank, this rank's moves into it)
# A claimed rank of a group: its work, its claim, its delta area (offset, cap) and the payload it takes (None: dense).
Claimed = tuple[Work, Claim, "tuple[int, int] | None", "Cut | None"]


class _Source:
    """A relay of one round as its followers see it: when its log is of the round's epoch,
    whether it failed, when it came to hold the whole version, and when its followers ended.

    Args:
        peer: the relay.
        area: its (offset, cap) in its delta areas for this trainer rank (None: none).
        followers: how many follow it.
    """

    def __init__(self, peer: Peer, area: tuple[int, int] | None, followers: int, log: RelayLog | None = None
                 ) -> None:
        self.peer, self.area, self._log = peer, area, log
        self.begun = log.begun if log is not None else anyio.Event()
        self.failed, self.settled, self.holding = anyio.Event(), anyio.Event(), anyio.Event()
        self._ended: tuple[tuple[int, bool], float] | None = None
        self._left = followers
        if followers == 0:
            self.settled.set()

    @property
    def ended(self) -> tuple[int, bool] | None:
        """(bytes, as a delta) once it holds the whole version (the root: once the last piece
        landed, before its push's last words: its members may acknowledge before those)."""
        if self._log is not None:
            return self._log.ended
        return None if self._ended is None else self._ended[0]

    def end(self, ended: tuple[int, bool]) -> None:
        """It holds the whole version (``ended``: bytes, as a delta); a link of a chain."""
        self._ended = (ended, time.monotonic())
        self.holding.set()

    def late(self, stall: float) -> bool:
        """Whether a follower still without the version is taken over: it failed, or has held
        the version for ``stall`` seconds."""
        at = self._log.ended_at if self._log is not None else None if self._ended is None else self._ended[1]
        return self.failed.is_set() or (at is not None and time.monotonic() - at > stall)

    def follower_done(self) -> None:
        """One of its followers ended (with the version or without)."""
        self._left -= 1
        if self._left <= 0:
            self.settled.set()


class MeshRelays:
    """Chooses the relays of each version for one trainer rank and serves the groups that have one.

    Args:
        transport: the trainer rank's Transport.
        keys: the stream's region names.
        rank: the trainer rank (its section in each relay block).
        pushes: its pushes (into the relays, and directly to members that fall back).
        deadline: seconds a push may take.
        stall: seconds a relay may go without a piece landing while one is on its way.
        mode: ``"host"`` (per-host relays) or ``"chain"`` (the host relays chained across hosts).
    """

    def __init__(self, transport: Transport, keys: MeshKeys, rank: int, pushes: MeshPushes, deadline: float,
                 stall: float, mode: str = "host") -> None:
        if mode not in ("host", "chain"):
            raise ValueError(f"relays must be 'host' or 'chain', not {mode!r}")
        self.mode = mode
        self.t, self.keys, self.rank, self._pushes = transport, keys, rank, pushes
        self.deadline, self.stall = deadline, stall
        self._base = section(rank)
        self._acks = Acks(transport, keys.relay, keys.relay_ack, deadline, stall, base=self._base)
        self._host = host_key(host_id())
        self._rotation = Rotation()

    def groups(self, work: list[Work]) -> tuple[list[list[list[Work]]], list[Work]]:
        """Splits the generator ranks to feed into relay trees and the rest. A tree is a list of
        hosts (each a list of ranks, by name) whose ranks take part, reach each other over
        ``ipc`` within a host, are on hosts other than ours and need the very same bytes from
        here: per-host relays make one tree of each such host with two or more; a chain one
        tree of all such hosts (in the order of their host keys), with two or more ranks in all."""
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
        trees: dict[object, list[list[Work]]] = {}
        for (host, fingerprint), items in sorted(together.items()):
            host_group = sorted(items, key=lambda w: w[1].name)
            trees.setdefault(fingerprint if self.mode == "chain" else (host, fingerprint), []).append(host_group)
        out = []
        for tree in trees.values():
            if sum(len(h) for h in tree) >= 2:
                out.append(tree)
            else:
                alone.extend(w for h in tree for w in h)
        return out, alone

    def forget(self, served: set[tuple[str, str]]) -> None:
        """Drops what is kept for generator ranks no longer served."""
        self._acks.forget(served)
        self._rotation.expire()

    async def serve(self, tree: list[list[Work]], version: int, t0: float, results: dict[str, SyncResult]) -> None:
        """Serves one relay tree (:meth:`groups`): claims each rank, then pushes into the first
        host's relay and orders the others to follow (or pushes directly to those that cannot);
        ``results`` gets each rank's result by label. Bounded by the deadline and the stall watch.

        The round starts with the ranks claimed within ``stall`` seconds (or once all are): one
        slower to answer is no relay or member this time, and is pushed to directly once it
        is claimed (within the deadline), so it never holds up the others."""
        slot = slot_of(version)
        claimed: dict[str, Claimed] = {}
        started = False  # the round started: ranks claimed from now on are pushed to directly
        group = [w for host in tree for w in host]
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
            hosts: list[list[Claimed]] = []
            others: list[Claimed] = []
            delta: bool | None = None  # the root's kind: every node of the tree gets the version the same way
            for host in tree:
                names = self._rotation.order(w[1].name for w in host if w[1].name in claimed)
                mine: list[Claimed] = []
                for n in names:
                    entry = claimed[n]
                    delta = (entry[3] is not None) if delta is None else delta
                    (mine if (entry[3] is not None) == delta else others).append(entry)
                if mine:
                    hosts.append(mine)
            if sum(len(h) for h in hosts) < 2:
                others += [e for h in hosts for e in h]
                hosts = []
            for entry in others:
                tg.start_soon(direct, entry)
            if hosts:
                tg.start_soon(self._tree, hosts, version, t0, results, direct)

    async def _tree(self, hosts: list[list[Claimed]], version: int, t0: float, results: dict[str, SyncResult],
                    direct: Callable[[Claimed], Awaitable[None]]) -> None:
        """One relay tree (see the module's docstring): ``hosts[i][0]`` is host ``i``'s relay,
        the rest its members; host 0's relay is pushed to, host ``i + 1``'s follows host
        ``i``'s (a chain; one host: per-host relays)."""
        slot = slot_of(version)
        root = hosts[0][0]
        (rlabel, rpeer, rmoves), _, rarea, made = root
        _, fingerprint = self._pushes.runs_of(rpeer, rmoves)
        pieces = [] if made is not None else self._pushes.pieces(rpeer, slot, rmoves, PIECE_BYTES)
        epoch = secrets.randbits(62) + 1
        # (the root's log is made with the task group that follows its pieces, below)
        followers = [len(h) - 1 + (i + 1 < len(hosts)) for i, h in enumerate(hosts)]
        for i, h in enumerate(hosts):
            to = [e[0][1].name for e in h[1:]] + ([hosts[i + 1][0][0][1].name] if i + 1 < len(hosts) else [])
            self.t._flight.event("relay", h[0][0][1].name, f"version {version} (epoch {epoch}) from trainer rank "
                                                           f"{self.rank} to {', '.join(to)}")
        same_host: list[bool] = []

        async def push_root(rlog: RelayLog) -> None:
            result = await watched(rlog, self.stall, lambda: self._push_relay(rpeer, rmoves, version, t0, rarea, made,
                                                                              pieces, rlog, same_host))
            if result is None:
                result = self._result(rpeer, version, t0, SyncStatus.STRAGGLER,
                                      f"stalled as the relay of its host: nothing landed for {self.stall:g}s")
            if result.status is SyncStatus.DONE and rlog.ended is not None:
                if made is not None:  # a delta: marked done once its followers copied the payload
                    result = await self._mark_after(sources[0], rpeer, version, t0, result)
            else:
                rlog.stop()
                self._rotation.failed(rpeer.name)
                self.t._flight.event("relay-failed", rpeer.name, f"version {version}: {result.error}")
                sources[0].failed.set()
            results[rlabel] = result

        async def follow(entry: Claimed, source: _Source, own: _Source | None) -> None:
            try:
                await self._follow(entry, source, own, epoch, fingerprint, version, t0, results, direct, same_host)
            finally:
                if own is not None and own.ended is None:
                    own.failed.set()  # (its followers are taken over)
                source.follower_done()

        async with anyio.create_task_group() as tg:
            rlog = RelayLog(self.t, rpeer.name, self.keys.relay, epoch, max(1, len(pieces)), self.deadline, tg,
                            base=self._base, rows=False)
            sources = [_Source(h[0][0][1], h[0][2], followers[i], rlog if i == 0 else None)
                       for i, h in enumerate(hosts)]
            tg.start_soon(push_root, rlog)
            for i, h in enumerate(hosts):
                for entry in h[1:]:
                    tg.start_soon(follow, entry, sources[i], None)
                if i:
                    tg.start_soon(follow, h[0], sources[i - 1], sources[i])
        rlog.close()

    async def _follow(self, entry: Claimed, source: _Source, own: _Source | None, epoch: int, fingerprint: int,
                      version: int, t0: float, results: dict[str, SyncResult],
                      direct: Callable[[Claimed], Awaitable[None]], same_host: list[bool]) -> None:
        """One follower of ``source``: a member of its host, or (``own``: the follower's own
        log, it relays on) the next link of a chain. Ordered once ``source``'s log is of this
        round's epoch; marked done once it acknowledged ``DONE`` (a delta link: once its own
        followers copied the payload); pushed to directly when it could not follow."""
        (label, peer, _), _, area, cut = entry
        slot = slot_of(version)
        if cut is not None and (area is None or source.area is None):
            raise AssertionError("a delta follower without delta areas")
        flags = RELAYS_ON if own is not None else 0
        extra = MeshOrder(fingerprint, PIECE_BYTES, flags=flags) if cut is None or area is None or \
            source.area is None else MeshOrder(fingerprint, PIECE_BYTES, source.area[0], area[0], cut.payload.numel(),
                                               flags)
        order = Order(epoch, version, source.peer.name, slot, slot, extra.words())
        result: SyncResult | None = None
        await first_of(source.begun, source.failed)  # (the order goes out once the log is of its epoch)
        ordered = time.perf_counter()  # (a dense version's time through the relay: its crossover's dense push)
        try:
            if source.begun.is_set() and not source.failed.is_set():
                if cut is None:
                    await self._pushes.clear_delta(peer, slot, area)
                self._acks.ordering(peer, epoch)
                if own is not None:  # its own log first: its followers are ordered once it is of this epoch
                    head = torch.tensor([epoch, 0, int(End.PUSHING)], dtype=torch.int64)
                    await self.t.put(head, peer.name, key=self.keys.relay, offset=8 * (self._base + S_EPOCH),
                                     timeout=self.deadline)
                for words, offset in order_spans(order, self._base):
                    await self.t.put(words, peer.name, key=self.keys.relay, offset=offset, timeout=self.deadline)
                if own is not None:
                    own.begun.set()
                await self.t.signal(peer.name, self.keys.relay_wake, time.time_ns(), timeout=self.deadline)
                ack: Ack | None = None
                with anyio.move_on_after(2 * (self.deadline + self.stall)):  # (a bound of last resort)
                    ack = await self._acks.acked(peer, epoch, lambda: source.late(self.stall))
                if ack is None:
                    if own is not None:
                        own.failed.set()  # its followers are taken over at once, not after its own take-over
                    ack = await self._acks.take_over(peer, epoch)
                if ack is None:
                    result = self._result(peer, version, t0, SyncStatus.STRAGGLER,
                                          f"still following relay {source.peer.name} after the {self.deadline:g}s "
                                          f"deadline")
                elif ack is Ack.DONE and source.ended is None and not source.failed.is_set():
                    # A link of a chain writes its log's end before it acknowledges its own
                    # order: its followers may acknowledge first.
                    with anyio.move_on_after(self.deadline):
                        await first_of(source.holding, source.failed)
                if ack is Ack.DONE and source.ended is not None:
                    nbytes, as_delta = source.ended
                    result = SyncResult(peer.name, version, SyncStatus.DONE, nbytes, time.perf_counter() - t0,
                                        delta=as_delta, relayed_by=source.peer.name)
                    if own is not None:
                        own.end(source.ended)
                    if own is not None and cut is not None:  # a delta link: see _push_relay
                        result = await self._mark_after(own, peer, version, t0, result)
                    else:
                        await self._pushes.mark_done(peer, slot, version)
                    if result.status is SyncStatus.DONE and cut is not None:
                        self._pushes.sent_delta(peer, slot, cut)
                    elif result.status is SyncStatus.DONE:
                        await self._pushes.pushed_dense(peer, slot, all(same_host), time.perf_counter() - ordered)
        except TransportError as exc:
            result = self._result(peer, version, t0, SyncStatus.FAILED, f"{type(exc).__name__}: {exc}")
            if isinstance(exc, PeerLostError):
                results[label] = result
                return
        if result is None:  # it did not get the version from the relay: pushed to directly
            if not self._acks.pending(peer):
                self.t._flight.event("relay-fallback", peer.name, f"version {version} from trainer rank "
                                                                  f"{self.rank}: not through {source.peer.name}")
                await direct(entry)
                return
            result = self._result(peer, version, t0, SyncStatus.STRAGGLER, "it did not acknowledge its order")
        results[label] = result

    async def _mark_after(self, relay: _Source, peer: Peer, version: int, t0: float, result: SyncResult
                          ) -> SyncResult:
        """Marks a relay that got a delta done once its followers ended (they copied its
        payload, or gave up), within the deadline and stall (its followers' own bound); its
        result then (FAILED where the mark could not be written)."""
        with anyio.move_on_after(self.deadline + self.stall):
            await relay.settled.wait()
        try:
            with anyio.fail_after(self.deadline):
                await self._pushes.mark_done(peer, slot_of(version), version)
        except (TransportError, TimeoutError) as exc:
            return self._result(peer, version, t0, SyncStatus.FAILED, f"{type(exc).__name__}: {exc}")
        return result

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

                pushed = time.perf_counter()
                await _pieces.run(range(len(pieces)), move, RELAY_WINDOW)
                nbytes = sum(m.nbytes for m in moves.moves)
                await rlog.end(False, nbytes)
                await self._pushes.pushed_dense(peer, slot, all(same_host), time.perf_counter() - pushed)
                await self._pushes.mark_done(peer, slot, version)
        except TransportError as exc:
            return self._result(peer, version, t0, SyncStatus.FAILED, f"{type(exc).__name__}: {exc}")
        return SyncResult(peer.name, version, SyncStatus.DONE, nbytes, time.perf_counter() - t0)

    @staticmethod
    def _result(peer: Peer, version: int, t0: float, status: SyncStatus, why: str) -> SyncResult:
        return SyncResult(peer.name, version, status, 0, time.perf_counter() - t0, why)
