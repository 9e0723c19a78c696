"""The subscriber's side of stream delta sync (the format is in :mod:`.format`): the
checksums of the live tensors, and the checked, all-or-nothing apply of a delta from a slot."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ... import _tensor_kernels
from ..._background import start_background
from ..._errors import DeltaRefusedError
from ..._native import delta as native
from ..._tensors import dtype_from_name
from .._copy import HostCopies, copy_bytes
from .._layout import Entry, Layout
from .checksum import PAUSE_S, SumPass, checksums_of, deltable
from .format import ENTRY_WORDS, HEADER_WORDS, MASK64, STREAM_MAGIC, Kind, unsigned

# The least scratch a subscriber keeps for its one-pass applies; at most an eighth of the
# version otherwise (a delta is a few percent of it where deltas pay).
SCRATCH_MIN = 16 << 20

log = logging.getLogger(__name__)


@dataclass
class _Check:
    entry: Entry
    index: int
    kind: Kind
    changed: int
    pos_bytes: int
    payload_bytes: int
    new_sum: int
    old_terms: int


class DeltaApplier:
    """The subscriber's side: the checksums of the live tensors, and the checked apply of a
    delta from a slot.

    Args:
        layout: the publisher's layout.
        local: per layout entry, the local tensor that receives it (None: not received here).
        threads: copy threads.
    """

    def __init__(self, layout: Layout, local: Sequence[torch.Tensor | None], threads: int) -> None:
        self.layout = layout
        self._local = local
        self._threads = threads
        self.sums: list[int | None] = [None] * len(layout.entries)  # None: not known
        self._stale = True  # the sums are to be taken from the live tensors before the next delta
        self._pass: SumPass | None = None  # the checksum pass begun after the last dense apply
        self._thread: threading.Thread | None = None  # the background thread of the last such pass
        # Private bytes of the one-pass applies: per tensor, a copy of its positions and the
        # live values its stores replace (kept between versions, up to ``_scratch_max``).
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._scratch_max = max(SCRATCH_MIN, layout.total // 8)
        self._scratch_lock = threading.Lock()  # the background pass readies it (see dense_applied)

    def dense_applied(self, ahead: bool = True) -> None:
        """The live tensors were just copied from a dense version: with ``ahead`` (deltas may
        come: the publisher says so), their checksum pass begins now on a background thread,
        while the subscriber waits for the next version (a dense apply costs what it costs
        without delta sync); the first delta after it finishes the pass on its copy threads
        (nothing, if the background took it all). Without, the first delta makes the whole pass."""
        self.before_dense()
        if not ahead:
            return
        self._pass = self._new_pass()
        self._thread = start_background(functools.partial(self._ahead, self._pass), self._pass.stop)

    def _ahead(self, sums: SumPass) -> None:
        """The background work after a dense apply: the checksum pass, then the scratch of the
        one-pass applies, allocated whole and written once (the first delta would otherwise
        fault its pages in as it stores: 25 MB for the 100M model of the benchmarks)."""
        sums.drain()
        if sums.stopped:  # (closing, or the next dense apply began)
            return
        with self._scratch_lock:
            if self._scratch.numel() >= self._scratch_max:
                return
        scratch = torch.zeros(self._scratch_max, dtype=torch.uint8)
        with self._scratch_lock:
            if self._scratch.numel() < scratch.numel():
                self._scratch = scratch

    def before_dense(self) -> None:
        """The live tensors are about to be rewritten (a dense apply): the checksum pass in the
        background, if any, takes no more pieces, and its sums are never used."""
        if self._pass is not None:
            self._pass.stop()
            self._pass = None
        self.sums = [None] * len(self.layout.entries)
        self._stale = True

    def close(self) -> None:
        """Stops the background checksum pass, if it runs, and waits for its piece in flight
        (milliseconds; at most ``PAUSE_S``): a thread left in native code when the interpreter
        exits would abort the process."""
        if self._pass is not None:
            self._pass.stop()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(PAUSE_S)

    def _learn_live(self) -> None:
        """The checksum of every live tensor that can take deltas: what the background pass
        has not done yet, across the copy threads (or the whole pass, without one)."""
        done, self._pass = self._pass or self._new_pass(), None
        self.sums = done.finish(self._threads)
        self._stale = False

    def _new_pass(self) -> SumPass:
        """A checksum pass over the live tensors (each from its first byte)."""
        return SumPass(self._local, self.layout.entries, [0] * len(self.layout.entries))

    @staticmethod
    def header_of(index: torch.Tensor) -> tuple[int, int, int] | None:
        """(version, base, entries) of an index region's header, or None when it holds none."""
        if int(index[0]) != STREAM_MAGIC:
            return None
        return int(index[1]), int(index[2]), int(index[3])

    def apply(self, slot: torch.Tensor, index: torch.Tensor, version: int) -> None:
        """Applies the delta for ``version`` in ``slot`` (its header in ``index``) to the live
        tensors, all of it or nothing: the tensors that fit the scratch are checked and
        stored in one pass that is undone if any check fails (each value read once from the
        slot: what is stored is what the checksum verifies); the rest are checked before
        anything is stored.

        Raises:
            DeltaRefusedError: the live tensors are not the delta's base, or the payload fails
                a check; the live tensors hold what they held before.
        """
        private = index.clone()  # the index is a peer's to write: check and use one private copy
        head = self.header_of(private)
        words: list[int] = private.tolist()
        if self._stale:
            self._learn_live()
        entries = self.layout.entries
        if head is None or head[0] != version or head[2] != len(entries):
            raise DeltaRefusedError(f"delta header for version {version} malformed or stale: {head}")
        checks: list[_Check] = []
        dense: list[int] = []
        for i, e in enumerate(entries):
            w = HEADER_WORDS + ENTRY_WORDS * i
            kind_word, changed, pos_bytes, payload_bytes = words[w:w + 4]
            base_sum, new_sum, old_terms = (unsigned(x) for x in words[w + 4:w + 7])
            if kind_word not in (0, 1, 2, 3):
                raise DeltaRefusedError(f"{e.name!r}: kind {kind_word}")
            kind = Kind(kind_word)
            live = self._local[i]
            if not deltable(e):
                if kind != Kind.DENSE:
                    raise DeltaRefusedError(f"{e.name!r} can only travel dense, the header says {kind.name}")
                if live is not None:
                    dense.append(i)
                continue
            if live is None:
                continue  # not received here: whatever it holds is not ours to check
            held = self.sums[i]
            if held is None or held != base_sum:
                raise DeltaRefusedError(
                    f"{e.name!r}: the live tensor is not the base of version {version} (base {head[1]}): its checksum "
                    f"{'is unknown' if held is None else f'{held:#x}'} where the delta expects {base_sum:#x}")
            if kind == Kind.UNCHANGED:
                if new_sum != base_sum:
                    raise DeltaRefusedError(f"{e.name!r}: unchanged, yet its checksum changes")
                continue
            if kind == Kind.DENSE:
                got = checksums_of(slot, [e], self._threads)[0]
                if got != new_sum:
                    raise DeltaRefusedError(f"{e.name!r}: the dense bytes in the slot do not match their checksum")
                dense.append(i)
                continue
            if not (0 < payload_bytes <= e.nbytes and 0 <= pos_bytes <= payload_bytes and 0 < changed <= e.numel):
                raise DeltaRefusedError(f"{e.name!r}: payload of {payload_bytes} bytes / {changed} elements does not "
                                        f"fit a {e.nbytes}-byte tensor")
            checks.append(_Check(e, i, kind, changed, pos_bytes, payload_bytes, new_sum, old_terms))
        base_ptr = slot.data_ptr()
        # Most sparse tensors are checked and stored in one pass, which can be undone (its
        # scratch holds a copy of their positions and the values it replaced); the others, past
        # the scratch, are checked first (the payload alone) and stored after every check passed.
        one_pass: list[tuple[_Check, int]] = []
        checks_first: list[_Check] = []
        need = 0
        for c in checks:
            size = _scratch_bytes(c)
            if need + size <= self._scratch_max:
                one_pass.append((c, need))
                need += size
            else:
                checks_first.append(c)
        self._check_payloads(checks_first, base_ptr)
        self._apply_one_pass(one_pass, need, base_ptr)
        # Every check passed: write. Only a peer scribbling over the slot we claimed could make a
        # store fail now, and the native scatter keeps even that inside the tensor.
        batch = HostCopies()
        for i in dense:
            e, dst = entries[i], self._local[i]
            assert dst is not None
            if e.scale_offset >= 0:
                batch.add(e.nbytes, functools.partial(_dequantize, slot, e, dst))
            elif dst.is_contiguous() and dst.dtype == dtype_from_name(e.wire_dtype):
                batch.add_raw(dst.data_ptr(), base_ptr + e.offset, e.nbytes)
            else:  # an entry that always travels dense, into a tensor of another dtype or layout
                batch.add(e.nbytes, functools.partial(_cast, slot, e, dst))
        for c in checks_first:
            live = self._local[c.index]
            assert live is not None

            def scatter(c: _Check = c, live: torch.Tensor = live) -> None:
                refusal, _, _ = native.scatter(live.data_ptr(), c.entry.numel, live.element_size(),
                                               base_ptr + c.entry.offset, c.payload_bytes, int(c.kind), c.changed,
                                               c.pos_bytes, True)
                if refusal != native.Refusal.OK:
                    log.error("delta of %r changed under its apply (%s): that tensor is partly written",
                              c.entry.name, refusal.name)

            batch.add(_scatter_cost(c), scatter)
        batch.run(self._threads)
        for i, e in enumerate(entries):
            if deltable(e) and self._local[i] is not None:
                self.sums[i] = unsigned(words[HEADER_WORDS + ENTRY_WORDS * i + 5])

    def _check_payloads(self, checks: list[_Check], base_ptr: int) -> None:
        """Checks the payloads of ``checks`` in the slot at ``base_ptr`` without writing: O(changed),
        the payload alone, across the copy threads (positions in bounds, the new checksum).

        Raises:
            DeltaRefusedError: one fails.
        """
        verdicts: list[tuple[native.Refusal, int, int]] = [(native.Refusal.OK, 0, 0)] * len(checks)
        batch = HostCopies()
        for j, c in enumerate(checks):

            def check(j: int = j, c: _Check = c) -> None:
                es = dtype_from_name(c.entry.wire_dtype).itemsize
                verdicts[j] = native.scatter(0, c.entry.numel, es, base_ptr + c.entry.offset, c.payload_bytes,
                                             int(c.kind), c.changed, c.pos_bytes, False)

            batch.add(_scatter_cost(c), check)
        batch.run(self._threads)
        for c, (refusal, _, new) in zip(checks, verdicts, strict=True):
            if refusal != native.Refusal.OK:
                raise DeltaRefusedError(f"{c.entry.name!r}: payload refused ({refusal.name})")
            held = self.sums[c.index]
            assert held is not None
            # held == the base checksum (checked above), so the live values at the positions are
            # the base values whose terms the header carries.
            if (held - c.old_terms + new) & MASK64 != c.new_sum:
                raise DeltaRefusedError(f"{c.entry.name!r}: the patched tensor would not have the new checksum")

    def _apply_one_pass(self, work: list[tuple[_Check, int]], need: int, base_ptr: int) -> None:
        """Checks and stores each of ``work`` (a check and its scratch offset) in one pass across
        the copy threads, then verifies each patched tensor's checksum; undoes every store made
        if one fails.

        Raises:
            DeltaRefusedError: a payload fails a check; the live tensors are as before.
        """
        if not work:
            return
        with self._scratch_lock:
            if self._scratch.numel() < need:
                self._scratch = torch.empty(need, dtype=torch.uint8)
            scratch_t = self._scratch  # (kept alive for this pass whatever the background sets)
        scratch = scratch_t.data_ptr()
        done: list[tuple[native.Refusal, int, int, int]] = [(native.Refusal.OK, 0, 0, 0)] * len(work)
        batch = HostCopies()
        for j, (c, at) in enumerate(work):
            live = self._local[c.index]
            assert live is not None

            def one(j: int = j, c: _Check = c, at: int = at, live: torch.Tensor = live) -> None:
                payload = base_ptr + c.entry.offset
                values = c.payload_bytes - c.pos_bytes
                copy_bytes(scratch + at, payload + values, c.pos_bytes)  # the peer may rewrite its own
                done[j] = native.apply(live.data_ptr(), c.entry.numel, _es(c), payload, c.payload_bytes,
                                       int(c.kind), c.changed, c.pos_bytes, scratch + at,
                                       scratch + at + _align8(c.pos_bytes))

            batch.add(_scatter_cost(c), one)
        batch.run(self._threads)
        why = None
        for (c, _), (refusal, old, new, _stored) in zip(work, done, strict=True):
            held = self.sums[c.index]
            assert held is not None
            if refusal != native.Refusal.OK:
                why = f"{c.entry.name!r}: payload refused ({refusal.name})"
            elif (held - old + new) & MASK64 != c.new_sum:  # the live tensor's checksum now
                why = f"{c.entry.name!r}: the patched tensor does not have the new checksum"
            if why is not None:
                break
        if why is None:
            return
        for (c, at), (_, _, _, stored) in zip(work, done, strict=True):
            live = self._local[c.index]
            if stored and live is not None:
                native.undo(live.data_ptr(), c.entry.numel, _es(c), int(c.kind), scratch + at,
                            c.pos_bytes, stored, scratch + at + _align8(c.pos_bytes))
        raise DeltaRefusedError(why)


