"""``MeshPublisher``: one trainer rank's side of a mesh stream (see ``_mesh_control``)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import torch

from .._errors import ClosedError
from ..plan import (
    MeshLayoutError,
    Planner,
    RankLayout,
    Replica,
    ReplicaPlan,
    Topology,
    TrainerLayout,
    encode_trainer,
)
from ._binding import snapshot_layout
from ._codec.policy import RUNS, Crossover
from ._codec.runs import MeshDeltaPacker
from ._control import encode_front, memory_barrier, withdraw
from ._copy import available_threads
from ._lifecycle import Lifecycle
from ._mesh_control import (
    FRONT,
    GEN0,
    HEADER_WORDS,
    MAX_TRAINER_RANKS,
    SNAPVER0,
    TCTL_WORDS,
    TRANK,
    MeshKeys,
    slot_of,
)
from ._mesh_fp8 import BlockQuantizer
from ._mesh_peers import MeshMembers, MeshPeers
from ._mesh_push import MeshPushes, ReplicaPlanMoves
from ._mesh_relays import MeshRelays
from ._report import SyncResult
from ._roster import Departures
from ._warm import WarmTarget, warm_pushes

if TYPE_CHECKING:
    from .. import Peer, PreparedTransfer, Transport

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
        changed: with delta sync, the fraction of this rank's 2-byte units that changed since
            the version its snapshot held (None: not diffed: no base yet, delta sync off, no
            generator rank fed holds the base, no delta pays on the path of any that does, its
            sample changed more than their crossovers, or more than the crossover changed).
        crossovers: with delta sync, ``"replica/rank"`` -> the changed fraction of its units up
            to which that generator rank would take this version as a delta (the given
            ``delta_crossover``, else chosen from its measured path; 0.0: no delta pays there,
            it gets the version dense), for each rank fed that holds the base; empty when none
            does.
        sampled: the changed fraction of a sample of this rank's units, taken before the diff
            (None: not sampled, as nothing could take a delta).
        left: generator ranks of the stream (peer names) seen at the last publish that have
            left since (their Transport closed, or they no longer take part), each reported
            once; sorted.
        dead: generator ranks seen at the last publish whose process died since (peer name ->
            why), each reported once. Their replicas are ``incomplete`` until they return.
    """

    version: int
    results: dict[str, SyncResult] = field(default_factory=dict)
    incomplete: tuple[str, ...] = ()
    refused: dict[str, str] = field(default_factory=dict)
    pack_s: float = 0.0
    plan_s: float = 0.0
    push_s: float = 0.0
    total_s: float = 0.0
    changed: float | None = None
    left: tuple[str, ...] = ()
    dead: dict[str, str] = field(default_factory=dict)
    crossovers: dict[str, float] = field(default_factory=dict)
    sampled: float | None = None


