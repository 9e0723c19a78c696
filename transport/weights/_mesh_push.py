"""One trainer rank's pushes into generator ranks of a mesh stream (:class:`MeshPushes`): the
two-flag claim of a generator rank's slot, the write (as a delta into its delta area where it
holds the base and a delta pays on its path, else dense as one prepared transfer), and the done
word; into a host's relay, piece by piece (:mod:`._mesh_relays`). Also what the trainer rank
knows of each generator rank between versions: its prepared pushes, its byte runs from here
and their checksums, its delta table, the version each of its slots holds from here, whether
it is reached over shared memory, and (in the crossover model) how long its dense push took."""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import numpy as np
import torch

from .._background import start_background
from .._errors import MeshLayoutError, TransportError
from ..plan import Move, Planner, RankLayout
from ._binding import Offsets, byte_runs, cut_runs, slot_layout
from ._codec.format import HEAD_BYTES, read_table
from ._codec.policy import Crossover
from ._codec.runs import Change, Cut, Runs, cut
from ._control import decode_front
from ._mesh_control import APPLIED, COMMIT, HEADER_WORDS, MAT0, PROPOSED, READING, MeshKeys, done_word, slot_of
from ._report import SyncResult, SyncStatus

if TYPE_CHECKING:
    from .. import Peer, PreparedTransfer, Transport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaPlanMoves:
    """This trainer rank's moves into one generator rank, and that rank's layout."""

    moves: tuple[Move, ...]
    rank: RankLayout


@dataclass(frozen=True)
class Claim:
    """A generator rank's slot as this trainer rank claimed it for a version.

    Attributes:
        busy: why the slot must not be written now (None: it is claimed: this rank's done word
            there says "writing", and the replica's leader will not commit the slot).
        prev: the done word before the claim (what the slot held from here).
        header: the rank's control header as read after the claim.
    """

    busy: str | None
    prev: int
    header: torch.Tensor


def slot_busy(header: torch.Tensor, slot: int) -> str | None:
    """Why ``slot`` of a generator rank must not be written now (its ctl header given), or None."""
    applied = int(header[APPLIED])
    if int(header[READING]) == slot:
        return "being applied"
    for word, what in ((COMMIT, "committed"), (PROPOSED, "being committed")):
        front = decode_front(int(header[word]))
        if front is not None and front[1] == slot and front[0] + 1 > applied:
            return f"{what} (version {front[0]}) and not applied yet"
    return None


def runs_fingerprint(runs: np.ndarray) -> int:
    """A 63-bit fingerprint of byte runs as they are (unsorted): generator ranks of the same
    layout fed the same moves share it, and so the pieces a relay's log counts."""
    return int.from_bytes(hashlib.blake2b(np.ascontiguousarray(runs, dtype=np.int64).tobytes(),
                                          digest_size=8).digest(), "little") >> 1