def _align8(n: int) -> int:
    return (n + 7) & ~7


def _es(c: _Check) -> int:
    """The element size of ``c``'s tensor (its live tensor has the wire dtype)."""
    return dtype_from_name(c.entry.wire_dtype).itemsize


def _scratch_bytes(c: _Check) -> int:
    """The scratch of a one-pass apply of ``c``: its positions, then the values it replaces."""
    return _align8(c.pos_bytes) + _align8(c.changed * _es(c))


def _scatter_cost(c: _Check) -> int:
    """What a scatter of ``c`` weighs for the copy threads, in bytes of memory traffic: a cache
    line a change, up to the tensor."""
    return min(c.changed * 64, c.entry.nbytes)


def _cast(buf: torch.Tensor, e: Entry, dst: torch.Tensor) -> None:
    with torch.no_grad():
        dst.copy_(_tensor_kernels.view_in(buf, e.offset, dtype_from_name(e.wire_dtype), e.shape))


def _dequantize(buf: torch.Tensor, e: Entry, dst: torch.Tensor) -> None:
    q = _tensor_kernels.view_in(buf, e.offset, dtype_from_name(e.wire_dtype), e.shape)
    scale = _tensor_kernels.view_in(buf, e.scale_offset, torch.float32, ())
    with torch.no_grad():
        dst.copy_(_tensor_kernels.dequantize_fp8(q, scale, dst.dtype))
