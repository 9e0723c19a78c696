"""``MeshPublisher``: one trainer rank's side of a mesh stream (see ``_mesh_control``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import torch

from .._errors import ClosedError, TransportError
from ..plan import (
    MeshLayoutError,
    Move,
    Planner,
    RankLayout,
    Replica,
    ReplicaPlan,
    Topology,
    TrainerLayout,
    encode_trainer,
)
from ._binding import byte_runs, slot_layout, snapshot_layout
from ._control import decode_front, encode_front, memory_barrier, withdraw
from ._mesh_control import (
    APPLIED,
    COMMIT,
    FRONT,
    GEN0,
    HEADER_WORDS,
    MAX_TRAINER_RANKS,
    PROPOSED,
    READING,
    SNAPVER0,
    TCTL_WORDS,
    TRANK,
    MeshKeys,
    done_word,
    slot_of,
)
from ._mesh_fp8 import BlockQuantizer
from ._mesh_peers import MeshMembers, MeshPeers
from ._report import SyncResult, SyncStatus

if TYPE_CHECKING:
    from .. import PreparedTransfer, Transport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeshPublishReport:
    """What one trainer rank's ``publish`` did.

    Attributes:
        version: the version published.
        results: ``"replica/rank"`` -> the push of this rank's bytes into that generator rank
            (only ranks this trainer rank feeds).
        incomplete: replicas seen without all their ranks (not served this time).
        refused: replica -> why its layout cannot be served (e.g. a dtype mismatch).
        pack_s, plan_s, push_s, total_s: time packing the snapshot, discovering and planning,
            pushing, and in all.
    """

    version: int
    results: dict[str, SyncResult] = field(default_factory=dict)
    incomplete: tuple[str, ...] = ()
    refused: dict[str, str] = field(default_factory=dict)
    pack_s: float = 0.0
    plan_s: float = 0.0
    push_s: float = 0.0
    total_s: float = 0.0


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


class MeshPublisher:
    """Pushes this trainer rank's shards into every generator rank that needs them.

    Every trainer rank runs one, with the same ``layout`` and ``name``; they never talk to each
    other. ``publish(v)`` packs this rank's shards into snapshot ``v % 2`` (cast to the layout's
    dtypes), finds the generator replicas in the rendezvous, plans (once per replica layout,
    see :class:`transport.plan.Planner`) and writes this rank's part of the plan into each
    generator rank's slot ``v % 2`` as one prepared transfer, then marks it done in that rank's
    control block. A generator rank whose slot is still committed or being applied is skipped
    for this version (a straggler); one that fails is reported; neither delays the others.

    Use as ``async with MeshPublisher(...) as pub:`` (or ``pub.start()`` / ``await
    pub.aclose()``; ``close()`` is the same as ``aclose()`` for synchronous callers).

    Args:
        transport: this trainer rank's open Transport.
        name: the stream name (generators use the same).
        shards: global tensor name -> this rank's local shard (row-major; a DTensor is taken by
            its ``to_local()``), for every tensor of ``layout`` this rank holds a non-empty box of.
        layout: the trainer layout (the same on every trainer rank); its dtypes are what is sent
            (casts happen while packing).
        rank: this trainer rank (as in ``layout``).
        topology: the trainer ranks' NICs, for balancing duplicate holders.
        deadline: seconds a publish waits for any one generator rank.

    Raises:
        MeshLayoutError: a shard is missing or has the wrong shape, or the rank is out of range.
    """

    def __init__(self, transport: Transport, name: str, shards: Mapping[str, torch.Tensor], layout: TrainerLayout,
                 *, rank: int, topology: Topology | None = None, deadline: float = 30.0) -> None:
        if not 0 <= rank < MAX_TRAINER_RANKS:
            raise MeshLayoutError(f"trainer rank {rank} is outside [0, {MAX_TRAINER_RANKS})")
        self.t, self.name, self.rank, self.layout, self.deadline = transport, name, rank, layout, deadline
        self.keys = MeshKeys.of(name)
        self._planner = Planner(layout, topology)
        # What this rank packs into a snapshot: its box of every tensor, at the wire dtype (FP8
        # tensors quantized, and the block scales it holds).
        packed, self._offsets, self._total = snapshot_layout(layout, rank)
        self._packed = [(n, shape, getattr(torch, d)) for n, shape, d in packed]
        self._live = self._check_shards(shards)
        self._quant = BlockQuantizer(transport, self.keys, layout, rank)
        self._members = MeshPeers(transport, self.keys)
        self._snaps: list[torch.Tensor] = []
        self._tctl: torch.Tensor | None = None
        self._layout_bytes: torch.Tensor | None = None
        self._plans: dict[str, ReplicaPlan] = {}
        self._prepared: dict[tuple[str, str, int], PreparedTransfer] = {}
        self._version: int | None = None
        self._lock = anyio.Lock()
        self._open = False  # between start() and close()

    def _check_shards(self, shards: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """name -> this rank's local shard, for every tensor of the state it holds a box of
        (derived tensors, the FP8 block scales, are computed, not given)."""
        derived = {t.name for t in self.layout.tensors if t.scale_of is not None}
        live = {}
        for name, shape, _ in self._packed:
            if name in derived:
                continue
            shard = shards.get(name)
            if shard is not None and hasattr(shard, "to_local"):  # a DTensor: its local shard
                shard = shard.to_local()
            if shard is None or tuple(shard.shape) != shape:
                got = None if shard is None else tuple(shard.shape)
                raise MeshLayoutError(f"trainer rank {self.rank}: {name} needs a local shard of shape {shape}, "
                                      f"got {got}")
            live[name] = shard
        return live

    async def __aenter__(self) -> MeshPublisher:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def start(self) -> None:
        """Registers this rank's layout, control block and snapshots (read-only to peers).

        Raises:
            RegistrationError: a region name is taken.
            ClosedError: the Transport is closed.
        """
        data = encode_trainer(self.layout)
        self._layout_bytes = self.t.empty(self.keys.trainer, len(data), torch.uint8, writable=False)
        self._layout_bytes.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._tctl = self.t.empty(self.keys.tctl, TCTL_WORDS, torch.int64, writable=False)
        self._tctl[TRANK] = self.rank + 1
        self._snaps = [self.t.empty(k, self._total, torch.uint8, writable=False) for k in self.keys.snaps]
        self._quant.start()
        self._open = True

    async def aclose(self) -> None:
        """Withdraws this rank's regions: generator ranks then see it gone (their next commit
        or pull waits for a trainer rank that is listed), and its prepared pushes are dropped.

        Idempotent, and safe after the Transport closed (which withdrew the regions already).
        A later :meth:`publish` raises :class:`ClosedError`. The shards passed in stay the
        caller's; the snapshots are freed once no push in flight uses them.

        Cancellation: the regions are withdrawn all the same (nothing here waits).
        """
        self.close()

    def close(self) -> None:
        """:meth:`aclose` for synchronous callers (the same, as nothing in it waits)."""
        self._open = False
        withdraw(self.t, [*self.keys.amax, *self.keys.snaps, self.keys.tctl, self.keys.trainer])
        self._prepared.clear()

    # -- publishing ------------------------------------------------------------------------

    async def publish(self, version: int, shards: Mapping[str, torch.Tensor] | None = None) -> MeshPublishReport:
        """Pushes ``version`` of this rank's shards to every generator rank that needs them.

        The shards are copied into a snapshot first: once this returns (or once packing is done,
        see ``pack_s``), the caller may change them. Versions must increase.

        Args:
            version: the version number (>= 0, larger than the last one published).
            shards: this rank's shards now (as in the constructor; DTensors are taken by their
                local shard), when they are not the same tensors as before.

        Returns:
            The report: per generator rank fed, DONE, STRAGGLER (its slot still in use, or not
            complete within ``deadline``) or FAILED.

        Raises:
            ValueError: the version does not increase.
            MeshLayoutError: a shard in ``shards`` is missing or has the wrong shape.
            ClosedError: the publisher is not started or is closed, or the Transport is closed.

        Cancellation: pushes in flight are abandoned; generator ranks never see that version
        complete from this rank (their done words say "writing"), so it is never applied.
        """
        if self._tctl is None:
            raise ClosedError(f"mesh publisher {self.name!r}: not started")
        if not self._open:
            raise ClosedError(f"mesh publisher {self.name!r}: closed")
        if version < 0 or (self._version is not None and version <= self._version):
            raise ValueError(f"version {version} does not increase (last {self._version})")
        if shards is not None:
            self._live = self._check_shards(shards)
        async with self._lock:
            t0 = time.perf_counter()
            members = await self._members.scan()  # discovery, counted in plan_s
            t_scan = time.perf_counter()
            converted: dict[str, torch.Tensor] = {}
            if self._quant.active:
                trainers = {r: p.name for r, p in members.trainers.items()}
                converted = await self._quant.quantize(version, self._live, self._tctl, trainers, self.deadline)
            self._pack(version, converted)
            self._version = version
            t1 = time.perf_counter()
            work, incomplete, refused = self._discover(members)
            t2 = time.perf_counter()
            results: dict[str, SyncResult] = {}
            async with anyio.create_task_group() as tg:
                for label, peer, incarnation, plan_moves in work:
                    tg.start_soon(self._push_one, label, peer, incarnation, plan_moves, version, t0, results)
            t3 = time.perf_counter()
        return MeshPublishReport(version, results, incomplete, refused, t1 - t_scan, (t_scan - t0) + (t2 - t1),
                                 t3 - t2, t3 - t0)

    def _pack(self, version: int, converted: Mapping[str, torch.Tensor]) -> None:
        """Copies the shards (``converted`` ones as given) into snapshot ``version % 2`` under
        its seqlock."""
        assert self._tctl is not None
        s = slot_of(version)
        ctl, snap = self._tctl, self._snaps[s]
        ctl[GEN0 + s] += 1  # odd: being written
        memory_barrier()
        for name, shape, dtype in self._packed:
            off, nbytes = self._offsets[name]
            src = converted[name] if name in converted else self._live[name]
            snap[off : off + nbytes].view(dtype).view(shape).copy_(src.detach())
        memory_barrier()
        ctl[SNAPVER0 + s] = version + 1
        ctl[GEN0 + s] += 1
        memory_barrier()
        ctl[FRONT] = encode_front(version, s)

    def _discover(self, members: MeshMembers) -> tuple[list[tuple[str, str, str, ReplicaPlanMoves]], tuple[str, ...],
                                                       dict[str, str]]:
        """The generator ranks this rank feeds now, with their moves; replicas seen incomplete;
        replicas refused (and why)."""
        by_replica: dict[str, dict[int, tuple[str, str, RankLayout]]] = {}
        for n, (peer, rl) in members.generators.items():
            by_replica.setdefault(rl.replica, {})[rl.rank] = (n, peer.incarnation, rl)
        work, incomplete, refused = [], [], {}
        for rid, ranks in sorted(by_replica.items()):
            size = next(iter(ranks.values()))[2].size
            if sorted(ranks) != list(range(size)) or any(r[2].size != size for r in ranks.values()):
                incomplete.append(rid)
                continue
            replica = Replica(rid, tuple(ranks[k][2].layout for k in range(size)))
            try:
                plan = self._plan(replica)
            except MeshLayoutError as exc:
                refused[rid] = str(exc)
                continue
            for k, rp in enumerate(plan.ranks):
                moves = tuple(m for m in rp.moves if m.src == self.rank)
                if moves:
                    name, incarnation, rl = ranks[k]
                    work.append((f"{rid}/{k}", name, incarnation, ReplicaPlanMoves(moves, rl)))
        # What served replicas and ranks no longer here held goes with them.
        self._plans = {rid: p for rid, p in self._plans.items() if rid in by_replica}
        served = {(name, incarnation) for _, name, incarnation, _ in work}
        self._prepared = {k: v for k, v in self._prepared.items() if k[:2] in served}
        return work, tuple(incomplete), refused

    def _plan(self, replica: Replica) -> ReplicaPlan:
        """The replica's plan, reused while its layout is unchanged; checks that what the
        trainer sends is what each local tensor holds (dtype)."""
        old = self._plans.get(replica.id)
        plan = self._planner.plan_replica(replica, old)
        if plan is old:
            return plan
        specs = self.layout.by_name()
        for r, g in enumerate(replica.ranks):
            for lt in g.tensors:
                for p in lt.pieces:
                    spec = specs.get(p.name)
                    if spec is not None and spec.dtype != lt.dtype:
                        raise MeshLayoutError(f"replica {replica.id} rank {r}: {lt.name} is {lt.dtype}, "
                                              f"the trainer sends {p.name} as {spec.dtype}")
        self._plans[replica.id] = plan
        return plan

    def _prepare(self, peer: str, incarnation: str, slot: int, work: ReplicaPlanMoves) -> PreparedTransfer:
        key = (peer, incarnation, slot)
        got = self._prepared.get(key)
        if got is None:
            self._prepared = {k: v for k, v in self._prepared.items() if k[0] != peer or k[1] == incarnation}
            snap, target = self._snaps[slot], self.keys.slots[slot]
            layout = work.rank.layout
            runs = byte_runs(self._planner, work.moves, {lt.name: lt for lt in layout.tensors}, self._offsets,
                             slot_layout(layout)[0])
            got = self._prepared[key] = self.t.prepare_put_runs(peer, snap, target, runs)
        return got

    async def _push_one(self, label: str, peer: str, incarnation: str, work: ReplicaPlanMoves, version: int,
                        t0: float, results: dict[str, SyncResult]) -> None:
        slot = slot_of(version)
        nbytes = sum(m.nbytes for m in work.moves)
        word = done_word(slot, self.rank) * 8
        status, error = SyncStatus.DONE, None
        header = torch.empty(HEADER_WORDS, dtype=torch.int64)
        mark = torch.empty(1, dtype=torch.int64)
        prev = torch.empty(1, dtype=torch.int64)
        with anyio.move_on_after(self.deadline) as scope:
            try:
                prepared = self._prepare(peer, incarnation, slot, work)
                await self.t.get(header, peer, key=self.keys.ctl)
                why = slot_busy(header, slot)
                if why is None:
                    await self.t.get(prev, peer, key=self.keys.ctl, offset=word)
                    mark[0] = -(version + 1)  # writing: the leader will not commit this slot
                    await self.t.put(mark, peer, key=self.keys.ctl, offset=word)
                    await self.t.get(header, peer, key=self.keys.ctl)  # then look again (two-flag handshake)
                    why = slot_busy(header, slot)
                    if why is not None:
                        await self.t.put(prev, peer, key=self.keys.ctl, offset=word)
                if why is not None:
                    status, error = SyncStatus.STRAGGLER, f"slot {slot} is {why}"
                else:
                    await prepared.start(timeout=self.deadline)
                    mark[0] = version + 1
                    await self.t.put(mark, peer, key=self.keys.ctl, offset=word)
            except (TransportError, MeshLayoutError) as exc:
                status, error = SyncStatus.FAILED, f"{type(exc).__name__}: {exc}"
        if scope.cancelled_caught:
            status, error = SyncStatus.STRAGGLER, f"not complete within {self.deadline:g}s"
        if status is not SyncStatus.DONE:
            log.info("mesh publisher %s rank %d: version %d to %s (%s): %s", self.name, self.rank, version, label,
                     peer, error)
        results[label] = SyncResult(peer, version, status, nbytes if status is SyncStatus.DONE else 0,
                                    time.perf_counter() - t0, error)


@dataclass(frozen=True)
class ReplicaPlanMoves:
    """This trainer rank's moves into one generator rank, and that rank's layout."""

    moves: tuple[Move, ...]
    rank: RankLayout

