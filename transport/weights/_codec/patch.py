"""The one checked, all-or-nothing apply of sparse deltas, for both forms (:func:`apply_patches`):
a stream subscriber's tensors (:mod:`.apply`) and a mesh generator rank's slot (:mod:`.runs`)
each describe their deltas as :class:`Patch` es and hand them here.

Each patch names memory that holds exactly its base (the caller checked the base checksum) and
the checksum that memory must have after. The patches that fit the scratch are checked and
stored in one pass (each value read once: what is stored is what the checksum verifies), with
the values they replace saved so that every store is undone if any patch fails; the others are
checked first without storing (the payload, and the values it replaces unless the sender gave
their checksum terms), and stored only once every patch passed. No I/O: the payloads are in
local memory (a slot, a delta area).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..._errors import DeltaRefusedError
from ..._native import delta as native
from .._copy import HostCopies, SharedRows
from .format import MASK64, SPARSE_MAX, Kind

log = logging.getLogger(__name__)

# The least scratch a consumer keeps for its one-pass applies (see Scratch).
SCRATCH_MIN = 16 << 20


@dataclass(frozen=True)
class Patch:
    """One sparse delta to apply.

    Attributes:
        name: what an error names (a tensor's name quoted, a trainer rank).
        dst: the address of the memory it patches: ``numel`` elements of ``es`` bytes.
        numel: elements there.
        es: element size (2 or 4).
        payload: the address of the payload (values, padding to 8, positions).
        payload_bytes: its size.
        pos_bytes: the size of its positions.
        kind: how the positions (and values) are written (VARINT, BITMASK or VARSTEP).
        count: the changed elements.
        held: the checksum of the memory at ``dst`` now (the base's).
        new_sum: the checksum it must have once patched.
        old_terms: the checksum terms of the base values at its positions, when its sender
            says (the stream form's header does): a patch checked first then reads only its
            payload, not the memory at its positions (a cache miss a change). None: they are
            read there.
        what: what it patches, for errors ("tensor", "slot").
    """

    name: str
    dst: int
    numel: int
    es: int
    payload: int
    payload_bytes: int
    pos_bytes: int
    kind: Kind
    count: int
    held: int
    new_sum: int
    old_terms: int | None = None
    what: str = "tensor"

    @property
    def scratch_bytes(self) -> int:
        """The scratch of a one-pass apply: its positions, then the values it replaces."""
        return _align8(self.pos_bytes) + _align8(self.count * self.es)

    @property
    def cost(self) -> int:
        """What it weighs for the copy threads, in bytes of memory traffic: a cache line a
        change, up to the memory it patches."""
        return min(self.count * 64, self.numel * self.es)

    def patched(self, old: int, new: int) -> bool:
        """Whether the memory, its terms ``old`` at the positions replaced by ``new``, has the
        checksum the patch promises."""
        return (self.held - old + new) & MASK64 == self.new_sum


class Scratch:
    """Private bytes of the one-pass applies, kept between versions: per patch, a copy of its
    positions (the payload's owner may rewrite its own) and the values its stores replace.
    :meth:`ready` allocates ``ready_bytes`` ahead and writes them once; an apply that needs more
    grows it, up to ``max_bytes``, and it stays that large (its high-water mark: at most what
    the largest delta applied needed, no more than its payload). Patches past ``max_bytes`` are
    checked first instead: a second pass over their memory, on one thread per patch, after the
    one-pass applies (the 46 MB embedding of the benchmarks' 100M model at 13% changed cost
    18-25 ms to check and 15-18 ms to store so, of an apply of 70-78 ms).

    Args:
        max_bytes: the most it holds.
        ready_bytes: what :meth:`ready` allocates (default: ``max_bytes``).
    """

    def __init__(self, max_bytes: int, ready_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.ready_bytes = max_bytes if ready_bytes is None else min(ready_bytes, max_bytes)
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._lock = threading.Lock()  # ready() may run on a background thread

    @classmethod
    def for_deltas(cls, total: int, patches: int, least: int = SCRATCH_MIN) -> Scratch:
        """The scratch of the applies into ``total`` bytes of memory, in at most ``patches``
        patches a version, of deltas made by this codec (each payload at most ``SPARSE_MAX`` of
        its tensor, and a patch's scratch at most its payload plus alignment): every one of
        those applies in one pass. An eighth of ``total`` (at least ``least``) is readied ahead:
        a delta of a few percent, where deltas pay most."""
        eighth = max(least, total // 8)
        return cls(max(eighth, int(total * SPARSE_MAX) + 16 * patches), eighth)

    def ready(self) -> None:
        """Allocates ``ready_bytes`` and writes every page once (the first apply would
        otherwise fault its pages in as it stores: 25 MB for the 100M model of the
        benchmarks). Safe beside :func:`apply_patches`, from any thread."""
        with self._lock:
            if self._buf.numel() >= self.ready_bytes:
                return
        buf = torch.zeros(self.ready_bytes, dtype=torch.uint8)
        with self._lock:
            if self._buf.numel() < buf.numel():
                self._buf = buf

    def take(self, need: int) -> torch.Tensor:
        """At least ``need`` bytes (at most ``max_bytes``), kept alive by the caller for its
        pass; grown to exactly ``need`` when smaller."""
        with self._lock:
            if self._buf.numel() < need:
                self._buf = torch.empty(need, dtype=torch.uint8)
            return self._buf


def apply_patches(patches: Sequence[Patch], threads: int, scratch: Scratch) -> None:
    """Applies every patch, across ``threads`` copy threads, or none.

    Raises:
        DeltaRefusedError: a payload fails a bounds or integrity check, or a patched memory
            would not have its new checksum; every memory is as it was.
    """
    if overlapping((p.dst, p.dst + p.numel * p.es) for p in patches):
        # Patches of one memory (a mesh slot that every trainer rank patches; tied tensors)
        # go one after the other, in order, and are undone in the reverse order: a store never
        # races another, and every value saved is restored last-in first-out.
        threads = 1
    one_pass: list[tuple[Patch, int]] = []
    checked_first: list[Patch] = []
    need = 0
    for p in patches:
        if need + p.scratch_bytes <= scratch.max_bytes:
            one_pass.append((p, need))
            need += p.scratch_bytes
        else:
            checked_first.append(p)
    _check(checked_first, threads)
    _apply_one_pass(one_pass, need, threads, scratch)
    # Every check passed: store. Only the payload's owner scribbling over it now could make a
    # store fail, and the native scatter keeps even that inside the patched memory.
    batch = HostCopies()
    for p in checked_first:

        def store(p: Patch = p) -> None:
            refusal, _, _ = native.scatter(p.dst, p.numel, p.es, p.payload, p.payload_bytes, int(p.kind), p.count,
                                           p.pos_bytes, True)
            if refusal != native.Refusal.OK:
                log.error("delta of %s changed under its apply (%s): it is partly written", p.name, refusal.name)

        batch.add(p.cost, store)
    batch.run(threads)


def _check(patches: Sequence[Patch], threads: int) -> None:
    """Checks ``patches`` without storing: O(changed), the payload (and the values it replaces
    where the patch does not give their terms: the memory holds the base, its checksum is
    ``held``, so the base values' terms are what the sender says they are or it fails).

    Raises:
        DeltaRefusedError: one fails.
    """
    verdicts: list[tuple[native.Refusal, int, int]] = [(native.Refusal.OK, 0, 0)] * len(patches)
    batch = HostCopies()
    for j, p in enumerate(patches):

        def check(j: int = j, p: Patch = p) -> None:
            # (0: only the payload is read; steps are new values only with the ones they replace)
            dst = p.dst if p.old_terms is None or p.kind == Kind.VARSTEP else 0
            verdicts[j] = native.scatter(dst, p.numel, p.es, p.payload, p.payload_bytes, int(p.kind), p.count,
                                         p.pos_bytes, False)

        batch.add(p.cost, check)
    batch.run(threads)
    for p, (refusal, old, new) in zip(patches, verdicts, strict=True):
        if refusal != native.Refusal.OK:
            raise DeltaRefusedError(f"{p.name}: payload refused ({refusal.name})")
        if not p.patched(old if p.old_terms is None else p.old_terms, new):
            raise DeltaRefusedError(f"{p.name}: the patched {p.what} would not have the new checksum")


def _apply_one_pass(work: Sequence[tuple[Patch, int]], need: int, threads: int, scratch: Scratch) -> None:
    """Checks and stores each of ``work`` (a patch and its scratch offset) in one pass across
    the copy threads, then verifies each patched memory's checksum; undoes every store made if
    one fails (last patch first).

    Raises:
        DeltaRefusedError: a patch fails; every memory is as it was.
    """
    if not work:
        return
    buf = scratch.take(need)  # (kept alive for this pass whatever a background ready() sets)
    base = buf.data_ptr()
    # Each row: the patch, its positions copied from the payload's end to its scratch, the values
    # its stores replace saved after them. Costliest first (HostCopies' order before).
    order = sorted(range(len(work)), key=lambda j: -work[j][0].cost)
    rows = np.array([(p.dst, p.numel, p.es, p.payload, p.payload_bytes, int(p.kind), p.count, p.pos_bytes, base + at,
                      base + at + _align8(p.pos_bytes)) for p, at in (work[j] for j in order)], dtype=np.uint64)
    results = np.zeros((len(work), native.APPLY_RESULT), dtype=np.uint64)
    batch = HostCopies()
    SharedRows(lambda cursor, taken: native.apply_many(rows, results, cursor, taken), len(work),
               sum(p.cost for p, _ in work)).add_to(batch, threads)
    batch.run(threads)
    done: list[tuple[native.Refusal, int, int, int]] = [(native.Refusal.OK, 0, 0, 0)] * len(work)
    for t, j in enumerate(order):
        refusal, old, new, stored = (int(x) for x in results[t])
        done[j] = (native.Refusal(refusal), old, new, stored)
    why = None
    for (p, _), (refusal, old, new, _stored) in zip(work, done, strict=True):
        if refusal != native.Refusal.OK:
            why = f"{p.name}: payload refused ({refusal.name})"
        elif not p.patched(old, new) or (p.old_terms is not None and old != p.old_terms):
            # (given terms that are not those of the values replaced: refused in every mode)
            why = f"{p.name}: the patched {p.what} does not have the new checksum"
        if why is not None:
            break
    if why is None:
        return
    for (p, at), (_, _, _, stored) in reversed(list(zip(work, done, strict=True))):
        if stored:
            native.undo(p.dst, p.numel, p.es, int(p.kind), base + at, p.pos_bytes, stored,
                        base + at + _align8(p.pos_bytes))
    raise DeltaRefusedError(why)


def overlapping(spans: Iterable[tuple[int, int]]) -> bool:
    """Whether two of the address ranges ``spans`` (``[start, end)``) overlap."""
    return any(b[0] < a[1] for a, b in itertools.pairwise(sorted(spans)))


def _align8(n: int) -> int:
    return (n + 7) & ~7
