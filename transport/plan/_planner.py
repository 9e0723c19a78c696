"""The mesh planner: which trainer rank sends which box to which generator rank.

Pure and deterministic: every rank that holds the same trainer layout and the same replica
layouts computes the same plan, so there is no central controller and nothing to broadcast.

For every piece a generator rank needs, the planner intersects it with the boxes the trainer
ranks hold. A part held by several ranks (DP/HSDP replicas, replicated tensors) is taken from
one of them, or cut along its first dimension and spread over them, always choosing the least
loaded (bytes to send, counted per NIC of the :class:`Topology`, then per rank). Loads are
counted per replica, from zero: a replica that joins, leaves or changes its TP degree changes
only its own part of the plan, and identical replicas break ties in different directions (a
rotation derived from the replica id), so together they stay balanced too; unless the trainer
layout's ``balance`` says they tie-break alike per host (``Replica.balance``) or all alike, so
that they get the same bytes from each trainer rank and can share relays.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .._errors import MeshLayoutError
from ._boxes import Box, box_shape, contains, row_major, segments, volume
from ._layouts import ITEMSIZE, LocalTensor, Piece, Replica, TrainerLayout

#: A part shared by several ranks is not cut into pieces smaller than this (bytes).
MIN_SPLIT_BYTES = 64 << 10


@dataclass(frozen=True)
class Topology:
    """Where trainer ranks send from: the NIC of each rank (``nics[rank]``, any label; ranks not
    listed have a NIC of their own). Loads are balanced per NIC first."""

    nics: Mapping[int, str] = field(default_factory=dict)

    def nic(self, rank: int) -> str:
        return self.nics.get(rank, f"rank{rank}")


@dataclass(frozen=True)
class Move:
    """Trainer rank ``src`` sends ``box`` of global tensor ``name``; it lands at ``dst_box`` of
    the generator rank's local tensor ``dst_tensor`` (``nbytes`` at that tensor's dtype)."""

    src: int
    name: str
    box: Box
    dst_tensor: str
    dst_box: Box
    nbytes: int


@dataclass(frozen=True)
class RankPlan:
    """Every move into one generator rank, sorted by (source rank, tensor, box)."""

    moves: tuple[Move, ...]

    def sources(self) -> list[int]:
        """The trainer ranks that feed this rank (a version is complete here once all have
        finished)."""
        return sorted({m.src for m in self.moves})

    def bytes_by_source(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for m in self.moves:
            out[m.src] = out.get(m.src, 0) + m.nbytes
        return out

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.moves)


@dataclass(frozen=True)
class ReplicaPlan:
    """The plan of one replica: a :class:`RankPlan` per generator rank (TP order)."""

    replica: str
    inputs: str  # fingerprint of the trainer layout and the replica layout it was planned from
    ranks: tuple[RankPlan, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranks)


@dataclass(frozen=True)
class Plan:
    """The whole plan: one :class:`ReplicaPlan` per replica id."""

    trainer: str  # fingerprint of the trainer layout
    replicas: Mapping[str, ReplicaPlan]

    def for_trainer(self, rank: int) -> list[tuple[str, int, tuple[Move, ...]]]:
        """What trainer ``rank`` sends: ``(replica, generator rank, moves)``, in replica and rank
        order, only where there is something to send."""
        out = []
        for rid in sorted(self.replicas):
            for g, rp in enumerate(self.replicas[rid].ranks):
                mine = tuple(m for m in rp.moves if m.src == rank)
                if mine:
                    out.append((rid, g, mine))
        return out

    def load(self) -> dict[int, int]:
        """Bytes each trainer rank sends, over all replicas."""
        out: dict[int, int] = {}
        for rp in self.replicas.values():
            for r in rp.ranks:
                for src, n in r.bytes_by_source().items():
                    out[src] = out.get(src, 0) + n
        return out

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.replicas.values())


class _Owners:
    """The distinct boxes of one global tensor the trainer ranks hold, and who holds each."""

    __slots__ = ("boxes", "hi", "holders", "lo")

    def __init__(self, by_rank: Mapping[int, Box], ndim: int) -> None:
        groups: dict[Box, list[int]] = {}
        for rank in sorted(by_rank):
            box = by_rank[rank]
            if volume(box) > 0:
                groups.setdefault(box, []).append(rank)
        self.boxes = sorted(groups)
        self.holders = [tuple(groups[b]) for b in self.boxes]
        arr = np.array([[list(iv) for iv in b] for b in self.boxes], dtype=np.int64).reshape(len(self.boxes), ndim, 2)
        self.lo, self.hi = arr[:, :, 0], arr[:, :, 1]

    def cover(self, box: Box) -> list[tuple[Box, tuple[int, ...]]]:
        """The parts of ``box`` held by each distinct trainer box, with their holders."""
        if not self.boxes:
            return []
        if not box:
            return [((), self.holders[0])]
        want = np.array(box, dtype=np.int64)
        lo = np.maximum(self.lo, want[:, 0])
        hi = np.minimum(self.hi, want[:, 1])
        hit = np.flatnonzero(np.all(lo < hi, axis=1))
        return [(tuple((int(a), int(b)) for a, b in zip(lo[i], hi[i], strict=True)), self.holders[i]) for i in hit]


def _rotation(replica: str) -> int:
    return int.from_bytes(hashlib.sha256(replica.encode()).digest()[:4], "little")


class Planner:
    """Plans replicas against one trainer layout (its ownership index is built once).

    Args:
        trainer: the trainer layout (validated).
        topology: the trainer ranks' NICs (default: one per rank).
    """

    def __init__(self, trainer: TrainerLayout, topology: Topology | None = None) -> None:
        trainer.validate()
        self.trainer = trainer
        self.topology = topology or Topology()
        self._specs = trainer.by_name()
        self._owners: dict[str, _Owners] = {}
        self._boxes: dict[str, dict[int, Box]] = {}
        self._fingerprint = trainer.fingerprint()

    def box(self, name: str, rank: int) -> Box | None:
        """The box of global tensor ``name`` that trainer ``rank`` holds (None: none), from a
        table worked out once per tensor."""
        boxes = self._boxes.get(name)
        if boxes is None:
            spec = self._specs[name]
            boxes = self._boxes[name] = spec.sharding.boxes(spec.shape)
        return boxes.get(rank)

    def _owners_of(self, name: str) -> _Owners:
        got = self._owners.get(name)
        if got is None:
            spec = self._specs[name]
            got = self._owners[name] = _Owners(spec.sharding.boxes(spec.shape), len(spec.shape))
        return got

    def plan(self, replicas: Iterable[Replica], previous: Plan | None = None) -> Plan:
        """Plans every replica. Replicas whose plan in ``previous`` was made from the same
        layouts keep it as it is (nothing is recomputed for them).

        Raises:
            MeshLayoutError: a replica's layout is invalid (see :meth:`Replica.validate`), a needed
                byte is held by no trainer rank, or two replicas share an id.
        """
        out: dict[str, ReplicaPlan] = {}
        for replica in replicas:
            if replica.id in out:
                raise MeshLayoutError(f"two replicas have the id {replica.id!r}")
            out[replica.id] = self.plan_replica(replica, previous.replicas.get(replica.id) if previous else None)
        return Plan(self._fingerprint, dict(sorted(out.items())))

    def _balance_key(self, replica: Replica) -> str:
        """What ``replica``'s ties are broken by, under the layout's ``balance``."""
        balance = self.trainer.balance
        if balance == "all":
            return "all"
        return (replica.balance or replica.id) if balance == "host" else replica.id

    def plan_replica(self, replica: Replica, previous: ReplicaPlan | None = None) -> ReplicaPlan:
        """The plan of one replica (validated first); ``previous`` itself when it was planned
        from the same layouts (nothing is recomputed then).

        Raises:
            MeshLayoutError: see :meth:`plan`.
        """
        inputs = f"{self._fingerprint}:{replica.fingerprint()}"
        if previous is not None and previous.inputs == inputs:
            return previous
        replica.validate(self.trainer)
        rot = _rotation(self._balance_key(replica))
        nic_load: dict[str, int] = {}
        rank_load: dict[int, int] = {}
        # Every part with one holder is fixed; shared parts are placed largest first (LPT).
        tasks: list[tuple[int, int, LocalTensor, Piece, Box, tuple[int, ...]]] = []
        moves: list[list[Move]] = [[] for _ in replica.ranks]
        for g, rank in enumerate(replica.ranks):
            for lt in rank.tensors:
                item = ITEMSIZE[lt.dtype]
                for piece in lt.pieces:
                    parts = self._owners_of(piece.name).cover(piece.box)
                    if sum(volume(b) for b, _ in parts) != volume(piece.box):
                        raise MeshLayoutError(f"replica {replica.id} rank {g} {lt.name}: part of "
                                              f"{piece.name}{piece.box} is held by no trainer rank")
                    for box, holders in parts:
                        nbytes = volume(box) * item
                        if len(holders) == 1:
                            self._add(moves[g], holders[0], lt, piece, box, nbytes, nic_load, rank_load)
                        else:
                            tasks.append((-nbytes, g, lt, piece, box, holders))
        tasks.sort(key=lambda t: (t[0], t[1], t[2].name, t[3].name, t[4]))
        for neg, g, lt, piece, box, holders in tasks:
            c = len(holders)
            order = [holders[(i + rot) % c] for i in range(c)]  # identical replicas lean different ways
            for src, part in self._share(box, -neg, order, nic_load, rank_load):
                self._add(moves[g], src, lt, piece, part, volume(part) * ITEMSIZE[lt.dtype], nic_load, rank_load)
        ranks = tuple(RankPlan(tuple(sorted(ms, key=lambda m: (m.src, m.name, m.box, m.dst_tensor)))) for ms in moves)
        return ReplicaPlan(replica.id, inputs, ranks)

    def _add(self, out: list[Move], src: int, lt: LocalTensor, piece: Piece, box: Box, nbytes: int,
             nic_load: dict[str, int], rank_load: dict[int, int]) -> None:
        out.append(Move(src, piece.name, box, lt.name, _dst_box(piece, box), nbytes))
        nic = self.topology.nic(src)
        nic_load[nic] = nic_load.get(nic, 0) + nbytes
        rank_load[src] = rank_load.get(src, 0) + nbytes

    def _share(self, box: Box, nbytes: int, holders: list[int], nic_load: dict[str, int],
               rank_load: dict[int, int]) -> list[tuple[int, Box]]:
        """Spreads ``box`` over its holders so that their loads even out: water-filling over
        their NICs, then over the holders of each NIC, cut along the box's first dimension
        longer than 1 into parts of at least MIN_SPLIT_BYTES (a smaller box goes whole to the
        least loaded holder)."""
        dim = next((d for d, (lo, hi) in enumerate(box) if hi - lo > 1), None)
        live = list(holders)
        while True:
            if dim is None or nbytes < 2 * MIN_SPLIT_BYTES or len(live) == 1:
                best = min(live, key=lambda h: (nic_load.get(self.topology.nic(h), 0), rank_load.get(h, 0),
                                                holders.index(h)))
                return [(best, box)]
            nics = list(dict.fromkeys(self.topology.nic(h) for h in live))
            share: dict[int, int] = {}
            for nic, amount in zip(nics, _water_fill([nic_load.get(n, 0) for n in nics], nbytes), strict=True):
                mine = [h for h in live if self.topology.nic(h) == nic]
                share.update(zip(mine, _water_fill([rank_load.get(h, 0) for h in mine], amount), strict=True))
            small = [h for h in live if 0 < share[h] < MIN_SPLIT_BYTES]
            if not small:
                break
            live = [h for h in live if h not in small[-1:]]  # drop one (the last) and fill again
        lo, hi = box[dim]
        rows, out, done, at = hi - lo, [], 0, lo
        for h in live:
            done += share[h]
            end = lo + (rows * done + nbytes // 2) // nbytes  # cumulative rounding: the rows add up
            if end > at:
                out.append((h, (*box[:dim], (at, end), *box[dim + 1 :])))
                at = end
        return out

    def segments(self, move: Move, dst: LocalTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The runs of ``move`` (``(src, dst, length)`` in elements): offsets into the sending
        rank's local shard of ``move.name`` and into ``dst``, the generator's local tensor."""
        own = self.box(move.name, move.src)
        if own is None:
            raise MeshLayoutError(f"trainer rank {move.src} holds no part of {move.name}")
        src = row_major(box_shape(own), [lo for lo, _ in own])
        # Local pieces are disjoint: the one the move lands in is its piece (the same global box
        # may fill several places).
        piece = next(p for p in dst.pieces
                     if p.name == move.name and contains(p.local, move.dst_box) and contains(p.box, move.box))
        return segments(move.box, src, _piece_addressing(piece, dst.shape))