class MeshPushes:
    """What one trainer rank pushes into generator ranks, and keeps of each between versions.

    Args:
        transport: the trainer rank's Transport.
        keys: the stream's region names.
        rank: the trainer rank.
        planner: the trainer layout's planner.
        offsets: where each tensor lies in this rank's snapshots.
        deadline: seconds a push may take.
        delta: whether versions may go as deltas (the publisher diffs them).
        delta_everywhere: deltas also over shared memory (``delta=True``; ``"auto"``: not).
        crossover: the crossover model (told each dense push's time; None without delta sync).
    """

    def __init__(self, transport: Transport, keys: MeshKeys, rank: int, planner: Planner, offsets: Offsets,
                 deadline: float, *, delta: bool, delta_everywhere: bool, crossover: Crossover | None = None) -> None:
        self.t, self.keys, self.rank, self._planner, self._offsets = transport, keys, rank, planner, offsets
        self.deadline = deadline
        self._delta, self._delta_everywhere = delta, delta_everywhere
        self.crossover = crossover
        self.snaps: list[torch.Tensor] = []  # this rank's two snapshots (set once registered)
        self.version: int | None = None  # the version being published
        self.change: Change | None = None  # its change since the version its snapshot held (None: dense)
        # generator rank (name) -> its crossover for this version, where it may take it as a
        # delta (it holds the base); absent: dense
        self.chosen: dict[str, float] = {}
        # (generator rank, incarnation, slot) -> (version it holds there from this rank, whether
        # that came as a delta: the rank then knows its checksum, else its next delta there
        # checks the base by reading it)
        self._held: dict[tuple[str, str, int], tuple[int, bool]] = {}
        self._calibrating = False  # the model's calibration was begun in the background
        self._prepared: dict[tuple[str, str, int], PreparedTransfer] = {}
        self._pieces: dict[tuple[str, str, int, int], list[PreparedTransfer]] = {}  # (.., piece bytes)
        self._byte_runs: dict[tuple[str, str], tuple[np.ndarray, int]] = {}  # -> (its runs, their fingerprint)
        self._runs: dict[tuple[str, str], Runs] = {}  # (generator rank, incarnation) -> its runs from here
        self._tables: dict[tuple[str, str], tuple[int, int] | None] = {}  # -> this rank's (offset, cap) there
        self._sums: dict[tuple[bytes, int], tuple[int, int]] = {}  # (runs, slot) -> (version, checksum there)
        # As they were when the version began: ranks of the same runs share an entry, which the
        # first of them done with this version moves on to it (the others still hold the base).
        self._base_sums: dict[tuple[bytes, int], tuple[int, int]] = {}
        self._cuts: dict[bytes, Cut | None] = {}  # runs -> the change cut along them (this version)
        self._cutting: dict[bytes, anyio.Lock] = {}  # runs -> held while their cut is made
        self.memory_link: dict[str, bool] = {}  # generator rank -> its last push went over shared memory

    def begin(self, version: int, change: Change | None) -> None:
        """A new version is being published (``change``: its change, when diffed)."""
        self.version, self.change, self._cuts, self._cutting = version, change, {}, {}
        self._base_sums = dict(self._sums)

    def _taker(self, name: str, incarnation: str) -> Runs | None:
        """That generator rank's runs from here when it takes deltas from here: its runs allow
        them, it has a delta area, and it is reached over a network (or ``delta=True``; not
        before its first push showed the route)."""
        runs = self._runs.get((name, incarnation))
        if runs is None or runs.why_not is not None or self._tables.get((name, incarnation)) is None:
            return None
        return runs if self._delta_everywhere or not self.memory_link.get(name, True) else None

    async def choose(self, slot: int, base: int) -> dict[str, float]:
        """The crossover of each generator rank that may take the version going into ``slot``
        as a delta against ``base`` (the version this rank's snapshot there holds): it takes
        deltas from here (its runs allow them, it has a delta area, and over shared memory only
        with ``delta=True``), its slot holds ``base`` from here as this rank last wrote it, and
        the checksum of its bytes there is known. Each from its own path
        (:meth:`Crossover.of`), counting the check of the base a first delta into a slot after
        a dense write costs it; calibrates this host first, once, off the event loop. Kept for
        :meth:`cut_for`: a rank not chosen gets the version dense."""
        model = self.crossover
        takers: dict[str, Runs] = {}
        first: dict[str, bool] = {}
        for (name, inc, s), (held, by_delta) in self._held.items():
            runs = self._taker(name, inc) if (s, held) == (slot, base) else None
            sums = None if runs is None else self._sums.get((runs.fingerprint, slot))
            if runs is not None and sums is not None and sums[0] == base:
                takers[name], first[name] = runs, not by_delta
        if model is None or not takers:
            self.chosen = {}
            return self.chosen
        if model.fixed is None and not model.calibrated:  # (usually begun after an earlier version)
            await anyio.to_thread.run_sync(model.calibrate)
        self.chosen = {name: model.of(name, model.first_s(runs.nbytes, 0) if first[name] else 0.0)
                       for name, runs in takers.items()}
        return self.chosen

    def calibrate_ahead(self) -> None:
        """Begins calibrating this host for the crossover model on a background thread (once,
        about 0.15 s on the 2-core VM), where it is not given one and some generator rank
        served may take deltas: after a publish, so that the first version that may go as a
        delta does not wait for it (:meth:`choose` waits for one still running)."""
        model = self.crossover
        if model is None or model.fixed is not None or model.calibrated or self._calibrating:
            return
        if any(self._taker(name, inc) is not None for name, inc in self._tables):
            self._calibrating = True
            start_background(model.calibrate)

    def forget(self, served: set[tuple[str, str]]) -> None:
        """Drops what is kept for generator ranks (name, incarnation) no longer served."""
        if self.crossover is not None:
            for name in {k[0] for k in self._held} - {n for n, _ in served}:
                self.crossover.forget(name)
        self._held = {k: v for k, v in self._held.items() if k[:2] in served}
        self._prepared = {k: v for k, v in self._prepared.items() if k[:2] in served}
        self._pieces = {k: v for k, v in self._pieces.items() if k[:2] in served}
        self._byte_runs = {k: v for k, v in self._byte_runs.items() if k in served}
        self._runs = {k: v for k, v in self._runs.items() if k in served}
        self._tables = {k: v for k, v in self._tables.items() if k in served}
        fingerprints = {r.fingerprint for r in self._runs.values()}
        self._sums = {k: v for k, v in self._sums.items() if k[0] in fingerprints}

    def has_prepared(self, peer: Peer, slot: int) -> bool:
        """Whether the push into ``peer``'s ``slot`` is prepared (pushed to or warmed)."""
        return (peer.name, peer.incarnation, slot) in self._prepared

    def drop(self, peer: Peer, slot: int) -> None:
        """Forgets the prepared push into ``peer``'s ``slot`` (its warm failed)."""
        self._prepared.pop((peer.name, peer.incarnation, slot), None)

    def runs_of(self, peer: Peer, work: ReplicaPlanMoves) -> tuple[np.ndarray, int]:
        """``peer``'s byte runs from this rank (``(snapshot offset, slot offset, nbytes)``) and
        their fingerprint (:func:`runs_fingerprint`), made once per incarnation."""
        key = (peer.name, peer.incarnation)
        got = self._byte_runs.get(key)
        if got is None:
            layout = work.rank.layout
            runs = byte_runs(self._planner, work.moves, {lt.name: lt for lt in layout.tensors}, self._offsets,
                             slot_layout(layout)[0])
            got = self._byte_runs[key] = (runs, runs_fingerprint(runs))
            if self._delta:
                self._runs[key] = Runs.of(runs)
        return got

    def prepare(self, peer: Peer, slot: int, work: ReplicaPlanMoves) -> PreparedTransfer:
        """The prepared push of this rank's bytes into ``peer``'s ``slot`` (made once; those of
        its earlier incarnations dropped)."""
        key = (peer.name, peer.incarnation, slot)
        got = self._prepared.get(key)
        if got is None:
            self._prepared = {k: v for k, v in self._prepared.items() if k[0] != peer.name or k[1] == peer.incarnation}
            runs, _ = self.runs_of(peer, work)
            got = self._prepared[key] = self.t.prepare_put_runs(peer.name, self.snaps[slot], self.keys.slots[slot],
                                                                runs)
        return got

    def pieces(self, peer: Peer, slot: int, work: ReplicaPlanMoves, piece_bytes: int) -> list[PreparedTransfer]:
        """The push into ``peer``'s ``slot`` as prepared pieces of about ``piece_bytes`` (its
        runs cut by :func:`._binding.cut_runs`, as a member following it cuts them)."""
        key = (peer.name, peer.incarnation, slot, piece_bytes)
        got = self._pieces.get(key)
        if got is None:
            runs, _ = self.runs_of(peer, work)
            got = self._pieces[key] = [self.t.prepare_put_runs(peer.name, self.snaps[slot], self.keys.slots[slot], p)
                                       for p in cut_runs(runs, piece_bytes)]
        return got

    async def area(self, peer: Peer) -> tuple[int, int] | None:
        """This rank's (offset, cap) in ``peer``'s delta areas (None: it takes no deltas from
        here), read once per incarnation from its table."""
        key = (peer.name, peer.incarnation)
        if key in self._tables:
            return self._tables[key]
        tab, area = peer.regions.get(self.keys.dtab), peer.regions.get(self.keys.deltas[0])
        if tab is None or area is None:
            return None  # not made yet (it makes them once it knows its plan): look again next time
        got = None
        if 0 < tab.nbytes <= 1 << 20:  # sized from a record: bounded before anything is allocated
            raw = torch.empty(tab.nbytes, dtype=torch.uint8)
            await self.t.get(raw, peer.name, key=self.keys.dtab)
            got = read_table(raw, min(area.nbytes, peer.regions[self.keys.deltas[1]].nbytes)
                             if self.keys.deltas[1] in peer.regions else 0).get(self.rank)
        self._tables[key] = got
        return got

    async def claim(self, peer: Peer, slot: int, version: int) -> Claim:
        """Claims ``peer``'s ``slot`` for ``version`` (the two-flag handshake, see
        :mod:`._mesh_control`): marks this rank's done word there "writing", then looks at the
        header again; a slot found busy either time is left as it was.

        Raises:
            TransportError: the rank's control block cannot be read or written.
        """
        name, word = peer.name, done_word(slot, self.rank) * 8
        header = torch.empty(HEADER_WORDS, dtype=torch.int64)
        prev = torch.zeros(1, dtype=torch.int64)
        await self.t.get(header, name, key=self.keys.ctl)
        why = slot_busy(header, slot)
        if why is None:
            await self.t.get(prev, name, key=self.keys.ctl, offset=word)
            mark = torch.tensor([-(version + 1)], dtype=torch.int64)  # writing: the leader will not commit this slot
            await self.t.put(mark, name, key=self.keys.ctl, offset=word)
            await self.t.get(header, name, key=self.keys.ctl)  # then look again (two-flag handshake)
            why = slot_busy(header, slot)
            if why is not None:
                await self.t.put(prev, name, key=self.keys.ctl, offset=word)
        return Claim(why, int(prev[0]), header)

    async def mark_done(self, peer: Peer, slot: int, version: int) -> None:
        """Marks this rank's bytes of ``version`` complete in ``peer``'s ``slot`` (its done word)."""
        mark = torch.tensor([version + 1], dtype=torch.int64)
        await self.t.put(mark, peer.name, key=self.keys.ctl, offset=done_word(slot, self.rank) * 8)

    async def push(self, label: str, peer: Peer, work: ReplicaPlanMoves, version: int, t0: float,
                   claim: Claim | None = None) -> SyncResult:
        """Pushes this rank's bytes of ``version`` into ``peer`` directly: claims its slot
        (unless ``claim`` is given: claimed already), writes, marks it done; within the deadline.

        Returns:
            DONE, STRAGGLER (its slot busy, or not complete within the deadline) or FAILED.
        """
        slot = slot_of(version)
        nbytes = sum(m.nbytes for m in work.moves)
        status, error, as_delta = SyncStatus.DONE, None, False
        with anyio.move_on_after(self.deadline) as scope:
            try:
                prepared = self.prepare(peer, slot, work)
                area = await self.area(peer)  # (without delta sync too: a stale payload there is cleared)
                claim = claim or await self.claim(peer, slot, version)
                if claim.busy is not None:
                    status, error = SyncStatus.STRAGGLER, f"slot {slot} is {claim.busy}"
                else:
                    nbytes, as_delta = await self.write(peer, slot, prepared, claim, area, nbytes)
                    await self.mark_done(peer, slot, version)
            except (TransportError, MeshLayoutError) as exc:
                status, error = SyncStatus.FAILED, f"{type(exc).__name__}: {exc}"
        if scope.cancelled_caught:
            status, error = SyncStatus.STRAGGLER, f"not complete within {self.deadline:g}s"
        if status is not SyncStatus.DONE:
            log.info("mesh publisher %s rank %d: version %d to %s (%s): %s", self.t.name, self.rank, version, label,
                     peer.name, error)
        return SyncResult(peer.name, version, status, nbytes if status is SyncStatus.DONE else 0,
                          time.perf_counter() - t0, error, delta=as_delta)

    def _base(self, peer: Peer, slot: int, claim: Claim, area: tuple[int, int] | None
              ) -> tuple[Change, Runs, int] | None:
        """(the change, ``peer``'s runs, this rank's checksum of the base there) when ``peer`` may
        take this version as a delta: it was chosen (:meth:`choose`: it takes them and a delta
        may pay on its path), its slot holds the base from this rank (its DONE word) and as it
        read it (its MAT word), and the checksum of those bytes is known. None: dense."""
        change, runs = self.change, self._taker(peer.name, peer.incarnation)
        if change is None or runs is None or area is None or self.chosen.get(peer.name, 0.0) <= 0.0:
            return None
        if claim.prev != change.base + 1 or int(claim.header[MAT0 + slot]) != change.base + 1:
            return None
        held = self._base_sums.get((runs.fingerprint, slot))
        if held is None or held[0] != change.base:
            return None
        return change, runs, held[1]

    async def cut_for(self, peer: Peer, slot: int, claim: Claim, area: tuple[int, int] | None) -> Cut | None:
        """The payload ``peer`` gets this version as when it may take a delta (:meth:`_base`),
        the cut fits its area and changes no more of its units than its crossover; None: dense.
        A cut is a pass over the change: it is made off the event loop, once per version and
        runs (the pushes of ranks of the same runs wait for the first one's)."""
        base = self._base(peer, slot, claim, area)
        if base is None or area is None:
            return None
        change, runs, base_sum = base
        async with self._cutting.setdefault(runs.fingerprint, anyio.Lock()):
            if runs.fingerprint not in self._cuts:
                made = await anyio.to_thread.run_sync(self._cut, change, runs, base_sum, area[1])
                self._cuts[runs.fingerprint] = made
        made = self._cuts[runs.fingerprint]
        if made is None or made.payload.numel() > HEAD_BYTES + area[1]:
            return None
        return made if made.count <= self.chosen[peer.name] * runs.nbytes // 2 else None

    def _cut(self, change: Change, runs: Runs, base_sum: int, cap: int) -> Cut | None:
        """:func:`cut`, timed for the crossover model (its own pass: not the hop to its thread)."""
        t0 = time.perf_counter()
        made = cut(change, runs, base_sum, cap)
        if self.crossover is not None:
            self.crossover.cut(time.perf_counter() - t0, len(change.units))
        return made

    def sent_delta(self, peer: Peer, slot: int, made: Cut) -> None:
        """``peer``'s slot takes ``made`` this version: the checksum a later delta builds on."""
        runs = self._runs[(peer.name, peer.incarnation)]
        assert self.version is not None
        self._sums[(runs.fingerprint, slot)] = (self.version, made.new_sum)
        self._held[(peer.name, peer.incarnation, slot)] = (self.version, True)

    async def write(self, peer: Peer, slot: int, prepared: PreparedTransfer, claim: Claim,
                    area: tuple[int, int] | None, dense_bytes: int) -> tuple[int, bool]:
        """Writes this rank's bytes of the version into ``peer``'s claimed slot: as a delta into
        its delta area when it may take one, else dense (clearing a payload that may wait there).

        Returns:
            (bytes written, whether as a delta).
        """
        name, delta_key = peer.name, self.keys.deltas[slot]
        made = await self.cut_for(peer, slot, claim, area)
        if made is not None and area is not None:
            await self.t.put(made.payload, name, key=delta_key, offset=area[0], timeout=self.deadline)
            self.sent_delta(peer, slot, made)
            return made.payload.numel(), True
        await self.clear_delta(peer, slot, area)
        t0 = time.perf_counter()  # (a small push completes inside start())
        h = prepared.start(timeout=self.deadline)
        await h
        await self.pushed_dense(peer, slot, h.same_host is True, time.perf_counter() - t0)
        return dense_bytes, False

    async def clear_delta(self, peer: Peer, slot: int, area: tuple[int, int] | None) -> None:
        """Clears a payload that may wait in ``peer``'s delta area of ``slot`` before a dense
        write: one of an earlier life of this version number (a restarted trainer counts
        again) must never be applied over the dense bytes."""
        if area is not None:
            await self.t.put(torch.zeros(8, dtype=torch.uint8), peer.name, key=self.keys.deltas[slot],
                             offset=area[0], timeout=self.deadline)

    async def pushed_dense(self, peer: Peer, slot: int, memory_link: bool, seconds: float | None = None) -> None:
        """``peer``'s slot holds this version dense (``memory_link``: it came over shared
        memory; ``seconds``: the push took that long, where it was pushed whole and timed):
        the checksum a later delta into it builds on, where it may take one and one may pay on
        its path at some change (:meth:`Crossover.worth_readying`: else that pass is work
        wasted each version, before the done word; not judged by the change last seen, which
        is not measured again while no rank holds a base whose checksum is known)."""
        name = peer.name
        self.memory_link[name] = memory_link
        known = self._runs.get((name, peer.incarnation))
        assert self.version is not None
        self._held[(name, peer.incarnation, slot)] = (self.version, False)
        model = self.crossover
        if model is not None and seconds is not None and known is not None:
            model.pushed_dense(name, seconds, known.nbytes)
        takes = (self._delta_everywhere or not memory_link) and (model is None or model.worth_readying(name, None))
        area = self._tables.get((name, peer.incarnation))
        if area is not None and known is not None and known.why_not is None and takes:
            held = self._sums.get((known.fingerprint, slot))
            if held is None or held[0] != self.version:
                snap = self.snaps[slot]
                self._sums[(known.fingerprint, slot)] = (self.version,
                                                         await anyio.to_thread.run_sync(known.checksum, snap))