class MeshPublisher(Lifecycle):
    """Pushes this trainer rank's shards into every generator rank that needs them.

    Every trainer rank runs one, with the same ``layout`` and ``name``; they never talk to each
    other. ``publish(v)`` packs this rank's shards into snapshot ``v % 2`` (cast to the layout's
    dtypes), finds the generator replicas in the rendezvous, plans (once per replica layout,
    see :class:`transport.plan.Planner`) and writes this rank's part of the plan into each
    generator rank's slot ``v % 2`` as one prepared transfer, then marks it done in that rank's
    control block. A generator rank whose slot is still committed or being applied is skipped
    for this version (a straggler); one that fails is reported; neither delays the others.

    Use as ``async with MeshPublisher(...) as pub:`` (or ``await pub.start()`` / ``await
    pub.aclose()``; ``close()`` is the same as ``aclose()`` for synchronous callers).
    ``start()`` is a coroutine, as on every weights class.

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
        delta: delta sync: each version is diffed bit for bit, while it is packed, against the
            version its snapshot held, and a generator rank whose slot holds exactly that
            version from this rank (and that takes deltas) gets only the changed 2-byte units
            of its slices, checked and applied by that rank when it reads the version (see
            :mod:`transport.weights._codec.runs`), where that changes no more of its units than
            its crossover (``delta_crossover``); every other rank gets the version dense.
            ``"auto"`` (the default): only to generator ranks reached over a network backend,
            not over shared memory (as fast as the memory pass that finds the change).
            ``True``: to every rank that takes them. ``False``: every version dense, not diffed.
        delta_crossover: the changed fraction of a generator rank's units above which it gets a
            version dense. None (the default): chosen per version and generator rank from what
            this rank measured (:class:`._codec.policy.Crossover`: its last dense push there,
            the diff, and this host's copy, checksum and checked-patch rates), the highest at
            which a delta is predicted to take at most 0.8 of the dense push, down to 0.0 (dense;
            ``RUNS_CROSSOVER``, 0.2, until its path is measured). A version none of whose ranks
            holding the base would take it as a delta, or whose sample (taken first) changed
            more than any would take, is packed without a diff. A float is used as it is.
        relays: per-host relays (:mod:`._mesh_relays`): where two or more generator ranks that
            take part (``MeshSubscriber(relay=True)``, the default) share a host other than
            this rank's and get the very same bytes from it (ranks of the same place in
            replicas of the same layout), this rank pushes the version once per such group,
            into one of them (the relay); the others copy it from the relay's slot over shared
            memory as its pieces land. A relay that fails or stalls costs its members at most
            ``relay_timeout`` and a direct push. ``"host"`` is the same as True. ``"chain"``:
            the host relays of ranks that need the same bytes are chained across hosts (this
            rank pushes once in all; each host's relay copies from the previous host's as its
            pieces land): where this rank's link binds even at one copy per host (``python -m
            transport.plan simulate --relays auto`` says which pays). False: every generator
            rank is pushed to directly.
        relay_timeout: seconds a relay may go without any piece landing in it while one is on
            its way, after which it is taken for stalled (default ``min(deadline, 5)``).

    Raises:
        MeshLayoutError: a shard is missing or has the wrong shape, or the rank is out of range.
        ValueError: ``delta``, ``delta_crossover``, ``relays`` or ``relay_timeout`` out of range.
    """

    def __init__(self, transport: Transport, name: str, shards: Mapping[str, torch.Tensor], layout: TrainerLayout,
                 *, rank: int, topology: Topology | None = None, deadline: float = 30.0,
                 delta: bool | str = "auto", delta_crossover: float | None = None, relays: bool | str = True,
                 relay_timeout: float | None = None) -> None:
        if delta not in (True, False, "auto"):
            raise ValueError(f"delta must be True, False or 'auto', not {delta!r}")
        if relays not in (True, False, "host", "chain"):
            raise ValueError(f"relays must be True, False, 'host' or 'chain', not {relays!r}")
        if relay_timeout is not None and not relay_timeout > 0:
            raise ValueError(f"relay_timeout must be > 0, not {relay_timeout!r}")
        if delta_crossover is not None and not 0 < delta_crossover <= 0.5:
            raise ValueError(f"delta_crossover must be None or in (0, 0.5], not {delta_crossover!r}")
        if not 0 <= rank < MAX_TRAINER_RANKS:
            raise MeshLayoutError(f"trainer rank {rank} is outside [0, {MAX_TRAINER_RANKS})")
        # Ties between trainer ranks holding the same part are broken alike where relays share
        # bytes: per host, or for every replica along a chain (published with the layout).
        mode = ("chain" if relays == "chain" else "host") if relays else None
        layout = dataclasses.replace(layout, balance={None: "replica", "host": "host", "chain": "all"}[mode])
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
        self._departures = Departures(transport.name, "generator rank")  # the ranks seen, and who of them went
        self._tctl: torch.Tensor | None = None
        self._layout_bytes: torch.Tensor | None = None
        self._plans: dict[str, ReplicaPlan] = {}
        self._version: int | None = None
        self._lock = anyio.Lock()
        self._open = False  # between start() and close()
        self._packer = MeshDeltaPacker(self._packed, self._offsets, self._total) if delta else None
        if self._packer is not None and self._packer.why_not is not None:
            log.info("mesh publisher %s rank %d: no delta sync: %s", name, rank, self._packer.why_not)
            self._packer = None
        crossover = None if self._packer is None else \
            Crossover(delta_crossover, self._total, self._packer.total_units, 2, available_threads(), RUNS)
        self._pushes = MeshPushes(transport, self.keys, rank, self._planner, self._offsets, deadline,
                                  delta=self._packer is not None, delta_everywhere=delta is True, crossover=crossover)
        self._sampled: float | None = None  # the last version's sample (None: not sampled)
        stall = min(deadline, 5.0) if relay_timeout is None else float(relay_timeout)
        self._relays = MeshRelays(transport, self.keys, rank, self._pushes, deadline, stall, mode) if mode else None

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

    async def start(self) -> None:
        """Registers this rank's layout, control block and snapshots (read-only to peers).

        Raises:
            RegistrationError: a region name is taken.
            ClosedError: the Transport is closed.

        Cancellation: nothing here waits; once called, the registration completes.
        """
        data = encode_trainer(self.layout)
        self._layout_bytes = self.t.empty(self.keys.trainer, len(data), torch.uint8, writable=False)
        self._layout_bytes.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._tctl = self.t.empty(self.keys.tctl, TCTL_WORDS, torch.int64, writable=False)
        self._tctl[TRANK] = self.rank + 1
        self._pushes.snaps = [self.t.empty(k, self._total, torch.uint8, writable=False) for k in self.keys.snaps]
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
        self._pushes.forget(set())

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
            await self._pack(version, converted)
            self._version = version
            t1 = time.perf_counter()
            work, incomplete, refused = self._discover(members)
            present = {n: p for n, (p, _) in members.generators.items()}  # (fed or not: a replica incomplete)
            left, dead = self._departures.since(present, members.listed)
            t2 = time.perf_counter()
            results: dict[str, SyncResult] = {}

            async def direct(label: str, peer: Peer, moves: ReplicaPlanMoves) -> None:
                results[label] = await self._pushes.push(label, peer, moves, version, t0)

            groups, alone = self._relays.groups(work) if self._relays is not None else ([], work)
            async with anyio.create_task_group() as tg:
                for label, peer, plan_moves in alone:
                    tg.start_soon(direct, label, peer, plan_moves)
                for group in groups:
                    assert self._relays is not None
                    tg.start_soon(self._relays.serve, group, version, t0, results)
            t3 = time.perf_counter()
            self._departures.served(present, members.listed, dead)
            self._pushes.calibrate_ahead()
        change = self._pushes.change
        changed = change.density if change is not None else None
        chosen = self._pushes.chosen
        crossovers = {label: chosen[peer.name] for label, peer, _ in work if peer.name in chosen}
        return MeshPublishReport(version, results, incomplete, refused, t1 - t_scan, (t_scan - t0) + (t2 - t1),
                                 t3 - t2, t3 - t0, changed, left, {n: why for (n, _), why in dead.items()},
                                 crossovers, self._sampled)

    async def warm(self) -> int:
        """Readies the pushes to generator ranks this rank has not pushed to or warmed yet, so
        that the first version they get costs what later ones do: finds the replicas, plans,
        prepares the transfers into both of each rank's slots and warms them
        (:meth:`PreparedTransfer.warm`: over ``ipc``, this process's page tables for exactly
        the slot bytes it writes), and makes the first control-word reads. Moves no weights;
        generator ranks see nothing.

        Optional, and cheap when nothing is new (one scan of the rendezvous): call it where time
        is free, e.g. in a task beside the training step, so that a rank that joins or restarts
        does not make the next :meth:`publish` slow. A publish waits for a warm in progress.

        Returns:
            The transfers warmed now (two per generator rank newly fed).

        Raises:
            ClosedError: the publisher is not started or is closed, or the Transport is closed.

        A generator rank that cannot be warmed (gone, or its record refused) is skipped: the
        next :meth:`publish` reports it. Cancellation: safe; what was warmed stays warm.
        """
        if self._tctl is None or not self._open:
            raise ClosedError(f"mesh publisher {self.name!r}: not started or closed")
        async with self._lock:
            work, _incomplete, _refused = self._discover(await self._members.scan())
            header = torch.empty(HEADER_WORDS, dtype=torch.int64)
            targets = []
            for label, peer, moves in work:
                # A slot's prepared transfer exists once it was pushed to or warmed (_discover
                # drops those of ranks no longer fed); one whose warm failed is dropped by warm_pushes.
                todo = [s for s in (0, 1) if not self._pushes.has_prepared(peer, s)]
                if not todo:
                    continue

                async def ready(p: Peer = peer) -> None:  # its delta area and a first control-word read
                    await self._pushes.area(p)
                    await self.t.get(header, p.name, key=self.keys.ctl)

                def prepare(s: int, p: Peer = peer, m: ReplicaPlanMoves = moves) -> PreparedTransfer:
                    return self._pushes.prepare(p, s, m)

                targets.append(WarmTarget(f"{label} ({peer.name})", todo, prepare,
                                          functools.partial(self._pushes.drop, peer), ready))
            return await warm_pushes(targets, self.deadline, (MeshLayoutError,),
                                     f"mesh publisher {self.name} rank {self.rank}")

    async def _pack(self, version: int, converted: Mapping[str, torch.Tensor]) -> None:
        """Copies the shards (``converted`` ones as given) into snapshot ``version % 2`` under
        its seqlock; with delta sync, diffing them against the version it held where a
        generator rank that holds that version may take this one as a delta
        (:meth:`MeshPushes.choose`) and the sample of the change (taken first) is within the
        highest of their crossovers."""
        assert self._tctl is not None
        s = slot_of(version)
        ctl, snap = self._tctl, self._pushes.snaps[s]
        held = int(ctl[SNAPVER0 + s]) - 1  # the version the snapshot holds (-1: none)
        sources = {name: converted[name] if name in converted else self._live[name] for name, _, _ in self._packed}
        packer, base, self._sampled = self._packer, None, None
        if packer is not None and held >= 0:
            limit = max((await self._pushes.choose(s, held)).values(), default=0.0)
            if limit > 0:
                packer.crossover = limit
                self._sampled = await anyio.to_thread.run_sync(packer.sample, snap, sources)
                base = held if self._sampled is None or self._sampled <= limit else None
        ctl[GEN0 + s] += 1  # odd: being written
        memory_barrier()
        change = None
        if packer is not None:
            change = await anyio.to_thread.run_sync(packer.pack, snap, sources, version, base)
            model = self._pushes.crossover
            assert model is not None
            if packer.last_density is None:
                model.packed(packer.last_s)
            else:
                model.diffed(packer.last_s, packer.last_density)
        else:
            for name, shape, dtype in self._packed:
                off, nbytes = self._offsets[name]
                snap[off : off + nbytes].view(dtype).view(shape).copy_(sources[name].detach())
        memory_barrier()
        ctl[SNAPVER0 + s] = version + 1
        ctl[GEN0 + s] += 1
        memory_barrier()
        ctl[FRONT] = encode_front(version, s)
        self._pushes.begin(version, change)

    def _discover(self, members: MeshMembers) -> tuple[list[tuple[str, Peer, ReplicaPlanMoves]], tuple[str, ...],
                                                       dict[str, str]]:
        """The generator ranks this rank feeds now, with their moves; replicas seen incomplete;
        replicas refused (and why)."""
        by_replica: dict[str, dict[int, tuple[Peer, RankLayout]]] = {}
        for peer, rl in members.generators.values():
            by_replica.setdefault(rl.replica, {})[rl.rank] = (peer, rl)
        work, incomplete, refused = [], [], {}
        for rid, ranks in sorted(by_replica.items()):
            size = next(iter(ranks.values()))[1].size
            if sorted(ranks) != list(range(size)) or any(r[1].size != size for r in ranks.values()):
                incomplete.append(rid)
                continue
            # Tie-broken by the host of its rank 0, as its ranks plan it (_mesh_replica): the
            # replicas of one host get the same bytes from each trainer rank (relays).
            replica = Replica(rid, tuple(ranks[k][1].layout for k in range(size)), balance=ranks[0][0].host)
            try:
                plan = self._plan(replica)
            except MeshLayoutError as exc:
                refused[rid] = str(exc)
                continue
            for k, rp in enumerate(plan.ranks):
                moves = tuple(m for m in rp.moves if m.src == self.rank)
                if moves:
                    peer, rl = ranks[k]
                    work.append((f"{rid}/{k}", peer, ReplicaPlanMoves(moves, rl)))
        # What served replicas and ranks no longer here held goes with them.
        self._plans = {rid: p for rid, p in self._plans.items() if rid in by_replica}
        served = {(p.name, p.incarnation) for _, p, _ in work}
        self._pushes.forget(served)
        if self._relays is not None:
            self._relays.forget(served)
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
