"""``MeshSubscriber``: one generator rank's side of a mesh stream (see ``_mesh_control``)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import torch

from .._errors import ClosedError, CommitError, TransferTimeoutError, TransportError
from ..plan import (
    MAX_LAYOUT_BYTES,
    GeneratorRank,
    MeshLayoutError,
    Planner,
    RankLayout,
    RankPlan,
    Replica,
    ReplicaPlan,
    decode_trainer,
    encode_rank,
)
from ._binding import byte_runs, slot_layout, snapshot_layout
from ._codec.format import area_table
from ._codec.runs import Materializer
from ._control import decode_front, encode_front, memory_barrier, withdraw
from ._lifecycle import Lifecycle
from ._mesh_control import (
    APPLIED,
    COMMIT,
    CTL_WORDS,
    FRONT,
    GEN0,
    MAT0,
    PROPOSED,
    READING,
    SNAPVER0,
    TCTL_WORDS,
    MeshKeys,
    ctl_words_for,
    done_word,
    slot_of,
    slot_version,
)
from ._mesh_peers import MeshPeers
from ._polling import PENDING, Pending, even, poll, seqlock_read

if TYPE_CHECKING:
    import numpy as np

    from .. import Peer, Transport

log = logging.getLogger(__name__)

_WAIT_S = 0.1  # pull() looks for missing trainer or replica ranks again after this


class MeshSubscriber(Lifecycle):
    """One generator rank of a replica: receives its slices one-sidedly and applies versions
    only when the whole replica holds them.

    Trainer ranks write into this rank's slots; nothing here runs during a push. Between its
    generation steps the replica's leader (rank 0) calls :meth:`commit`, which picks the newest
    version every rank of the replica holds in full and commits it at every rank; each rank then
    calls :meth:`apply`, which copies the committed version into its tensors. A rank that
    (re)starts calls :meth:`pull` to fetch its slices from the trainer ranks' snapshots itself.

    Use as ``async with MeshSubscriber(...) as sub:`` (or ``await sub.start()`` / ``await
    sub.aclose()``; ``close()`` is the same as ``aclose()`` for synchronous callers).
    ``start()`` is a coroutine, as on every weights class.

    Args:
        transport: this rank's open Transport.
        name: the stream name (the trainer ranks use the same).
        replica: the replica id (the same on all its ranks, unique in the job).
        rank: this rank's index in the replica (TP order).
        size: ranks in the replica.
        layout: what this rank needs (e.g. from ``transport.plan.generator_rank``).
        tensors: local tensor name -> the tensor ``apply`` copies into (the model's); by default
            zeroed tensors are allocated (``self.tensors``).
        timeout: default bound of ``commit``/``pull`` (seconds).
        allocate: False: no ``self.tensors`` are allocated (``tensors`` must then be None);
            read committed versions straight from the slots with :meth:`reading` (``apply``
            then raises).
        delta: take deltas (see :mod:`transport.weights._codec.runs`): trainer ranks whose
            publisher sends them write only the changed units of a version, into a delta area
            beside each slot, and this rank applies them into the slot, checked, when it
            reads the committed version. Costs two areas of up to half a slot each, made once
            this rank has seen its replica's plan (at its first commit, wait, pull or
            catch-up). False: every version arrives dense.

    Raises:
        MeshLayoutError: a tensor is missing or differs from the layout in shape or dtype.
    """

    def __init__(self, transport: Transport, name: str, *, replica: str, rank: int, size: int, layout: GeneratorRank,
                 tensors: Mapping[str, torch.Tensor] | None = None, timeout: float = 60.0,
                 allocate: bool = True, delta: bool = True) -> None:
        if not 0 <= rank < size:
            raise MeshLayoutError(f"rank {rank} of a replica of {size}")
        if not allocate and tensors is not None:
            raise ValueError("allocate=False takes no tensors")
        self.t, self.name, self.replica, self.rank, self.size = transport, name, replica, rank, size
        self.layout, self.timeout = layout, timeout
        self.keys = MeshKeys.of(name)
        self.tensors: dict[str, torch.Tensor] = {}
        for lt in layout.tensors if allocate else ():
            dtype = getattr(torch, lt.dtype)
            got = tensors.get(lt.name) if tensors is not None else torch.zeros(lt.shape, dtype=dtype)
            if got is None or tuple(got.shape) != lt.shape or got.dtype != dtype:
                have = None if got is None else (tuple(got.shape), got.dtype)
                raise MeshLayoutError(f"{replica}/{rank}: {lt.name} must be {lt.shape} {lt.dtype}, got {have}")
            self.tensors[lt.name] = got
        self._offsets, self._total = slot_layout(layout)
        self._ctl: torch.Tensor | None = None
        self._slots: list[torch.Tensor] = []
        self._members = MeshPeers(transport, self.keys)
        # The trainer layout's planner, keyed by the trainer rank it was read from (name, incarnation).
        self._trainer: tuple[tuple[str, str], Planner] | None = None
        self._plan: ReplicaPlan | None = None
        self._next_check = 0.0  # catch_up(): when to look at the trainer's versions again
        self._distrusted: int | None = None  # the last committed version found past the trainers' (logged)
        self._behind_since: float | None = None
        self._delta = delta
        self._materializer: Materializer | None = None  # the delta areas, once the plan is known
        self._materialized: tuple[int, int] | None = None  # (version, slot) last made whole here
        self.last_delta: tuple[int, int] = (0, 0)  # of the last version read: (trainer ranks' deltas, units)

    async def start(self) -> None:
        """Registers the slots, the control block and this rank's layout.

        Raises:
            RegistrationError: a region name is taken.
            ClosedError: the Transport is closed.

        Cancellation: nothing here waits; once called, the registration completes.
        """
        data = encode_rank(RankLayout(self.replica, self.rank, self.size, self.layout))
        raw = self.t.empty(self.keys.rank, len(data), torch.uint8, writable=False)
        raw.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._ctl = self.t.empty(self.keys.ctl, CTL_WORDS, torch.int64)
        self._ctl[READING] = -1
        self._slots = [self.t.empty(k, self._total, torch.uint8) for k in self.keys.slots]

    async def aclose(self) -> None:
        """Withdraws this rank's regions: trainer ranks stop serving it from their next
        publish, and its replica cannot commit until it (or a rank in its place) is back.

        Idempotent, and safe after the Transport closed (which withdrew the regions already).
        ``self.tensors`` stay as they are (the last version applied).

        Cancellation: the regions are withdrawn all the same (nothing here waits).
        """
        self.close()

    def close(self) -> None:
        """:meth:`aclose` for synchronous callers (the same, as nothing in it waits)."""
        withdraw(self.t, [*self.keys.slots, self.keys.ctl, self.keys.rank, self.keys.dtab, *self.keys.deltas])

    @property
    def _c(self) -> torch.Tensor:
        if self._ctl is None:
            raise CommitError(f"mesh subscriber {self.replica}/{self.rank}: not started")
        return self._ctl

    def committed(self) -> int | None:
        """The version the replica committed here (None: none yet)."""
        front = decode_front(int(self._c[COMMIT]))
        return None if front is None else front[0]

    def applied(self) -> int | None:
        """The version this rank applied last (None: none yet)."""
        v = int(self._c[APPLIED])
        return v - 1 if v > 0 else None

    # -- apply -----------------------------------------------------------------------------

    def apply(self, version: int | None = None) -> int | None:
        """Copies the committed version into ``self.tensors`` unless it is applied already.

        Args:
            version: the version the caller expects (e.g. agreed through the engine); None: the
                committed one, whichever it is.

        Returns:
            The version now applied (None: nothing committed yet).

        Raises:
            CommitError: ``version`` is given and is not the committed version, or the
                subscriber was made with ``allocate=False``.

        Runs on the calling thread; not cancellable midway (it copies in memory only).
        """
        if len(self.tensors) != len(self.layout.tensors):
            raise CommitError(f"{self.replica}/{self.rank}: made with allocate=False: read versions with reading()")
        with self.reading(version) as got:
            if got is None:
                return None
            v, views = got
            if views is not None:
                for name, view in views.items():
                    self.tensors[name].copy_(view)
        return v

    @contextlib.contextmanager
    def reading(self, version: int | None = None, *, again: bool = False
                ) -> Iterator[tuple[int, dict[str, torch.Tensor] | None] | None]:
        """Holds the committed version's slot for reading, as views (local tensor name ->
        tensor of the layout's shape and dtype), and marks it applied when the block ends
        without an exception. Trainer ranks write no byte of that slot meanwhile.

        Use it to load a version straight from the slot (e.g. through a model's own loading
        path) instead of copying it into ``self.tensors`` first.

        Args:
            version: the version the caller expects; None: the committed one.
            again: give the views even when this version is applied already (by default the
                block then gets ``(v, None)``: nothing to do).

        Yields:
            None (nothing committed yet), ``(v, None)`` (``v`` is applied already) or
            ``(v, views)``. The views are valid inside the block only.

        Raises:
            CommitError: ``version`` is given and is not the committed version.
            DeltaRefusedError: the version arrived as deltas that do not apply to what the
                slot holds (a wrong base, or a payload failing its checks): nothing was
                written and nothing is applied; ``await pull(version=v)`` fetches it whole.
        """
        ctl = self._c
        while True:
            front = decode_front(int(ctl[COMMIT]))
            if front is None:
                if version is not None:
                    raise CommitError(f"{self.replica}/{self.rank}: version {version} is not committed (none is)")
                yield None
                return
            v, s = front
            if version is not None and v != version:
                raise CommitError(f"{self.replica}/{self.rank}: version {version} is not committed ({v} is)")
            if int(ctl[APPLIED]) == v + 1 and not again:
                yield v, None
                return
            ctl[READING] = s  # trainer ranks skip this slot from now on...
            memory_barrier()
            if int(ctl[COMMIT]) == encode_front(v, s):  # ...unless a newer commit moved on meanwhile
                break
            ctl[READING] = -1
        try:
            self._materialize(v, s)
            slot = self._slots[s]
            views = {}
            for lt in self.layout.tensors:
                off, nbytes = self._offsets[lt.name]
                views[lt.name] = slot[off : off + nbytes].view(getattr(torch, lt.dtype)).view(lt.shape)
            yield v, views
            memory_barrier()
            ctl[APPLIED] = v + 1
        finally:
            memory_barrier()
            ctl[READING] = -1

    def _materialize(self, v: int, s: int) -> None:
        """Applies the deltas of version ``v`` waiting for slot ``s`` (held for reading) into
        it, once: the slot then holds all of ``v``."""
        m = self._materializer
        if m is None or self._materialized == (v, s):
            return
        ctl = self._c
        ctl[MAT0 + s] = 0  # written here now: no delta may build on it
        memory_barrier()
        m.materialize(v, s)
        self.last_delta = (m.sources_delta, m.applied_units)
        self._materialized = (v, s)
        ctl[MAT0 + s] = v + 1
        memory_barrier()

    def _make_areas(self, planner: Planner, mine: RankPlan) -> None:
        """Registers the delta areas and their table, sized by what each trainer rank sends
        here under the plan (once)."""
        if not self._delta or self._materializer is not None or not self._slots:
            return
        runs = self._runs_from(planner, mine)
        if not runs or any(bool((r & 1).any()) for r in runs.values()):
            self._delta = False  # nothing fed here, or odd-sized runs (one-byte elements): dense only
            return
        table, nbytes = area_table({t: int(r[:, 2].sum()) for t, r in runs.items()})
        areas = [self.t.empty(k, nbytes, torch.uint8) for k in self.keys.deltas]
        tab = self.t.empty(self.keys.dtab, max(1, table.size) * 8, torch.uint8, writable=False)
        tab.view(torch.int64)[: table.size].copy_(torch.from_numpy(table.reshape(-1)))
        self._materializer = Materializer(self._slots, areas, {int(t): (int(o), int(c)) for t, o, c in table}, runs)

    def _runs_from(self, planner: Planner, mine: RankPlan) -> dict[int, np.ndarray]:
        """Trainer rank -> its byte runs into this rank under the plan (``(snapshot offset,
        slot offset, nbytes)`` rows)."""
        local = {lt.name: lt for lt in self.layout.tensors}
        return {t: byte_runs(planner, (m for m in mine.moves if m.src == t), local,
                             snapshot_layout(planner.trainer, t)[1], self._offsets) for t in mine.sources()}

    # -- the replica ----------------------------------------------------------------------

    async def _replica_now(self) -> _Replica:
        """One look at the store: this replica's ranks, its plan (made here from the published
        layouts, reused while they are unchanged) and the trainer ranks.

        The trainer layout is read once per trainer incarnation. When no trainer rank is listed
        (they all left: exited, crashed, restarting) or its layout cannot be read any more, the
        one read last is used: what trainer ranks completed into the slots before they left
        can still be committed. ``trainers`` then lists only those still listed.

        Raises:
            CommitError: a rank of the replica is not listed; or no trainer rank is listed (or
                its layout cannot be read) and none was ever seen here.
        """
        members = await self._members.scan()
        if members.trainers:
            await self._read_trainer_layout(members.trainers[min(members.trainers)])
        if self._trainer is None:
            raise CommitError(f"{self.replica}/{self.rank}: no trainer rank of stream {self.name!r} in the store")
        planner = self._trainer[1]
        ranks = {rl.rank: n for n, (_, rl) in members.generators.items() if rl.replica == self.replica}
        missing = [r for r in range(self.size) if r not in ranks]
        if missing:
            raise CommitError(f"replica {self.replica}: ranks {missing} are not in the store")
        layouts = tuple(self.layout if r == self.rank else members.generators[ranks[r]][1].layout
                        for r in range(self.size))
        self._plan = planner.plan_replica(Replica(self.replica, layouts), self._plan)
        self._make_areas(planner, self._plan.ranks[self.rank])
        return _Replica(ranks, list(self._plan.ranks), {r: p.name for r, p in members.trainers.items()}, planner)

    async def _read_trainer_layout(self, source: Peer) -> None:
        """Reads ``source``'s trainer layout unless it is the one read last. A trainer rank that
        is gone by now (its record still listed after a crash) leaves the one read last in place.

        Raises:
            CommitError: it publishes no layout, or one of a bad size, or it cannot be read and
                none was read before.
        """
        if self._trainer is not None and self._trainer[0] == (source.name, source.incarnation):
            return
        if self.keys.trainer not in source.regions:
            raise CommitError(f"{self.replica}/{self.rank}: trainer {source.name} publishes no layout")
        nbytes = source.regions[self.keys.trainer].nbytes
        if not 0 < nbytes <= MAX_LAYOUT_BYTES:  # sized from a record: checked before anything is allocated
            raise CommitError(f"{self.replica}/{self.rank}: trainer {source.name} publishes a {nbytes}-byte layout")
        raw = torch.empty(nbytes, dtype=torch.uint8)
        try:
            await self.t.get(raw, source.name, key=self.keys.trainer)
        except ClosedError:
            raise
        except TransportError as exc:
            if self._trainer is not None:
                log.info("%s/%s: trainer %s's layout cannot be read (%s): using the one read before", self.replica,
                         self.rank, source.name, exc)
                return
            raise CommitError(f"{self.replica}/{self.rank}: trainer {source.name}'s layout cannot be read: "
                              f"{exc}") from exc
        self._trainer = ((source.name, source.incarnation), Planner(decode_trainer(raw.numpy().tobytes())))

    async def _ctl_of(self, peer: str, words: int) -> torch.Tensor:
        """The first ``words`` control words of ``peer`` (a rank of this replica)."""
        if peer == self.t.name:
            return self._c[:words].clone()
        out = torch.empty(words, dtype=torch.int64)
        await self.t.get(out, peer, key=self.keys.ctl)
        return out

    async def _write(self, peer: str, word: int, value: int) -> None:
        if peer == self.t.name:
            self._c[word] = value
            memory_barrier()
            return
        await self.t.put(torch.tensor([value], dtype=torch.int64), peer, key=self.keys.ctl, offset=word * 8)

    async def commit(self, *, timeout: float | None = None) -> int | None:
        """Leader only (rank 0): commits the newest version that every rank of the replica holds
        in full, at every rank. Call it between generation steps; then every rank calls
        :meth:`apply`.

        Trainer ranks need not be there: a version they completed at every rank before they
        left (exited, crashed, restarting) is committed all the same, once this rank has seen
        the trainer layout (at an earlier commit, wait, pull or catch-up). A trainer rank's own
        read-only control block bounds the versions committed while it can be read (forged
        DONE words cannot wedge the replica); with none readable, the versions complete at
        every rank are taken as they are.

        Returns:
            The committed version (None: no version is complete at every rank yet).

        Raises:
            CommitError: this is not rank 0, a rank of the replica is missing, or no trainer
                rank was ever seen here.
            TransferTimeoutError: not done within ``timeout``.
            TransportError: a rank of the replica could not be read or written (it failed).

        Cancellation: a commit cancelled after proposing leaves the proposal behind, which only
        delays trainer writes into that slot until the next commit settles it.
        """
        if self.rank != 0:
            raise CommitError(f"{self.replica}/{self.rank}: only rank 0 of a replica commits")
        limit = self.timeout if timeout is None else timeout
        try:
            with anyio.fail_after(limit):
                return await self._commit()
        except TimeoutError as exc:
            raise TransferTimeoutError(f"replica {self.replica}: commit not done within {limit:g}s") from exc

    async def _commit(self) -> int | None:
        now = await self._replica_now()
        peers, plans = now.ranks, now.plans
        current = self.committed()
        words = {r: ctl_words_for(plans[r].sources()) for r in range(self.size)}

        async def ctls() -> dict[int, torch.Tensor]:
            return {r: await self._ctl_of(peers[r], words[r]) for r in range(self.size)}

        newest = await self._trainers_newest(now, {t for r in range(self.size) for t in plans[r].sources()})

        def complete(ctls: Mapping[int, torch.Tensor], slot: int) -> int | None:
            """The version every rank holds in full in ``slot`` (ranks fed by nobody aside), if
            no trainer rank's own read-only control block says it is from the future (any peer
            can write DONE words: a scribbled 2**60 must not wedge the replica)."""
            versions = {slot_version(ctls[r], slot, plans[r].sources()) for r in range(self.size)
                        if plans[r].sources()}
            v = versions.pop() if len(versions) == 1 else None
            return v if v is not None and (newest is None or v <= newest) else None

        # Our COMMIT word is writable by any peer too: a committed version no trainer rank has
        # snapshotted (a scribbled 2**60) holds back no version they vouch for.
        trusted = current if current is None or newest is None or current <= newest else None
        if trusted is None and current is not None and current != self._distrusted:
            self._distrusted = current
            log.warning("%s/%s: committed version %d is past what the trainer ranks have published (%d): "
                        "not trusted; the newest version complete at every rank replaces it", self.replica,
                        self.rank, current, newest)
        seen = await ctls()
        best = max((v for v in (complete(seen, 0), complete(seen, 1)) if v is not None), default=None)
        if best is None or (trusted is not None and best <= trusted):
            return current
        s = slot_of(best)
        word = encode_front(best, s)
        for r in range(self.size):
            await self._write(peers[r], PROPOSED, word)
        if complete(await ctls(), s) != best:  # look again (two-flag handshake)
            back = encode_front(trusted, slot_of(trusted)) if trusted is not None else 0
            for r in range(self.size):  # a trainer rank started writing that slot: not this time
                await self._write(peers[r], PROPOSED, back)
            return current
        for r in range(self.size):
            await self._write(peers[r], COMMIT, word)
        return best

    async def _trainers_newest(self, now: _Replica, sources: set[int]) -> int | None:
        """The newest version any trainer rank of ``sources`` has snapshotted (its own SNAPVER
        words, which only it can write); None when none of them can be read."""
        newest = None
        for t in sorted(sources):
            peer = now.trainers.get(t)
            if peer is None:
                continue
            tctl = torch.empty(TCTL_WORDS, dtype=torch.int64)
            try:
                await self.t.get(tctl, peer, key=self.keys.tctl)
            except TransportError as exc:
                log.debug("%s/%s: cannot read trainer rank %d's control block: %s", self.replica, self.rank, t, exc)
                continue
            v = max(int(tctl[SNAPVER0]), int(tctl[SNAPVER0 + 1])) - 1
            newest = v if newest is None else max(newest, v)
        return newest

    async def wait_committed(self, at_least: int, *, timeout: float | None = None) -> int:
        """Waits until the replica has committed ``at_least`` or a later version here (ranks
        other than the leader; the leader's :meth:`commit` returns it). Polls its own control
        block, which the leader writes, backing off to a few hundredths of a second.

        Args:
            at_least: the oldest version that will do.
            timeout: seconds (default: the subscriber's ``timeout``).

        Returns:
            The committed version.

        Raises:
            TransferTimeoutError: not within ``timeout``.

        Cancellation: nothing changes (it only reads).
        """
        limit = self.timeout if timeout is None else timeout
        if self._delta and self._materializer is None:
            try:  # the delta areas need the plan: one look now
                await self._replica_now()
            except ClosedError:
                raise
            except TransportError as exc:  # a rank or the trainer is not up (or has left): dense only, for now
                log.debug("%s/%s: no plan yet: %s", self.replica, self.rank, exc)

        async def look() -> int | Pending:
            v = self.committed()
            return v if v is not None and v >= at_least else PENDING

        return await poll(look, timeout=limit, what=f"{self.replica}/{self.rank}: version {at_least} not committed")

    def _held(self, sources: list[int]) -> int | None:
        """The newest version complete in one of this rank's slots (all ``sources`` done)."""
        return max((v for v in (slot_version(self._c, s, sources) for s in (0, 1)) if v is not None), default=None)

    async def catch_up(self, *, after: float = 1.0, timeout: float | None = None) -> int | None:
        """Pulls the trainer's newest version when pushes have not brought it here for
        ``after`` seconds (e.g. it was published while another rank of this replica was down, so
        the replica was not served). Cheap to call every generation step: it reads the source
        trainer ranks' control words at most every ``after / 2`` seconds.

        Returns:
            The version pulled, or None (nothing to catch up, not yet ``after`` seconds, or a
            source trainer rank is not there or cannot be read: it left).

        Raises:
            TransferTimeoutError: the pull did not complete within ``timeout``.
        """
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + after / 2
        try:
            replica = await self._replica_now()
        except CommitError:
            return None  # a rank of the replica or the trainer is not up: nothing to pull from yet
        trainer_ranks = replica.trainers
        sources = replica.plans[self.rank].sources()
        if not sources or any(t not in trainer_ranks for t in sources):
            return None
        fronts = []
        for t in sources:
            tctl = torch.empty(TCTL_WORDS, dtype=torch.int64)
            try:
                await self.t.get(tctl, trainer_ranks[t], key=self.keys.tctl)
            except ClosedError:
                raise
            except TransportError as exc:  # listed, but gone (a crash): nothing to fetch from it
                log.debug("%s/%s: cannot read trainer rank %d's control block: %s", self.replica, self.rank, t, exc)
                return None
            front = decode_front(int(tctl[FRONT]))
            if front is None:
                return None
            fronts.append(front[0])
        held = self._held(sources)
        if held is not None and held >= min(fronts):
            self._behind_since = None
            return None
        if self._behind_since is None:
            self._behind_since = now
        if now - self._behind_since < after:
            return None
        self._behind_since = None
        return await self.pull(timeout=timeout)

    # -- pull -------------------------------------------------------------------------------

    async def pull(self, *, version: int | None = None, timeout: float | None = None) -> int:
        """Fetches this rank's slices of the newest version every source trainer rank holds in
        a snapshot, one-sidedly, into a slot, and marks it complete there (for a rank that
        joins or restarts while the trainer runs). The leader's next :meth:`commit` then sees
        it; :meth:`apply` applies it.

        Args:
            version: fetch exactly this version (e.g. the committed one, after its deltas were
                refused); it must still be in the snapshots.
            timeout: seconds (default: the subscriber's ``timeout``).

        Returns:
            The version pulled.

        Raises:
            TransferTimeoutError: no consistent copy within ``timeout``: a source trainer rank
                or a rank of the replica is not in the store, or cannot be read (it left; it is
                waited for meanwhile), they hold no common version, or the trainer kept
                overwriting the snapshots.

        Cancellation: the slot is left incomplete (never applied); nothing else changes.
        """
        limit = self.timeout if timeout is None else timeout
        why = "the trainer kept overwriting its snapshots"

        async def attempt() -> int | Pending:
            nonlocal why
            try:
                got = await self._pull_once(version)
            except ClosedError:
                raise
            except TransportError as exc:  # a trainer rank or a rank of the replica is not up (yet), or left
                why = f"{type(exc).__name__}: {exc}"
                await anyio.sleep(_WAIT_S)  # each attempt scans the store: not more often than this
                return PENDING
            return PENDING if got is None else got

        return await poll(attempt, timeout=limit, what=f"{self.replica}/{self.rank}: pull not done", why=lambda: why)

    async def _pull_once(self, version: int | None = None) -> int | None:
        now = await self._replica_now()
        mine, trainer_ranks = now.plans[self.rank], now.trainers
        sources = mine.sources()
        if any(t not in trainer_ranks for t in sources):
            raise CommitError(f"{self.replica}/{self.rank}: trainer ranks "
                              f"{[t for t in sources if t not in trainer_ranks]} are not in the store")
        tctls = {}
        for t in sources:
            tctls[t] = torch.empty(TCTL_WORDS, dtype=torch.int64)
            await self.t.get(tctls[t], trainer_ranks[t], key=self.keys.tctl)
        common = set.intersection(*({int(c[SNAPVER0 + s]) - 1 for s in (0, 1)} for c in tctls.values())) - {-1}
        if not common or (version is not None and version not in common):
            return None
        v = max(common) if version is None else version
        s = slot_of(v)
        ctl = self._c
        if int(ctl[READING]) == s:
            return None  # being read here (another task): try again
        ctl[READING] = s  # trainer ranks stay out of this slot while it is filled here
        ctl[MAT0 + s] = 0
        memory_barrier()
        try:
            if any(int(ctl[done_word(s, t)]) < 0 for t in sources):
                return None  # a trainer rank is writing it right now: try again
            for t, runs in self._runs_from(now.planner, mine).items():
                if not await self._read_snapshot(trainer_ranks[t], tctls[t], v, runs):
                    return None  # being written, or overwritten while read: try again
            if self._materializer is not None:
                self._materializer.clear(s)  # its bytes are all of v now: no delta waits for it
            for t in sources:
                ctl[done_word(s, t)] = v + 1
            self._materialized = (v, s)
            ctl[MAT0 + s] = v + 1
            memory_barrier()
            return v
        finally:
            ctl[READING] = -1


    async def _read_snapshot(self, peer: str, seen: torch.Tensor, version: int, runs: np.ndarray) -> bool:
        """Reads ``runs`` of trainer rank ``peer``'s snapshot of ``version`` into this rank's
        slot of it, under the snapshot's seqlock (its generation word, and the version it
        holds, as ``seen`` in its control words just before).

        Returns:
            True when the copy is consistent; False when the snapshot was being written or was
            rewritten during the read (the slot's bytes are then undefined).
        """
        s = slot_of(version)

        async def stamp() -> tuple[int, int]:
            after = torch.empty(TCTL_WORDS, dtype=torch.int64)
            await self.t.get(after, peer, key=self.keys.tctl)
            return int(after[GEN0 + s]), int(after[SNAPVER0 + s])

        async def read() -> bool:
            if len(runs):
                await self.t.prepare_get_runs(peer, self._slots[s], self.keys.snaps[s], runs[:, [1, 0, 2]]).start()
            return True

        got = await seqlock_read(stamp, read, stable=lambda g: even(g[0]) and g[1] == version + 1,
                                 seen=(int(seen[GEN0 + s]), int(seen[SNAPVER0 + s])))
        return got is not PENDING


@dataclass(frozen=True)
class _Replica:
    """This replica as the store lists it now (see ``MeshSubscriber._replica_now``)."""

    ranks: dict[int, str]  # rank of the replica -> peer name
    plans: list[RankPlan]  # per rank of the replica
    trainers: dict[int, str]  # trainer rank -> peer name
    planner: Planner  # of the trainer layout
