"""The trainer side of weight sync: ``Publisher``.

A publish packs what cannot travel straight from the live tensors into one of two snapshots,
pushes the version into every current subscriber independently (bucket by bucket, into the slot
the subscriber is not about to read), makes it the subscriber's front, and rings its doorbell in
the background. It also reports the subscribers served before that have left or died since. See
:mod:`transport.weights` for the whole protocol.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

import anyio
import torch

from .._errors import TransferTimeoutError, TransportError
from .._host import host_id
from .._peers import host_key
from ._codec.format import SPARSE_MAX, index_bytes
from ._control import (
    FRONT,
    StreamKeys,
    decode_front,
    withdraw,
)
from ._doorbells import Doorbells
from ._layout import build_layout, describe, tensors_of
from ._lifecycle import Lifecycle
from ._pipeline import Version, VersionPipeline
from ._push import Pushes
from ._relays import Relays
from ._report import PublishReport, SyncResult, SyncStatus
from ._roster import Roster, Scan
from ._warm import WarmTarget, warm_pushes

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from .. import Peer, PreparedTransfer, Transport

log = logging.getLogger(__name__)


class Publisher(Lifecycle):
    """Trainer side: publishes versions of a state dict to every current subscriber.

    Use as ``async with Publisher(t, model) as pub:`` (or ``await pub.start()`` /
    ``await pub.aclose()``). The publisher rings doorbells in a task group of its own that lives
    from ``start`` to ``aclose``, so those two nest like the ``async with`` they stand for: the
    same task, and no cancel scope (``move_on_after``, a task group) entered between them may
    still be open at ``aclose``.

    Args:
        transport: an open Transport.
        state: an ``nn.Module`` or a name -> tensor mapping (CPU or CUDA). Tensors are read at each
            publish, so in-place optimizer updates are picked up.
        name: the stream name; subscribers name the same one.
        bucket_bytes: target size of one bucket (many small tensors are packed per bucket;
            buckets inside one large tensor go straight from its memory).
        max_inflight: deprecated and ignored: a version now goes to each subscriber as one
            prepared transfer of all its buckets (see :meth:`publish`). Passing it warns.
        deadline: seconds a publish waits for any one subscriber (for a delta version, from the
            end of its diff); slower ones are stragglers.
        rename: trainer name -> wire name, or None to leave the tensor out.
        include: keep only tensors for which this returns True (applied before ``rename``).
        fp8: send tensors for which ``fp8(wire_name, tensor)`` is True as float8 e4m3 with a
            per-tensor scale (subscribers convert back to their own dtype on apply).
        delta: delta sync: each version is diffed bit for bit against the previous one while
            it is packed, and a subscriber that holds exactly that previous version (and
            nothing newer pending) receives only the new values of the changed elements, per
            tensor up to ``delta_crossover`` changed (dense above it; a version whose sample of
            the change is above it goes dense without the full diff, as fast as
            ``delta=False``); a subscriber that is behind, new or restarted gets the dense
            version. ``"auto"`` (the default) sends deltas only where they pay: to subscribers
            reached over a network backend, not over ``ipc`` (a link as fast as the memory pass
            that finds the change: measured 1.3-2.6x slower there); with none of those, no
            version is diffed. ``True`` sends them to every subscriber that takes them.
            Lossless and atomic: the subscriber checks per-tensor checksums before it writes
            anything and applies the delta inside the usual commit, or refuses it whole.
            Costs a third host buffer of up to half the packed size (the encodings). Applies to
            host (CPU) state only; CUDA state and ``delta=False`` send every version dense.
        delta_crossover: the changed fraction of a tensor above which it goes dense. None
            (the default) chooses it per version and per subscriber from what this publisher
            measured: the last dense push to the subscriber, its last diff, and a copy, a
            checksum pass and a scatter timed once on this host (:mod:`._codec.policy`). A
            delta is chosen only where it is predicted to take at most 0.8 of the dense
            version on that subscriber's path, counting what the first delta after a dense
            version pays on top: up to 0.4 over slow networks, where bytes dominate, and none
            at all (the version goes dense to it, undiffed) where no delta would pay, e.g. a
            same-host link as fast as the memory pass that finds the change. A delta stream is
            never meant to be slower than dense.
        relays: per-host relays (:mod:`._relays`): where two or more subscribers that take
            part (``Subscriber(relay=True)``, the default for host slots) share a host other
            than this one, the version crosses the link to that host once, into one of them
            (the first by name that did not fail lately), and the others copy it from there
            over shared memory as its parts land. A relay that fails or stalls costs its host's
            other subscribers at most the deadline, after which they are pushed to directly;
            subscribers on other hosts never wait for it. Each result says whom a subscriber
            copied from (``SyncResult.relayed_by``). False pushes to every subscriber directly.
        relay_timeout: seconds a relay may go without any part landing in it while one is on
            its way; past that it is taken for stalled: its push is aborted (it is reported a
            straggler) and its host's other subscribers get the version without it in the same
            publish. None (the default): ``min(deadline, 5)``.

    Raises:
        ValueError: ``deadline`` or ``relay_timeout`` not positive, ``bucket_bytes`` not positive,
            ``delta_crossover`` neither None nor in (0, 0.5], or two tensors map to one wire
            name.
        TypeError: a state value is not a tensor.
        TransportError: a tensor is on neither the CPU nor a CUDA device.
    """

    def __init__(
        self,
        transport: Transport,
        state: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        name: str = "policy",
        bucket_bytes: int = 16 << 20,
        max_inflight: int | None = None,
        deadline: float = 30.0,
        rename: Callable[[str], str | None] | None = None,
        include: Callable[[str], bool] | None = None,
        fp8: Callable[[str, torch.Tensor], bool] | None = None,
        delta: bool | str = "auto",
        delta_crossover: float | None = None,
        relays: bool = True,
        relay_timeout: float | None = None,
    ) -> None:
        if max_inflight is not None:
            warnings.warn("Publisher(max_inflight=...) is ignored: each subscriber gets a version as one prepared "
                          "transfer of all its buckets", DeprecationWarning, stacklevel=2)
        if not deadline > 0:
            raise ValueError("deadline must be > 0")
        if relay_timeout is not None and not relay_timeout > 0:
            raise ValueError(f"relay_timeout must be > 0, not {relay_timeout!r}")
        if delta not in (True, False, "auto"):
            raise ValueError(f"delta must be True, False or 'auto', not {delta!r}")
        if delta_crossover is not None and not 0 < delta_crossover <= SPARSE_MAX:
            raise ValueError(f"delta_crossover must be in (0, {SPARSE_MAX}], not {delta_crossover!r}")
        self.t = transport
        self.name = name
        self.deadline = float(deadline)
        self._keys = StreamKeys.of(name)
        wire: dict[str, torch.Tensor] = {}
        for k, v in tensors_of(state).items():
            if include is not None and not include(k):
                continue
            w = rename(k) if rename is not None else k
            if w is None:
                continue
            if w in wire:
                raise ValueError(f"two tensors map to the wire name {w!r}")
            wire[w] = v
        self.layout = build_layout(name, wire, bucket_bytes=bucket_bytes, fp8=fp8)
        self._pipeline = VersionPipeline(transport, self._keys, self.layout, wire, self.deadline, bool(delta),
                                         delta_crossover)
        self.version: int | None = None
        self._rings: TaskGroup | None = None  # runs doorbells, fills, passes; open between start and aclose
        self._lock = anyio.Lock()
        self._started = False
        self._roster = Roster(transport, self._keys)
        self._doorbells = Doorbells(transport, self._keys.doorbell, self.deadline)
        self._host = host_key(host_id())  # whose subscribers share our cores (see _applied_here)
        # "auto": no deltas to subscribers reached over a same-host link
        self._pushes = Pushes(transport, name, self._keys, self.layout, self._pipeline.snapshots.source,
                              self._pipeline.crossover, self.deadline, index_bytes(self.layout), delta is True)
        stall = min(self.deadline, 5.0) if relay_timeout is None else float(relay_timeout)
        self._relays = Relays(transport, self._keys, self.layout, self._pushes, self.deadline, stall) \
            if relays else None

    @property
    def staging_bytes(self) -> int:
        """Bytes this publisher holds for staging: two packed snapshots, plus the buffer of
        delta encodings when delta sync is on (allocated once a subscriber that takes deltas
        has received a version)."""
        return self._pipeline.staging_bytes

    @property
    def delta(self) -> bool:
        """Whether versions are diffed and sent as deltas where that pays."""
        return self._pipeline.delta is not None

    async def start(self) -> None:
        """Registers the layout, the snapshots and the control block (read-only to peers), and
        opens the task group that rings doorbells.

        Raises:
            RegistrationError: the stream's keys are registered already (another publisher of
                this stream on this Transport).
            ClosedError: the Transport is closed.
        """
        t, k = self.t, self._keys
        layout_bytes = self.layout.encode()
        layout_t = t.empty(k.layout, len(layout_bytes), torch.uint8, writable=False)
        layout_t.copy_(torch.frombuffer(bytearray(layout_bytes), dtype=torch.uint8))
        self._pipeline.snapshots.register()
        rings = anyio.create_task_group()
        await rings.__aenter__()
        self._rings = rings
        self._doorbells.open(rings)
        self._started = True
        log.info("publisher %s/%s: %s (%d of %d buckets sent straight from the live tensors)", t.name, self.name,
                 describe(self.layout), len(self._pipeline.snapshots.direct), len(self.layout.buckets))

    async def aclose(self) -> None:
        """Withdraws the published regions (subscribers can no longer pull) and stops the
        doorbells still ringing (their subscribers' fronts are set: apply()/wait_version see
        the versions without them).

        Call it from the task that called :meth:`start`, outside every cancel scope entered
        since (see the class docstring). Idempotent. Bounded: the doorbells are cancelled, not
        awaited.

        Cancellation: the regions are withdrawn and the doorbells stopped all the same.
        """
        if not self._started:
            return
        self._started = False
        rings, self._rings = self._rings, None
        self._doorbells.close()
        self._pipeline.stop()  # first: whatever withdrawing raises, the pass takes no more pieces
        try:
            withdraw(self.t, [self._keys.pubctl, *self._keys.snapshots, self._keys.layout])
            await self._pipeline.aclose()
        finally:
            if rings is not None:
                # Whatever leaves the ``async with`` body passes through unchanged (it is not
                # handed to the task group, which would wrap it in an exception group); only a
                # doorbell loop that failed unexpectedly surfaces here, as the group it raised.
                rings.cancel_scope.cancel()
                await rings.__aexit__(None, None, None)

    async def warm(self) -> int:
        """Readies the pushes into subscribers' slots this publisher has not pushed to or warmed
        yet, so that the first version they get costs what later ones do: prepares the push
        into each such slot and warms it (:meth:`PreparedTransfer.warm`: over ``ipc``, this
        process's page tables for the slot's memory, which a first copy would otherwise fault
        in page by page). Moves no weights; subscribers see nothing.

        Optional, and cheap when nothing is new (one scan of the rendezvous): call it where time
        is free, e.g. in a task beside the training step, so that a generator that joins or
        restarts does not make the next :meth:`publish` slow. A publish waits for a warm in
        progress.

        Returns:
            The subscriber slots warmed now.

        Raises:
            TransportError: the publisher is not started. ClosedError: the Transport is closed.

        A subscriber that cannot be warmed (gone, or a slot of another size) is skipped: the
        next :meth:`publish` reports it. Cancellation: safe; what was warmed stays warm.
        """
        if not self._started:
            raise TransportError("publisher not started; use `async with Publisher(...)`")
        async with self._lock:
            subs = (await self._roster.scan()).serve
            snap = self._pipeline.snapshots.snaps[0]
            # A slot has a prepared push once it was pushed to or warmed (those of subscribers no
            # longer served are dropped after a publish; one whose warm failed by warm_pushes).
            have = self._pushes.warmed()
            targets = []
            for peer in subs.values():
                slots = [s for s, key in enumerate(self._keys.slots) if key in peer.regions]
                todo = [s for s in slots if (peer.name, peer.incarnation, s) not in have]
                if not todo or any(peer.regions[self._keys.slots[s]].nbytes != self.layout.total for s in slots):
                    continue

                def prepare(s: int, p: Peer = peer) -> PreparedTransfer:
                    return self._pushes.prepared(p, s, snap)

                def drop(s: int, p: Peer = peer) -> None:
                    self._pushes.drop(p, s, snap)

                targets.append(WarmTarget(peer.name, todo, prepare, drop))
            return await warm_pushes(targets, self.deadline, (), f"publisher {self.t.name}/{self.name}")

    async def wait_snapshot(self, timeout: float | None = None) -> int | None:
        """Waits until the snapshot of the last :meth:`publish` is complete: what ``pull()``
        serves (the publish completes it in the background after it returns, from a
        subscriber's slot or by a delta's patches). A ``pull()`` meanwhile gets it anyway (it
        waits for the fill); this is for the trainer, e.g. to keep the background work of one
        version apart from what it does next.

        Args:
            timeout: seconds to wait (default: the publisher's ``deadline``).

        Returns:
            The version ``pull()`` serves now: the last published one, or the one before when
            its fill failed (logged); None while no version is complete.

        Raises:
            TransferTimeoutError: the background work did not end within ``timeout``.

        Cancellation: safe; the background work goes on.
        """
        limit = self.deadline if timeout is None else timeout
        with anyio.move_on_after(limit) as scope:
            await self._pipeline.snapshots.settled()
        if scope.cancelled_caught:
            raise TransferTimeoutError(f"{self.t.name}: the snapshot of {self.name!r} version {self.version} was not "
                                       f"complete within {limit:g}s")
        front = decode_front(int(self._pipeline.snapshots.ctl[FRONT]))
        return None if front is None else front[0]

    async def subscribers(self) -> list[str]:
        """Names of the peers currently subscribed to this stream (less those reported dead).

        Raises:
            ClosedError: the Transport is closed.
        """
        return sorted((await self._roster.scan()).serve)

    async def publish(self, version: int) -> PublishReport:
        """Snapshots the state dict as ``version`` and pushes it to every current subscriber.

        Subscribers are served independently and concurrently; this returns when each one is
        complete, failed, or hit the deadline (a straggler: its transfers are aborted and its
        live weights stay on the previous complete version). The live tensors may change once it
        returns. The snapshot ``pull`` reads is completed in the background from a subscriber's
        slot that holds the version (or here, before returning, when no subscriber was reached
        one-sidedly); a fill still running when the next publish starts is abandoned for that
        publish's own, and ``pull`` serves the version before it meanwhile.

        Args:
            version: must grow from one publish to the next.

        Returns:
            A :class:`PublishReport`: one :class:`SyncResult` per subscriber, plus a FAILED one
            per subscriber served before that has died since (reported once); ``left``, the
            subscribers served before that have left since (once); and the time of each phase.

        Raises:
            ValueError: ``version`` does not grow.
            TransportError: the publisher is not started.
            ClosedError: the Transport is closed.
            TransportInternalError: the background copy after a dense version into the
                snapshot this publish writes did not stop within 10 s (nothing was written;
                a later publish waits for it again).

        Cancellation: aborts the pushes in flight; subscribers keep their last complete version.
        """
        entry = time.perf_counter()
        if not self._started:
            raise TransportError("publisher not started; use `async with Publisher(...)`")
        if self.version is not None and version <= self.version:
            raise ValueError(f"version must grow: {version} after {self.version}")
        async with self._lock:
            pipeline = self._pipeline
            await pipeline.settle()
            t0 = time.perf_counter()
            v = pipeline.begin(version)
            takers = self._pushes.takers()  # as the last pushes found them
            try:
                scan, results, t_served = await self._prepare_and_serve(v, t0, takers)
                t_pushed = time.perf_counter()
                await pipeline.complete(v, self._pushes.holder(results, scan.serve), self._rings,
                                        lambda: self._doorbells.pending,
                                        functools.partial(self._applied_here, v.number, results, scan.serve))
            finally:
                pipeline.end(v)
            self.version = version
            pipeline.after(v, self._pushes.takers(scan.serve), self._rings)
            serving = self._roster.served(scan)
            self._pushes.forget(serving)
            if self._relays is not None:
                self._relays.forget(serving)
            pipeline.forget(serving)
            end = time.perf_counter()
            # The lookup ran beside the pack and a delta version's diff, the pushes beside the
            # diff: pack_s counts the diff, discover_s what the lookup took past them, push_s
            # what the pushes took past both.
            return PublishReport(version, results, scan.left, queued_s=t0 - entry,
                                 pack_s=v.announced_at - t0 + v.diff_s, discover_s=max(0.0, t_served - v.diffed_at),
                                 push_s=t_pushed - max(t_served, v.diffed_at), snapshot_s=end - t_pushed,
                                 total_s=end - entry, delta=pipeline.stats(v))

    async def _prepare_and_serve(self, v: Version, t0: float,
                                 takers: Collection[str]) -> tuple[Scan, dict[str, SyncResult], float]:
        """The version's sample (or pack), announcement and diff, with the lookup of the
        subscribers beside them: each subscriber is pushed to once the lookup is done and the
        version announced (a delta push sends the diff's parts as it hands them out; a dense
        one starts at once). The lookup reads the rendezvous store (3-7 ms on the 2-core VM
        beside the sample's thread): run before the diff, it held back every delta version.

        Returns:
            The lookup, each subscriber's result (a FAILED one for each found dead), and when
            the pushes began (``time.perf_counter()``).

        Raises:
            What the lookup or a phase raised, as it is (not as a group), once the pushes in
            flight are aborted.
        """
        pipeline = self._pipeline
        results: dict[str, SyncResult] = {}
        found: list[tuple[Scan, float]] = []
        errors: list[Exception] = []
        announced = anyio.Event()
        async with anyio.create_task_group() as tg:

            async def lookup() -> None:
                try:
                    scan = await self._roster.scan()
                except Exception as exc:  # noqa: BLE001 -- raised below
                    errors.append(exc)
                    tg.cancel_scope.cancel()
                    return
                for (name, _), why in scan.dead.items():
                    results[name] = SyncResult(name, v.number, SyncStatus.FAILED, 0, time.perf_counter() - t0, why)
                await announced.wait()
                found.append((scan, time.perf_counter()))
                groups, alone = self._relays.groups(scan.serve) if self._relays else ([], list(scan.serve.values()))
                for peer in alone:
                    tg.start_soon(self._serve, peer, v, t0, results)
                for group in groups:
                    tg.start_soon(self._serve_host, group, v, t0, results)

            tg.start_soon(lookup)
            try:
                await pipeline.prepare(v, takers)
                pipeline.announce(v, takers)
                announced.set()
                await pipeline.diff(v)
            except Exception as exc:  # noqa: BLE001 -- raised below, the pushes aborted
                errors.append(exc)
                tg.cancel_scope.cancel()
        if errors:
            raise errors[0]
        return found[0][0], results, found[0][1]

    async def _applied_here(self, version: int, results: Mapping[str, SyncResult], serve: Mapping[str, Peer]) -> None:
        """Returns once every subscriber on this host that took ``version`` has applied it (one
        that cannot be read is not waited for); bound it with the caller's cancel scope.
        Subscribers on other hosts share neither our cores nor our memory bandwidth."""
        for name, r in results.items():
            peer = serve.get(name)
            if r.status != SyncStatus.DONE or peer is None or peer.host != self._host:
                continue
            try:
                await self._pushes.applied(peer, version)
            except TransportError:  # gone, or its block unreadable: nothing to wait for
                continue

    async def _serve(self, peer: Peer, v: Version, t0: float, results: dict[str, SyncResult]) -> None:
        """Pushes version ``v`` to ``peer`` (:meth:`Pushes.push`), records its result, and rings
        its doorbell once it is complete. A subscriber still following a relay's order is asked
        to stop first (its slots are not written until it has)."""
        if self._relays is not None and not await self._relays.fenced(peer):
            self._done(v, results, peer, self._relays.unfenced(peer, v.number, t0), False)
            return
        result, lost = await self._pushes.push(peer, v.number, v.snap, t0, v.feed, v.chosen)
        self._done(v, results, peer, result, lost)

    async def _serve_host(self, group: list[Peer], v: Version, t0: float, results: dict[str, SyncResult]) -> None:
        """Pushes version ``v`` to a host's subscribers through one of them (:meth:`Relays.serve`)."""
        assert self._relays is not None
        await self._relays.serve(group, v.number, v.snap, t0, v.feed, v.chosen,
                                 functools.partial(self._done, v, results),
                                 functools.partial(self._serve_direct, v, t0, results))

    async def _serve_direct(self, v: Version, t0: float, results: dict[str, SyncResult], peer: Peer) -> None:
        result, lost = await self._pushes.push(peer, v.number, v.snap, t0, v.feed, v.chosen)
        self._done(v, results, peer, result, lost)

    def _done(self, v: Version, results: dict[str, SyncResult], peer: Peer, result: SyncResult, lost: bool) -> None:
        """Records ``peer``'s result, and rings its doorbell once it is complete."""
        results[peer.name] = result
        if lost:  # that incarnation is gone for good: reported once
            self._roster.lost(peer.name, peer.incarnation)
        if result.status == SyncStatus.DONE:
            self._doorbells.ring(peer.name, peer.incarnation, v.number)
