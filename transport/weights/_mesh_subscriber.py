"""``MeshSubscriber``: one generator rank's side of a mesh stream (see ``_mesh_control``).

The subscriber sequences its parts: :mod:`._mesh_replica` (its replica and the trainer ranks as
the store lists them, the plan), :mod:`._mesh_commit` (the leader's commit),
:mod:`._mesh_delta_intake` (the delta areas beside its slots). What stays here is its own: the
slots and control block, reading a committed slot, and pulling from the trainer ranks'
snapshots.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import anyio
import torch

from .._errors import ClosedError, CommitError, TransferTimeoutError, TransportError
from ..plan import GeneratorRank, MeshLayoutError, Planner, RankLayout, RankPlan, encode_rank
from ._binding import slot_layout
from ._control import claim, decode_front, encode_front, memory_barrier, release, withdraw
from ._lifecycle import Lifecycle
from ._mesh_commit import Committer
from ._mesh_control import (
    APPLIED,
    COMMIT,
    CTL_WORDS,
    FRONT,
    GEN0,
    READING,
    SNAPVER0,
    MeshKeys,
    done_word,
    slot_of,
    slot_version,
)
from ._mesh_delta_intake import SlotDeltas
from ._mesh_relay_member import MeshRelayMember
from ._mesh_replica import ReplicaNow, ReplicaView
from ._polling import PENDING, Pending, even, poll, seqlock_read
from ._relay_block import mesh_block_words

if TYPE_CHECKING:
    import numpy as np

    from .. import Transport


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
        relay: take part in per-host relays (see ``MeshPublisher(relays=...)``): where other
            generator ranks on this host need the very same bytes from a trainer rank on
            another host, it pushes them once, into one of these ranks, and the others copy
            them from its slot over shared memory (a task of this rank's Transport follows the
            trainer ranks' orders: :mod:`._mesh_relay_member`). Costs a relay block of
            ``mesh_block_words()`` int64 words (458 KiB). False: every trainer rank pushes
            here directly.

    Raises:
        MeshLayoutError: a tensor is missing or differs from the layout in shape or dtype.
    """

    def __init__(self, transport: Transport, name: str, *, replica: str, rank: int, size: int, layout: GeneratorRank,
                 tensors: Mapping[str, torch.Tensor] | None = None, timeout: float = 60.0,
                 allocate: bool = True, delta: bool = True, relay: bool = True) -> None:
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
        self._view = ReplicaView(transport, name, replica=replica, rank=rank, size=size, layout=layout,
                                 offsets=self._offsets)
        self._committer = Committer(self._view)
        self._deltas = SlotDeltas(transport, self.keys, delta)
        self._want_relay = relay
        self._relay: MeshRelayMember | None = None  # follows relay orders (set by start when it takes part)
        self._relay_scope: anyio.CancelScope | None = None  # its task, while started
        # (the planner, this rank's plan, its runs from each trainer rank): bound once per plan
        self._bound: tuple[Planner, RankPlan, dict[int, np.ndarray]] | None = None
        self._next_check = 0.0  # catch_up(): when to look at the trainer's versions again
        self._behind_since: float | None = None

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
        if self._want_relay:
            block = self.t.empty(self.keys.relay, mesh_block_words(), torch.int64)
            self._relay = MeshRelayMember(self.t, self.keys, block, self._slots, self._deltas.areas,
                                          self._relay_source)
            self._relay_scope = self.t._run_service(self._relay.run)

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
        if self._relay_scope is not None:
            self._relay_scope.cancel()
        withdraw(self.t, [*self.keys.slots, self.keys.ctl, self.keys.rank, self.keys.dtab, *self.keys.deltas,
                          self.keys.relay])

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

    @property
    def last_delta(self) -> tuple[int, int]:
        """Of the last version read: (trainer ranks whose deltas were applied, units applied)."""
        return self._deltas.last

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
            if claim(ctl, READING, s, COMMIT, encode_front(v, s)):  # trainer ranks skip this slot from now on
                break
        try:
            self._deltas.materialize(ctl, v, s)
            slot = self._slots[s]
            views = {}
            for lt in self.layout.tensors:
                off, nbytes = self._offsets[lt.name]
                views[lt.name] = slot[off : off + nbytes].view(getattr(torch, lt.dtype)).view(lt.shape)
            yield v, views
            memory_barrier()
            ctl[APPLIED] = v + 1
        finally:
            release(ctl, READING)

    # -- the replica ----------------------------------------------------------------------

    async def _replica_now(self) -> ReplicaNow:
        """One look at the store (:meth:`ReplicaView.now`); the delta areas are made once its
        plan is known."""
        now = await self._view.now()
        if self._deltas.awaiting_plan and self._slots:
            self._deltas.make(self._slots, self._runs(now))
        return now

    def _runs(self, now: ReplicaNow) -> dict[int, np.ndarray]:
        """Trainer rank -> its byte runs into this rank under ``now``'s plan (bound once per plan)."""
        mine = now.plans[self.rank]
        if self._bound is None or self._bound[0] is not now.planner or self._bound[1] is not mine:
            self._bound = (now.planner, mine, self._view.runs(now.planner, mine))
        return self._bound[2]

    async def _relay_source(self, trainer_rank: int) -> tuple[np.ndarray, str] | None:
        """Trainer rank ``trainer_rank``'s byte runs into this rank under the plan and its name
        (None: it does not feed this rank, or is not listed): what a relay order from it is
        checked and cut by. One look at the store; the runs are bound once per plan."""
        now = await self._replica_now()
        name = now.trainers.get(trainer_rank)
        runs = self._runs(now).get(trainer_rank)
        return None if runs is None or name is None else (runs, name)

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
                return await self._committer.commit(await self._replica_now(), self._c)
        except TimeoutError as exc:
            raise TransferTimeoutError(f"replica {self.replica}: commit not done within {limit:g}s") from exc

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
        if self._deltas.awaiting_plan:
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
            try:
                tctl = await self._view.trainer_words(trainer_ranks[t])
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
        tctls = {t: await self._view.trainer_words(trainer_ranks[t]) for t in sources}
        common = set.intersection(*({int(c[SNAPVER0 + s]) - 1 for s in (0, 1)} for c in tctls.values())) - {-1}
        if not common or (version is not None and version not in common):
            return None
        v = max(common) if version is None else version
        s = slot_of(v)
        ctl = self._c
        if int(ctl[READING]) == s:
            return None  # being read here (another task): try again
        ctl[READING] = s  # trainer ranks stay out of this slot while it is filled here
        self._deltas.writing(ctl, s)
        memory_barrier()
        try:
            if any(int(ctl[done_word(s, t)]) < 0 for t in sources):
                return None  # a trainer rank is writing it right now: try again
            for t, runs in self._runs(now).items():
                if not await self._read_snapshot(trainer_ranks[t], tctls[t], v, runs):
                    return None  # being written, or overwritten while read: try again
            self._deltas.clear(s)  # its bytes are all of v now: no delta waits for it
            for t in sources:
                ctl[done_word(s, t)] = v + 1
            self._deltas.whole(ctl, v, s)
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
            after = await self._view.trainer_words(peer)
            return int(after[GEN0 + s]), int(after[SNAPVER0 + s])

        async def read() -> bool:
            if len(runs):
                await self.t.prepare_get_runs(peer, self._slots[s], self.keys.snaps[s], runs[:, [1, 0, 2]]).start()
            return True

        got = await seqlock_read(stamp, read, stable=lambda g: even(g[0]) and g[1] == version + 1,
                                 seen=(int(seen[GEN0 + s]), int(seen[SNAPVER0 + s])))
        return got is not PENDING
