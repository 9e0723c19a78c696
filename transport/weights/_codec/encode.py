"""Delta sync of a stream: a version sent as the new values of the changed elements only.

The publisher diffs each tensor of the new version against its previous snapshot (the *base*) in
one native pass that reads both and writes only the encoding (:class:`DeltaEncoder`), and chooses
per tensor by measured density: unchanged (nothing sent), sparse (new values plus positions, as
LEB128 gaps or a bitmask, whichever is smaller, at most ``SPARSE_MAX`` of the dense bytes; the
bitmask alone where the tensor's sample changed more than ``VARINT_MAX``; with LEB128 gaps,
2-byte values as VARSTEP steps where that is smaller) or dense. A
subscriber receives a delta only when its control block says it applied exactly the base and
has nothing newer pending; everyone else gets the dense version. The new snapshot is
brought to the version after the pushes, off the subscribers' path: it holds the version before
the base, so the base's encodings and this version's are scattered into it (O(changed), what the
diff touches anyway), or, for a tensor that changed too much for that to pay, it is copied.

A delta lands in the subscriber's slot like a dense version: a sparse tensor's encoding lies in
the tensor's own byte range of the slot (it is smaller), dense tensors at their place; beside
the slot, an *index* region holds the header: magic, version, base version and, per tensor of
the layout, ``(kind, changed, position bytes, payload bytes, base checksum, new checksum, base
terms)``, the last being the checksum terms of the base values at the changed positions.

Each change travels as its new value or, in the VARSTEP form (2-byte elements), as the signed
byte ``new - base`` of the bit patterns, the new value itself where that does not fit (an
optimizer step moves 80-90% of the changed bf16 weights by one ulp, 99.8% by at most 127: a
change then costs 1 + ~1 bytes instead of 2 + ~1). Either way the apply is bit-exact, and a
step is only ever added to memory whose checksum says it holds the base. The checksum
(:func:`transport._native.delta.checksum`: a position-mixed sum, mod 2**64, of each tensor's raw
bits) lets the subscriber check, before it writes anything, that every tensor it holds is the
base the delta was made against (its cached checksums; O(tensors)), and that every touched
tensor becomes exactly the new version: its checksum less the terms of the values replaced plus
those of the values stored must be the new checksum (O(changed elements)), which catches a
corrupted value or position. The subscriber checks and stores a tensor in one pass whose stores
it undoes when a check fails (or, past its scratch, checks the payload alone before storing). A
delta that fails any check is refused whole: the live weights stay on their version (see
:class:`.apply.DeltaApplier`).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ... import _tensor_kernels
from ..._errors import TransportInternalError
from ..._native import delta as native
from ..._tensors import dtype_from_name
from .._copy import STREAM_MIN_BYTES, HostCopies, SharedRows
from .._layout import ALIGN, Entry, Layout
from .checksum import SumPass, deltable
from .format import MASK64, SPARSE_KINDS, SPARSE_MAX, STREAM_MAGIC, Kind, signed
from .parts import Part, Parts, Source
from .policy import CROSSOVER

PREDICT_DENSE = 0.5  # a version whose sampled delta exceeds this fraction of dense goes dense undiffed
SAMPLE_BLOCKS, SAMPLE_RUN = 16, 1024  # the sample of one tensor: runs of elements spread over it


def sample_runs(n: int) -> tuple[int, int]:
    """How a tensor of ``n`` elements is sampled: (runs, elements a run), the whole tensor as
    one run when it is small."""
    return (1, n) if n <= SAMPLE_BLOCKS * SAMPLE_RUN * 4 else (SAMPLE_BLOCKS, SAMPLE_RUN)


# A snapshot tensor is patched with two versions' encodings (rather than copied from the live
# tensors) while they change at most this fraction of it together. The patches run after the
# publish returns, the copies before (they read the live tensors), so this lies past where a
# scatter stops being cheaper than a streaming copy (on this VM one scatter costs 0.8-1.0x a
# copy at 1-5% of bf16, 1.3x at 10%): at lr 1e-6 a publish returns 13-25 ms sooner
# (benchmarks/results/delta_sync-2026-12-03-b-tcp-10gbit.md).
PATCH_MAX = 0.10
# A tensor whose sample changed more than this fraction is diffed with its positions as a bitmask
# alone: no varints are made. Varints take about a byte a change, the bitmask n / 8 bytes, so
# above 10% the bitmask is at most a quarter larger (at 11% changed: 1.5 MB more for 199 MB of
# bf16, 1.2 ms at 10 Gbit/s), and its apply goes a vector at a time on AVX-512. Making the
# varints cost the diff of the 100M model (199 MB, 2 threads of the 2-core VM, back to back)
# 5-11%: 18.1 -> 17.2 ms at 11% changed and 19.8 -> 18.2 ms at 13% with AVX-512, 22.7 -> 20.1
# and 23.5 -> 21.8 ms with AVX2 (at 13% the bitmask was the smaller form already).
VARINT_MAX = 0.10
Sparse = tuple[int, int, int, int, Kind]  # (offset, payload bytes, changed, position bytes, kind) of an encoding


def _cap(e: Entry) -> int:
    return int(e.nbytes * SPARSE_MAX) // ALIGN * ALIGN


@dataclass
class DeltaVersion:
    """One version as the encoder made it: per entry kind and sizes, the header, the runs
    that carry it, and what it weighs against dense."""

    version: int
    base: int | None  # None: no base (first version, no checksums): dense only
    kinds: list[Kind]
    changed: int = 0  # elements that differ from the base, over the deltable tensors
    elements: int = 0  # elements of the deltable tensors
    header: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    runs: Part = field(default_factory=list)  # every run of the version, per source (its parts together)
    wire_bytes: int = 0  # bytes a delta push moves (header included)
    encode_s: float = 0.0  # the diff + encode pass (and the copies the pushes need from the snapshot)
    # entry -> (offset in the staging buffer, payload bytes, changed, position bytes, kind): the sparse ones
    sparse: dict[int, Sparse] = field(default_factory=dict)
    unfilled: list[int] = field(default_factory=list)  # deltable entries not yet in the new snapshot
    held: int | None = None  # the version the new snapshot held before (None: unknown or torn)
    plan: tuple[list[int], list[tuple[int, list[tuple[int, Sparse]]]]] | None = None  # (copies, patches)
    copied: bool = False  # the copies of the fill are done
    patched: bool = False  # and its patches

    @property
    def is_delta(self) -> bool:
        """Whether any subscriber holding the base gets less than the dense version."""
        return self.base is not None and any(k != Kind.DENSE for k in self.kinds)

    @property
    def density(self) -> float:
        """Changed elements over the deltable elements (1.0 without a base)."""
        return self.changed / self.elements if self.elements and self.base is not None else 1.0


@dataclass
class _Payloads:
    """One published delta's sparse encodings, kept (compacted) to patch the other snapshot
    with at the next version: ``base`` -> ``version``."""

    base: int
    version: int
    buf: torch.Tensor
    sparse: dict[int, Sparse]  # entry -> (offset in buf, payload bytes, changed, pos bytes, kind)
    unchanged: frozenset[int]


class DeltaEncoder:
    """The publisher's side: diffs and encodes each version against the front snapshot, brings
    the other snapshot to the version after the pushes, and keeps the per-tensor checksums of
    both snapshots (the next version's base checksums).

    Args:
        layout: the stream's packed layout.
        wire: the live tensors by wire name (host tensors).
        threads: copy threads the pass may use.
        crossover: the changed fraction above which a tensor goes dense.
        packed: the entries (names) whose bytes in a new snapshot the publisher writes itself
            before :meth:`fill_patches` (its pack of the buckets that cannot go straight).
            Their deltas go as values, never as steps: a step is added to the value it
            replaces, and patched over bytes that already hold the version it would be added
            twice (values patched over them are harmless).
    """

    def __init__(self, layout: Layout, wire: Mapping[str, torch.Tensor], threads: int,
                 crossover: float = CROSSOVER, packed: Collection[str] = ()) -> None:
        self.layout = layout
        self._steps = [int(deltable(e) and dtype_from_name(e.wire_dtype).itemsize == 2 and e.name not in packed)
                       for e in layout.entries]  # per entry: whether its deltas may go as steps
        self.crossover = crossover
        self._wire = wire
        self._threads = threads
        self._prev: _Payloads | None = None  # the last delta's encodings, to patch with
        self._prev_buf = torch.empty(0, dtype=torch.uint8)
        self.filled = (0, 0)  # the last fill's (tensors patched, tensors copied)
        self._offsets: list[int] = []  # entry -> its payload's offset in the staging buffer
        pos = 0
        for e in layout.entries:
            self._offsets.append(pos)
            pos += _cap(e) if deltable(e) else 0
        self.staging_bytes = pos
        # Where each deltable entry's encoding may lie in the staging buffer and the slot.
        self._staging_window = np.array([(o, e.offset, _cap(e)) for o, e in zip(self._offsets, layout.entries,
                                                                                 strict=True)
                                         if deltable(e) and _cap(e)], dtype=np.int64).reshape(-1, 3)
        self._staging: torch.Tensor | None = None  # set once, never replaced (encodings point into it)
        self._staging_source: Source | None = None  # the same, as the pushes send from it
        self._staging_lock = threading.Lock()
        self.sample_s = 0.0  # the last predicts_dense
        # The last sample: the base it was taken against (its address) and, per entry, the
        # fraction of its sample that changed.
        self._sampled: tuple[int, dict[int, float]] = (0, {})
        self._sums: dict[int, tuple[int, list[int]]] = {}  # snapshot slot -> (version, checksums)

    def base_of(self, slot: int, version: int | None) -> int | None:
        """``version`` when snapshot ``slot`` holds it and its checksums are known, else None."""
        held = self._sums.get(slot)
        return version if held is not None and version is not None and held[0] == version else None

    def encode(self, snap: torch.Tensor, slot: int, base: torch.Tensor | None, base_version: int | None,
               base_slot: int | None, version: int, ready: Callable[[Part], None] | None = None,
               parts: int = 1) -> tuple[DeltaVersion, list[int]]:
        """Diffs every deltable tensor against ``base`` (the previous snapshot, holding
        ``base_version``), reading both and writing only the sparse encodings (into the staging
        buffer); writes into ``snap`` (snapshot ``slot``, the new one) only what a delta push
        sends from it: the tensors that go dense and those that always travel dense.
        :meth:`fill_copies` and :meth:`fill_patches` write the rest, after the pushes or before
        the first dense one (which sends packed buckets from the snapshot). Runs in a worker
        thread.

        Args:
            ready: with a base, called (from the copy threads, one call at a time) with the
                runs (:data:`Part`: from the staging buffer and from ``snap``, each source
                with the same :class:`Source` every time) of tensors whose diff is done, once
                about 1/``parts`` of the version was diffed since the last call, and last with
                what remains: a push can send them while the rest is diffed. When every tensor
                went dense (the version is no delta: pushes send it whole), what remains is
                kept back, and with ``parts`` 1 nothing is handed out. The same runs end up in
                the returned version's ``runs``. What it raises ends the pass and is raised
                here.
            parts: see ``ready`` (1: one call, once every tensor is done).

        Returns:
            The version as a :class:`DeltaVersion`, and the new snapshot's checksums (keep
            them with :meth:`commit` once the snapshot is filled).
        """
        t0 = time.perf_counter()
        held = self._sums.pop(slot, None)  # being rewritten: torn until fill() ends
        entries = self.layout.entries
        if base is not None and self._staging is None:
            self._set_staging(torch.empty(max(1, self.staging_bytes), dtype=torch.uint8))
        staging, from_staging = self._staging, self._staging_source
        from_snap = Source(snap, np.array([[0, 0, self.layout.total]], dtype=np.int64))
        results: list[native.Encoded | None] = [None] * len(entries)
        kinds: list[Kind] = [Kind.DENSE] * len(entries)
        keep: list[torch.Tensor] = []  # contiguous copies of non-contiguous sources, alive for the pass
        batch = HostCopies()
        sptr, bptr = snap.data_ptr(), 0 if base is None else base.data_ptr()
        every = -(-self.layout.total // parts) if parts > 1 else None
        out = Parts(ready if base is not None else None, every)
        deltas: list[int] = []  # the deltable entries, as their rows
        # Each tensor's sampled change, where the last sample was taken against this base (used
        # once: it only picks how positions are written, never what a tensor holds).
        (sampled_ptr, sampled), self._sampled = self._sampled, (0, {})
        if base is None or sampled_ptr != bptr:
            sampled = {}
        rows: list[tuple[int, ...]] = []
        for i, e in enumerate(entries):
            if not deltable(e):
                if e.nbytes:
                    batch.add(e.nbytes, functools.partial(self._pack_other, from_snap, e, out))
                continue
            src = self._wire[e.name]
            if not src.is_contiguous():
                src = src.contiguous()
                keep.append(src)
            deltas.append(i)
            if bptr:
                assert staging is not None
                rows.append((src.data_ptr(), bptr + e.offset, sptr + e.offset, e.numel, src.element_size(),
                             staging.data_ptr() + self._offsets[i], self._budget(e),
                             int(self.crossover * e.numel), int(e.nbytes >= STREAM_MIN_BYTES),
                             int(sampled.get(i, 0.0) <= VARINT_MAX), self._steps[i]))
            else:  # nothing to diff against: the copy and the checksum in one pass
                rows.append((src.data_ptr(), 0, sptr + e.offset, e.numel, src.element_size(), 0, 0, 0, 0, 0, 0))
        if rows:
            # Largest first: the last tensors, the ones a thread may finish alone, are small.
            table = np.array(rows, dtype=np.uint64)
            sizes = (table[:, 3] * table[:, 4]).astype(np.int64)  # bytes of each tensor
            order = np.argsort(-sizes, kind="stable").tolist()
            table = np.ascontiguousarray(table[order])
            found = np.zeros((len(rows), native.ENCODE_RESULT), dtype=np.uint64)
            # With parts, each call returns after about its thread's share of a part, so that the
            # parts go out as the diff runs; else each thread's one call diffs until none is left.
            budget = None if every is None else max(1, every // max(1, self._threads))

            def done(claimed: list[int]) -> None:
                for t in claimed:
                    r = native.encoded(found[t])
                    i = deltas[order[t]]
                    e = entries[i]
                    results[i] = r
                    if not bptr:
                        continue
                    kinds[i] = r.kind
                    if r.kind == Kind.DENSE:  # copied into the new snapshot by the pass: pushed from there
                        out.done(e.nbytes, from_snap, [(e.offset, e.offset, e.nbytes)])
                    else:
                        assert from_staging is not None
                        o = self._offsets[i]
                        out.done(e.nbytes, from_staging, [(o, e.offset, r.payload_bytes)] if r.payload_bytes else [])

            SharedRows(lambda cursor, taken: native.encode_many(table, found, cursor, taken, budget), len(rows),
                       int(sizes.sum())).add_to(batch, self._threads, done)
        batch.run(self._threads)
        out.flush(any(k != Kind.DENSE for k in kinds))
        del keep
        base_sums = self._sums[base_slot][1] if base_slot is not None and base is not None else None
        sums: list[int] = []
        dv = DeltaVersion(version, base_version if base is not None else None, kinds,
                          held=held[0] if held is not None else None)
        # the header, built in Python
        words = [STREAM_MAGIC, version, -1 if dv.base is None else dv.base, len(entries)]
        for i, (e, r) in enumerate(zip(entries, results, strict=True)):
            kind = kinds[i]
            if r is None:
                sums.append(0)
            elif base_sums is None:
                sums.append(r.checksum)
            else:  # only the changes were hashed
                sums.append((base_sums[i] - r.sum_old + r.sum_new) & MASK64)
            if r is not None:
                dv.changed += r.changed
                dv.elements += e.numel
            old = 0 if base_sums is None or r is None else base_sums[i]
            if r is not None and kind in SPARSE_KINDS:
                words += [int(kind), r.changed, r.pos_bytes, r.payload_bytes]
            else:
                words += [int(kind), 0, 0, 0]
            words += [signed(old), signed(sums[-1]), signed(r.sum_old if r is not None else 0)]
            if base is None or r is None:
                continue
            if kind == Kind.DENSE:
                continue  # written into the new snapshot above
            dv.unfilled.append(i)
            if kind != Kind.UNCHANGED and r.payload_bytes:
                dv.sparse[i] = (self._offsets[i], r.payload_bytes, r.changed, r.pos_bytes, kind)
        dv.runs = out.runs()
        dv.header = torch.tensor(words, dtype=torch.int64)
        dv.wire_bytes = sum(int(rows[:, 2].sum()) for _, rows in dv.runs) + len(words) * 8
        dv.encode_s = time.perf_counter() - t0
        return dv, sums

    def _pack_other(self, into: Source, e: Entry, parts: Parts) -> None:
        """Packs an entry that always travels dense (fp8: quantised, with its scale) into the
        snapshot ``into``."""
        snap, src = into.buffer, self._wire[e.name]
        with torch.no_grad():
            if e.scale_offset >= 0:
                q, scale = _tensor_kernels.quantize_fp8(src)
                _tensor_kernels.pack(snap, [q, scale], [e.offset, e.scale_offset])
            else:
                _tensor_kernels.pack(snap, [_tensor_kernels.as_bytes(src.contiguous())], [e.offset])
        end = e.scale_offset + 4 if e.scale_offset >= 0 else e.offset + e.nbytes
        parts.done(e.nbytes, into, [(e.offset, e.offset, end - e.offset)])

    def predicts_dense(self, base: torch.Tensor) -> tuple[bool, int, int]:
        """Whether a delta against snapshot ``base`` would not pay, judged from a sample of
        each tensor (``SAMPLE_BLOCKS`` runs of ``SAMPLE_RUN`` elements spread over it, the whole
        tensor when it is small; a native compare and count): when
        the predicted changed fraction is above the crossover, or the estimated delta is more
        than ``PREDICT_DENSE`` of the dense version, the version
        goes dense without the full diff (as fast as ``delta=False``). Runs in a worker thread.

        The predicted changes are each tensor's sampled fraction times its size: every large
        tensor is sampled alike, so the sample's own count would weigh a 25M-element embedding
        (a few rows changed) as much as a 0.6M-element projection (all rows changed). On the
        benchmark's model after AdamW steps that count read 1.29x the true fraction (24.3%
        for 18.9%, 17.3% for 13.3%), and versions a delta would have halved went dense.

        Returns:
            (dense, the changed elements predicted, the elements of the tensors sampled).
        """
        t0 = time.perf_counter()
        estimate = elements = 0
        predicted = 0.0
        bptr = base.data_ptr()
        sampled: list[tuple[int, Entry]] = []
        rows: list[tuple[int, int, int, int, int, int]] = []  # (fresh, base, n, es, runs, run)
        for i, e in enumerate(self.layout.entries):
            src = self._wire[e.name]
            if not deltable(e) or not src.is_contiguous():
                estimate += e.nbytes
                continue
            n = e.numel
            runs, run = sample_runs(n)
            sampled.append((i, e))
            rows.append((src.data_ptr(), bptr + e.offset, n, src.element_size(), runs, run))
        # Counting only (no output): a native compare and count over each run, every tensor in
        # one call (the GIL taken back once: a call a tensor waited for it beside the event
        # loop's Python).
        counts = native.sample_changed_many(np.array(rows, dtype=np.uint64).reshape(-1, 6))
        fractions: dict[int, float] = {}
        for (i, e), (_, _, n, es, runs, run), changed in zip(sampled, rows, counts.tolist(), strict=True):
            f = fractions[i] = changed / (runs * run)
            predicted += f * n
            elements += n
            sparse = f * n * es + min(2 * f * n, n / 8) + 64  # values + the smaller positions (~2 B a gap)
            estimate += int(min(sparse, e.nbytes)) if sparse <= _cap(e) and f <= self.crossover else e.nbytes
        self._sampled = (bptr, fractions)
        self.sample_s = time.perf_counter() - t0
        changed_total = round(predicted)
        if elements and changed_total > self.crossover * elements:
            return True, changed_total, elements
        return estimate > PREDICT_DENSE * self.layout.total, changed_total, elements

    def _plan(self, dv: DeltaVersion) -> tuple[list[int], list[tuple[int, list[tuple[int, Sparse]]]]]:
        """Splits the tensors :meth:`encode` left out of the new snapshot into those copied from
        the live tensors and those patched: where the snapshot held the version before ``dv``'s
        base, both steps were sparse (or unchanged) there and they changed little, the two
        encodings are scattered into it (O(changed))."""
        if dv.plan is not None:
            return dv.plan
        prev = self._prev
        if prev is not None and not (dv.held is not None and prev.base == dv.held and prev.version == dv.base):
            prev = None  # the snapshot does not hold the base of the encodings we kept
        staging = self._staging
        copies: list[int] = []
        patches: list[tuple[int, list[tuple[int, Sparse]]]] = []
        for i in dv.unfilled:
            steps: list[tuple[int, Sparse]] = []
            if prev is not None and staging is not None and dv.kinds[i] != Kind.DENSE and \
                    (i in prev.sparse or i in prev.unchanged):
                if i in prev.sparse:
                    steps.append((prev.buf.data_ptr(), prev.sparse[i]))
                if i in dv.sparse:
                    steps.append((staging.data_ptr(), dv.sparse[i]))
                if sum(step[1][2] for step in steps) <= PATCH_MAX * self.layout.entries[i].numel:
                    patches.append((i, steps))
                    continue
            copies.append(i)
        dv.plan = (copies, patches)
        self.filled = (len(patches), len(copies))
        return dv.plan

    def copies_left(self, dv: DeltaVersion) -> bool:
        """Whether :meth:`fill_copies` has anything to copy for ``dv`` (plans it first)."""
        return not dv.copied and bool(self._plan(dv)[0])

    def fill_copies(self, snap: torch.Tensor, dv: DeltaVersion) -> None:
        """Copies into ``snap`` the tensors of ``dv`` that are not patched; they are read from
        the live tensors, so this runs before the publish returns. Runs in a worker thread."""
        if dv.copied:
            return
        copies, _ = self._plan(dv)
        batch = HostCopies()
        keep: list[torch.Tensor] = []
        for i in copies:
            e = self.layout.entries[i]
            src = self._wire[e.name]
            if not src.is_contiguous():
                src = src.contiguous()
                keep.append(src)
            batch.add_raw(snap.data_ptr() + e.offset, src.data_ptr(), e.nbytes)
        batch.run(self._threads)
        del keep
        dv.copied = True

    def fill_patches(self, snap: torch.Tensor, dv: DeltaVersion) -> None:
        """Scatters the kept and ``dv``'s encodings into ``snap`` where :meth:`_plan` patches,
        then keeps ``dv``'s encodings (compacted) for the next version. Reads no live tensor
        (it may run after the publish returns), but must end before the next :meth:`encode`.
        Runs in a worker thread.

        Raises:
            TransportInternalError: one of our own encodings failed to apply (a bug).
        """
        if dv.patched:
            return
        _, patches = self._plan(dv)
        batch = HostCopies()
        for i, steps in patches:
            e = self.layout.entries[i]
            batch.add(sum(step[1][2] for step in steps) * 64,
                      functools.partial(self._patch, snap.data_ptr() + e.offset, e, steps))
        batch.run(self._threads)
        self._keep(dv)
        dv.patched = True

    @staticmethod
    def _patch(dst: int, e: Entry, steps: Sequence[tuple[int, Sparse]]) -> None:
        es = dtype_from_name(e.wire_dtype).itemsize
        for buf, (offset, nbytes, changed, pos_bytes, kind) in steps:
            refusal, _, _ = native.scatter(dst, e.numel, es, buf + offset, nbytes, int(kind), changed, pos_bytes, True)
            if refusal != native.Refusal.OK:
                raise TransportInternalError(f"our own delta of {e.name!r} does not apply to the snapshot: "
                                             f"{refusal.name}")

    def _keep(self, dv: DeltaVersion) -> None:
        """Keeps ``dv``'s sparse encodings, compacted, for the next :meth:`fill`."""
        assert dv.base is not None and self._staging is not None
        total = sum(step[1] for step in dv.sparse.values())
        if self._prev_buf.numel() < total:
            self._prev_buf = torch.empty(total + total // 4, dtype=torch.uint8)
        sparse: dict[int, Sparse] = {}
        at = 0
        batch = HostCopies()
        for i, (offset, nbytes, changed, pos_bytes, kind) in dv.sparse.items():
            batch.add_raw(self._prev_buf.data_ptr() + at, self._staging.data_ptr() + offset, nbytes)
            sparse[i] = (at, nbytes, changed, pos_bytes, kind)
            at += nbytes
        batch.run(self._threads)
        unchanged = frozenset(i for i, k in enumerate(dv.kinds) if k == Kind.UNCHANGED)
        self._prev = _Payloads(dv.base, dv.version, self._prev_buf, sparse, unchanged)

    def reserve(self) -> None:
        """Allocates the staging buffer of the encodings and writes every page of it once, ahead
        of the first delta (whose diff would otherwise fault the pages in as it writes: 15 ms
        of a 42 ms first encode at 15% changed on the 100M model), and readies the native
        diff's scratch (positions, bitmask) for each copy thread likewise (1,000-1,900 faults
        of a first diff at 3% changed). Safe beside :meth:`encode`: the buffer is set once,
        whole. Runs in a background thread."""
        if self._staging is not None:
            return
        largest = max((e.numel for e in self.layout.entries if deltable(e)), default=0)
        native.reserve_scratch(self._threads, largest)
        staging = torch.empty(max(1, self.staging_bytes), dtype=torch.uint8)
        staging.fill_(0)
        self._set_staging(staging)

    def _set_staging(self, staging: torch.Tensor) -> None:
        """Sets the staging buffer to ``staging`` unless one is set (it is never replaced:
        encodings, and the pushes' prepared transfers, point into it)."""
        with self._staging_lock:
            if self._staging is None:
                self._staging_source = Source(staging, self._staging_window)
                self._staging = staging

    def learn(self, slot: int, version: int, snap: torch.Tensor, started: SumPass | None = None,
              mirror: int | None = None) -> None:
        """Computes the checksums of snapshot ``slot`` (holding ``version``, filled by a dense
        publish) so the next version can be diffed against it, finishing ``started`` (a pass
        over ``snap`` begun in the background) when given. When ``started`` also copies
        ``snap``'s deltable tensors into snapshot ``mirror``, that snapshot then holds them at
        ``version`` too: the next version patches it with its own encodings alone
        (:meth:`_plan`) rather than copy it from the live tensors. Runs in a worker thread.

        Raises:
            TransportInternalError: ``started`` copies and its background piece did not end.
        """
        sums = [0 if x is None else x for x in (started or SumPass.of_buffer(snap, self.layout.entries))
                .finish(self._threads)]
        self._sums[slot] = (version, sums)
        if started is not None and started.copies and mirror is not None:
            # Its deltable tensors are ``version``'s (its others are rewritten by every encode):
            # from there to ``version`` nothing changes.
            self._sums[mirror] = (version, list(sums))
            self._prev = _Payloads(version, version, self._prev_buf, {},
                                   frozenset(i for i, e in enumerate(self.layout.entries) if deltable(e)))

    def unready_bytes(self, slot: int, version: int, started: SumPass | None) -> tuple[int, int]:
        """What a first delta against snapshot ``slot`` (holding ``version``) still has to do
        before it can diff, as (bytes to checksum, bytes to copy into the other snapshot): none
        when its checksums are known; else what the background pass ``started`` over it (if
        any) has not done, and the whole copy when that pass does not copy."""
        if self.base_of(slot, version) is not None:
            return 0, 0
        total = sum(e.nbytes for e in self.layout.entries if deltable(e))
        left = 1.0 if started is None else started.left
        return int(total * left), int(total * (left if started is not None and started.copies else 1.0))

    def forget(self, slot: int) -> None:
        """Snapshot ``slot`` is being rewritten by a dense publish: its checksums are stale."""
        self._sums.pop(slot, None)

    def _budget(self, e: Entry) -> int:
        """The bytes ``e``'s encoding may take: what fits half its dense bytes, and no more
        than its values and positions at the crossover (the native pass gives up early past it)."""
        es = dtype_from_name(e.wire_dtype).itemsize
        at_crossover = int(self.crossover * e.numel) * (es + 3) + (e.numel + 7) // 8 + ALIGN
        return min(_cap(e), (at_crossover + ALIGN - 1) // ALIGN * ALIGN)

    def commit(self, slot: int, version: int, sums: list[int]) -> None:
        """Records that snapshot ``slot`` holds ``version`` with these checksums."""
        self._sums[slot] = (version, sums)


def delta_isa() -> str:
    """The vector path the native diff takes in this process: ``"avx512"``, ``"avx2"`` or
    ``"scalar"`` (the best this CPU has, or the one ``$TRANSPORT_DELTA_ISA`` forces).

    Raises:
        TransportInternalError: ``$TRANSPORT_DELTA_ISA`` names a path this CPU lacks, or none.
    """
    return native.best_isa()
