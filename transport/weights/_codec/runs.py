"""Delta sync of a mesh stream: a trainer rank sends a generator rank only the 2-byte units of
its slices that changed since the version that slot already holds.

Version ``v`` travels in slot ``v % 2`` and is packed into snapshot ``v % 2`` (see
:mod:`.._mesh_control`), so both hold the same earlier version, the *base* ``b``, before ``v``
arrives. The trainer rank diffs its live shards against that snapshot in the pass that packs
them (:class:`MeshDeltaPacker`: the snapshot is overwritten in place, and the changed units are
recorded with their old values), then cuts the change along each generator rank's byte runs
(:func:`cut`): positions become 2-byte units of the generator's slot, whatever the element type,
so one varint payload per (trainer rank, generator rank) goes into that generator's *delta area*
for the slot, at the place its table gives the trainer rank. The slot's own bytes are not
written; the generator rank applies the payload into the slot when it reads the committed
version (:class:`Materializer`), so the slot then holds ``v`` in full as if it had been sent
dense, and everything downstream (``apply``, ``reading``, the vLLM load) is unchanged.

A trainer rank sends a delta only when the generator rank's DONE word for the slot says it
holds ``b`` from that trainer rank, its ``MAT`` word says it materialised ``b`` there, the
trainer knows the checksum of its bytes of ``b`` there, and the cut changes no more of that
rank's units than its crossover (:class:`.policy.Crossover` in its ``RUNS`` form, per version
and rank; the version is not diffed at all where no rank holding ``b`` would take it). Those
words are anyone's to write, so the generator checks before it writes: the checksum (units
indexed by slot position, see ``csrc/delta.h``) over the trainer rank's runs in the slot must
be the header's base checksum (the slot holds exactly ``b`` from it), and the payload, read
alone, must turn it into the header's new checksum. A payload that fails any check is
refused whole; :meth:`MeshSubscriber.pull` then fetches the version from the snapshots.

Area of one slot: a table entry per trainer rank ``(rank, offset, cap)`` (in the read-only
``dtab`` region), each sub-area a 64-byte header ``(magic, version, base, base checksum, new
checksum, units, position bytes, payload bytes)`` then the payload ``[values][pad to
8][positions]``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..._errors import DeltaRefusedError
from ..._native import delta as native
from .._copy import HostCopies, available_threads
from .encode import sample_runs
from .format import HEAD_BYTES, MASK64, MESH_MAGIC, Kind, signed, unsigned
from .patch import Patch, Scratch, apply_patches
from .policy import RUNS_CROSSOVER

# -- the trainer's side -----------------------------------------------------------------------


@dataclass
class Change:
    """What changed in a snapshot since its base: sorted unit positions (bytes / 2) and the
    old and new 2-byte values there."""

    version: int
    base: int
    units: np.ndarray  # uint64
    old: np.ndarray  # uint16
    new: np.ndarray  # uint16
    total_units: int

    @property
    def density(self) -> float:
        return len(self.units) / max(1, self.total_units)


class MeshDeltaPacker:
    """Packs a trainer rank's shards into a snapshot in place, recording what changed.

    Args:
        packed: ``(name, shape, dtype)`` in packing order; offsets: name -> (offset, nbytes).
        crossover: the changed fraction above which a version goes dense (recording stops);
            the publisher sets it per version (:class:`.policy.Crossover`).

    Attributes:
        last_s: seconds the last :meth:`pack` took (its diff included, if it diffed).
        last_density: the changed fraction the last :meth:`pack` found (None: it did not diff).
    """

    def __init__(self, packed: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
                 offsets: Mapping[str, tuple[int, int]], total: int, crossover: float = RUNS_CROSSOVER) -> None:
        self._packed, self._offsets, self.crossover = list(packed), dict(offsets), crossover
        self.total_units = sum(nbytes // 2 for _, nbytes in self._offsets.values())
        odd = [n for n, (_, nbytes) in self._offsets.items() if nbytes % 2]
        self.why_not = f"tensors of an odd byte size ({odd[:3]})" if odd else None
        # Records of the changes (positions, old values), grown to what the crossover asks for.
        self._positions = torch.empty(0, dtype=torch.int64)
        self._old = torch.empty(0, dtype=torch.int16)
        self._threads = available_threads()
        self._groups = self._split()
        # Per group, a kept buffer for the shards cast before their diff (no page faults a version).
        self._cast: list[torch.Tensor | None] = [None] * len(self._groups)
        self.last_s = 0.0
        self.last_density: float | None = None

    def sample(self, snap: torch.Tensor, sources: Mapping[str, torch.Tensor]) -> float | None:
        """The changed fraction of a sample of the units (:func:`sample_runs`: runs spread over
        each shard, the whole shard when it is small; counting only) between ``sources`` and
        ``snap``, as the diff would count it: each shard's sampled fraction weighed by its size
        (as :meth:`DeltaEncoder.predicts_dense` weighs them); None when no shard could be sampled
        (non-contiguous or CUDA shards are not). Runs in a worker thread."""
        changed = 0.0
        sampled = 0
        sptr = snap.data_ptr()
        for name, _, dtype in self._packed:
            off, nbytes = self._offsets[name]
            src = sources[name].detach()
            if src.is_cuda or not src.is_contiguous() or nbytes < 2:
                continue
            if src.dtype == dtype:  # the bytes the diff compares, as they are
                n = nbytes // 2
                runs, run = sample_runs(n)
                changed += native.sample_changed(src.data_ptr(), sptr + off, n, 2, runs, run) / (runs * run) * n
                sampled += n
                continue
            es = torch.empty(0, dtype=dtype).element_size()
            if es % 2:  # (one-byte wire elements come packed already: see MeshPublisher)
                continue
            flat, n = src.view(-1), nbytes // es
            old = snap[off : off + nbytes].view(dtype)
            runs, run = sample_runs(n)
            hit = looked = 0  # in units, as the diff counts them (es // 2 a wire element)
            for j in range(runs):  # the cast of each run, as packing casts it
                a = (n - run) * j // max(1, runs - 1)
                fresh = flat[a : a + run].to(dtype).view(torch.int16)
                hit += int(fresh.ne(old[a : a + run].view(torch.int16)).sum())
                looked += fresh.numel()
            changed += hit / looked * (nbytes // 2)
            sampled += nbytes // 2
        return changed / sampled if sampled else None

    def pack(self, snap: torch.Tensor, sources: Mapping[str, torch.Tensor], version: int, base: int | None
             ) -> Change | None:
        """Copies every shard into ``snap`` (cast to its wire dtype); with a ``base`` (the
        version ``snap`` holds), records the change against it. Runs in a worker thread.

        Returns:
            The change, or None: no base, or more than ``crossover`` changed (``snap`` is
            complete either way).
        """
        t0 = time.perf_counter()
        self.last_density = None
        if base is None or self.why_not is not None:
            self._copy(snap, sources)
            self.last_s = time.perf_counter() - t0
            return None
        # Contiguous groups of the shards (so their changes stay in snapshot order), one per copy
        # thread, each recording into its own part of the buffers, sized by its units at the
        # crossover (a group past it sends the version dense, even when the whole is not).
        caps = [int(self.crossover * units) + 1024 for _, units in self._groups]
        starts = [sum(caps[:g]) for g in range(len(caps))]
        if self._positions.numel() < sum(caps):
            self._positions = torch.empty(sum(caps), dtype=torch.int64)
            self._old = torch.empty(sum(caps), dtype=torch.int16)
        counts = [0] * len(caps)
        sptr, pptr, optr = snap.data_ptr(), self._positions.data_ptr(), self._old.data_ptr()
        batch = HostCopies()
        for g, (members, _) in enumerate(self._groups):

            def work(g: int = g, members: list[tuple[str, torch.dtype]] = members) -> None:
                counts[g] = self._diff(g, sptr, sources, members, pptr + 8 * starts[g], optr + 2 * starts[g], caps[g])

            batch.add(sum(self._offsets[name][1] for name, _ in members), work)
        batch.run(self._threads)
        self.last_s = time.perf_counter() - t0
        self.last_density = sum(counts) / max(1, self.total_units)
        if any(c > cap for c, cap in zip(counts, caps, strict=True)) or sum(counts) > self.crossover * self.total_units:
            return None
        spans = list(zip(starts, counts, strict=True))
        units = np.concatenate([self._positions[a : a + c].numpy() for a, c in spans]) // 2
        units = units.view(np.uint64)  # a new array (the buffer is reused)
        old = np.concatenate([self._old[a : a + c].numpy().view(np.uint16) for a, c in spans])
        new = snap.view(torch.int16).numpy().view(np.uint16)[units]
        return Change(version, base, units, old, new, self.total_units)

    def _split(self) -> list[tuple[list[tuple[str, torch.dtype]], int]]:
        """The shards cut into contiguous groups of about equal bytes, one per copy thread, each
        with its units."""
        total = sum(nbytes for _, nbytes in self._offsets.values())
        k = max(1, min(self._threads, len(self._packed)))
        groups: list[list[tuple[str, torch.dtype]]] = [[] for _ in range(k)]
        done = 0
        for name, _, dtype in self._packed:
            groups[min(k - 1, done * k // max(1, total))].append((name, dtype))
            done += self._offsets[name][1]
        return [(members, sum(self._offsets[name][1] // 2 for name, _ in members)) for members in groups if members]

    def _diff(self, g: int, sptr: int, sources: Mapping[str, torch.Tensor],
              members: Sequence[tuple[str, torch.dtype]], pptr: int, optr: int, cap: int) -> int:
        """Packs and diffs group ``g`` of the shards in place; records up to ``cap`` changes."""
        count = 0
        for name, dtype in members:
            off, nbytes = self._offsets[name]
            src = sources[name].detach()
            at = min(count, cap)  # past the cap only the count goes on
            if src.dtype == torch.float32 and dtype == torch.bfloat16 and src.is_contiguous() and not src.is_cuda:
                # fp32 master weights published as bf16: cast in the diff's own pass
                count += native.diff_bf16_in_place(src.data_ptr(), sptr + off, nbytes // 2, off, pptr + 8 * at,
                                                   optr + 2 * at, cap - at)
                continue
            if src.dtype != dtype or not src.is_contiguous():  # cast into the group's kept buffer
                buf = self._cast[g]
                if buf is None or buf.numel() < nbytes:
                    buf = self._cast[g] = torch.empty(max(self._offsets[m][1] for m, _ in members), dtype=torch.uint8)
                src = buf[:nbytes].view(dtype).view(src.shape).copy_(src)
            count += native.diff_in_place(src.data_ptr(), sptr + off, nbytes // 2, 2, off, pptr + 8 * at,
                                          optr + 2 * at, cap - at)
        return count

    def _copy(self, snap: torch.Tensor, sources: Mapping[str, torch.Tensor]) -> None:
        for name, shape, dtype in self._packed:
            off, nbytes = self._offsets[name]
            snap[off : off + nbytes].view(dtype).view(shape).copy_(sources[name].detach())


@dataclass
class Runs:
    """One generator rank's byte runs from this trainer rank, ready to cut a change along:
    ``(snapshot offset, slot offset, nbytes)`` sorted by snapshot offset, and a fingerprint
    (generator ranks of the same layout share it, and so the cut and the checksum)."""

    rows: np.ndarray
    fingerprint: bytes
    why_not: str | None  # why deltas cannot be cut along these runs

    @classmethod
    def of(cls, runs: np.ndarray) -> Runs:
        rows = runs[np.argsort(runs[:, 0], kind="stable")] if len(runs) else runs.reshape(-1, 3)
        why = None
        if len(rows) and bool((rows & 1).any()):
            why = "a run of an odd byte offset or size"
        elif len(rows) > 1 and bool((rows[1:, 0] < rows[:-1, 0] + rows[:-1, 2]).any()):
            why = "snapshot bytes sent twice to one rank"
        return cls(np.ascontiguousarray(rows, dtype=np.int64), hashlib.blake2b(rows.tobytes(), digest_size=16).digest(),
                   why)

    @property
    def nbytes(self) -> int:
        """The bytes these runs carry (the rank's slices from this trainer rank)."""
        return int(self.rows[:, 2].sum())

    def checksum(self, snap: torch.Tensor) -> int:
        """The checksum of these runs' bytes in ``snap``, units indexed by slot position (what
        the generator rank computes over the same bytes in its slot)."""
        return native.checksum_runs(snap.data_ptr(), self.rows.ctypes.data, len(self.rows), 0, 1) & MASK64


@dataclass
class Cut:
    """A change cut along one generator rank's runs: its payload (header first), checksum and
    changed units."""

    payload: torch.Tensor  # uint8: header + values + positions
    new_sum: int
    count: int


def cut(change: Change, runs: Runs, base_sum: int, cap: int) -> Cut | None:
    """The part of ``change`` that lands in ``runs``, as the payload of a delta area (None: it
    does not fit ``cap`` bytes)."""
    total = len(change.units)
    units = np.empty(total, dtype=np.uint64)
    old = np.empty(total, dtype=np.uint16)
    new = np.empty(total, dtype=np.uint16)
    count = native.cut_runs(change.units.ctypes.data, change.old.ctypes.data, change.new.ctypes.data, total,
                            runs.rows.ctypes.data, len(runs.rows), units.ctypes.data, old.ctypes.data, new.ctypes.data)
    units, old, new = units[:count], old[:count], new[:count]
    if count > 1 and not bool((units[1:] > units[:-1]).all()):  # runs land in another order in the slot
        order = np.argsort(units, kind="stable")
        units, old, new = units[order], old[order], new[order]
    vbytes = -(-2 * count // 8) * 8
    if vbytes > cap:
        return None
    out = torch.empty(HEAD_BYTES + cap, dtype=torch.uint8)
    buf = out.numpy()
    buf[HEAD_BYTES : HEAD_BYTES + 2 * count] = new.view(np.uint8)
    buf[HEAD_BYTES + 2 * count : HEAD_BYTES + vbytes] = 0
    pos = np.ascontiguousarray(units)
    pos_bytes = native.encode_positions(pos.ctypes.data, count, out.data_ptr() + HEAD_BYTES + vbytes, cap - vbytes)
    if pos_bytes is None:
        return None
    old, new = np.ascontiguousarray(old), np.ascontiguousarray(new)
    new_sum = (base_sum - native.terms(old.ctypes.data, pos.ctypes.data, count, 2)
               + native.terms(new.ctypes.data, pos.ctypes.data, count, 2)) & MASK64
    payload_bytes = vbytes + pos_bytes
    head = out[:HEAD_BYTES].view(torch.int64)
    head[:] = torch.tensor([MESH_MAGIC, change.version, change.base, signed(base_sum), signed(new_sum), count,
                            pos_bytes, payload_bytes])
    return Cut(out[: HEAD_BYTES + payload_bytes], new_sum, count)


# -- the generator's side ---------------------------------------------------------------------


class Materializer:
    """A generator rank's delta areas (one per slot) and the checked apply of the payloads
    waiting there into the slot.

    Args:
        slots: the rank's two slots; areas: its two delta areas.
        table: trainer rank -> (offset, cap) in each area.
        runs: trainer rank -> its byte runs into this rank (``(snapshot, slot, nbytes)``).
    """

    def __init__(self, slots: Sequence[torch.Tensor], areas: Sequence[torch.Tensor],
                 table: Mapping[int, tuple[int, int]], runs: Mapping[int, np.ndarray]) -> None:
        self.slots, self.areas, self.table = slots, areas, dict(table)
        self.runs = {t: np.ascontiguousarray(r, dtype=np.int64) for t, r in runs.items()}
        self.applied_units = 0  # units written by the last materialize
        self.sources_delta = 0  # trainer ranks whose delta it applied
        # (slot, trainer rank) -> (version, checksum of its runs there), as this rank made them
        # by a checked delta: the base check of the next delta into that slot reads nothing
        # when it names that version. Any other base is checked by reading the slot.
        self.known: dict[tuple[int, int], tuple[int, int]] = {}
        self.full_checks = 0  # base checks that read the trainer rank's runs in the slot
        self._threads = available_threads()
        # Grown only as deltas need: a patch per trainer rank.
        self._scratch = Scratch.for_deltas(slots[0].numel(), max(1, len(self.runs)))

    def clear(self, slot: int) -> None:
        """Forgets every payload waiting for ``slot`` (its bytes were just written whole)."""
        area = self.areas[slot]
        for off, _ in self.table.values():
            area[off : off + 8].zero_()
        self.known = {k: v for k, v in self.known.items() if k[0] != slot}

    def materialize(self, version: int, slot: int) -> int:
        """Applies every trainer rank's payload for ``version`` waiting for ``slot``, all of
        them or none (trainer ranks that sent their bytes dense have none).

        Returns:
            How many trainer ranks' deltas were applied.

        Raises:
            DeltaRefusedError: a payload does not apply (the slot does not hold its base, or it
                fails a bounds or integrity check); nothing was written.
        """
        buf, area = self.slots[slot], self.areas[slot]
        units = buf.numel() // 2
        patches: list[Patch] = []
        payloads: list[torch.Tensor] = []  # (kept alive until applied)
        ranks: list[int] = []  # the trainer rank of each patch
        for t, (off, cap) in sorted(self.table.items()):
            head = area[off : off + HEAD_BYTES].view(torch.int64).clone()  # a peer's words: one private copy
            if int(head[0]) != MESH_MAGIC or int(head[1]) != version:
                continue
            base, base_sum, new_sum = int(head[2]), unsigned(int(head[3])), unsigned(int(head[4]))
            count, pos_bytes, payload_bytes = int(head[5]), int(head[6]), int(head[7])
            if not (0 < payload_bytes <= cap and 0 <= pos_bytes <= payload_bytes and 0 < count <= units):
                raise DeltaRefusedError(f"trainer rank {t}: a payload of {payload_bytes} bytes / {count} units does "
                                        f"not fit its {cap}-byte area")
            runs = self.runs.get(t)
            if runs is None:
                raise DeltaRefusedError(f"trainer rank {t} sent a delta, yet it feeds this rank nothing")
            cached = self.known.get((slot, t))
            if cached is not None and cached[0] == base:
                held = cached[1]
            else:
                held = native.checksum_runs(buf.data_ptr(), runs.ctypes.data, len(runs), 1, 1) & MASK64
                self.full_checks += 1
            if held != base_sum:
                raise DeltaRefusedError(f"trainer rank {t}: slot {slot} does not hold version {base}, the base of "
                                        f"version {version} (checksum {held:#x}, the delta expects {base_sum:#x})")
            ranks.append(t)
            payloads.append(area[off + HEAD_BYTES : off + HEAD_BYTES + payload_bytes].clone())
            patches.append(Patch(f"trainer rank {t} (version {version})", buf.data_ptr(), units, 2,
                                 payloads[-1].data_ptr(), payload_bytes, pos_bytes, Kind.VARINT, count, held, new_sum,
                                 what="slot"))
        # Positions are units of the slot: each trainer rank's checksum is over its own runs there.
        apply_patches(patches, self._threads, self._scratch)
        self.applied_units = sum(p.count for p in patches)
        self.sources_delta = len(patches)
        self.clear(slot)  # (forgets what was known of the slot: the dense sources' bytes are new)
        for t, p in zip(ranks, patches, strict=True):
            self.known[(slot, t)] = (version, p.new_sum)
        return len(patches)