def _water_fill(loads: list[int], total: int) -> list[int]:
    """Integer amounts summing to ``total`` that bring the lowest ``loads`` up to one level
    (ties to the earlier entries)."""
    n = len(loads)
    order = sorted(range(n), key=lambda i: (loads[i], i))
    acc, k = 0, n
    for j in range(1, n + 1):
        acc += loads[order[j - 1]]
        if j == n or (total + acc) <= loads[order[j]] * j:
            k = j
            break
    base, rem = divmod(total + acc, k)
    out = [0] * n
    for rank_in_order, i in enumerate(order[:k]):
        out[i] = base - loads[i] + (1 if rank_in_order < rem else 0)
    return out


def _dims(piece: Piece) -> list[tuple[int, int]]:
    """Pairs (global dim, local dim) of the piece's dimensions longer than 1, in order."""
    g = [d for d, n in enumerate(box_shape(piece.box)) if n != 1]
    loc = [d for d, n in enumerate(box_shape(piece.local)) if n != 1]
    return list(zip(g, loc, strict=True))


def _dst_box(piece: Piece, box: Box) -> Box:
    """Where the global sub-box ``box`` of ``piece`` lands in the local tensor."""
    out = list(piece.local)
    for gd, ld in _dims(piece):
        off = piece.local[ld][0] - piece.box[gd][0]
        out[ld] = (box[gd][0] + off, box[gd][1] + off)
    return tuple(out)


def _piece_addressing(piece: Piece, shape: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """Addressing (see ``row_major``) of the local tensor of ``shape`` by the piece's global
    coordinates."""
    _, lstr = row_major(shape, [0] * len(shape))
    strides = [0] * len(piece.box)
    base = sum(lo * st for (lo, _), st in zip(piece.local, lstr, strict=True))
    for gd, ld in _dims(piece):
        strides[gd] = lstr[ld]
        base -= piece.box[gd][0] * lstr[ld]
    return base, tuple(strides)

