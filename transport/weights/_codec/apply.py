"""The subscriber's side of stream delta sync (the format is in :mod:`.format`): the
checksums of the live tensors, and the checked, all-or-nothing apply of a delta from a slot
(its sparse tensors by :func:`.patch.apply_patches`, as the mesh form's)."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence

import torch

from ... import _tensor_kernels
from ..._background import start_background
from ..._errors import DeltaRefusedError
from ..._tensors import dtype_from_name
from .._copy import HostCopies
from .._layout import Entry, Layout
from .checksum import PAUSE_S, SumPass, checksums_of, deltable
from .format import ENTRY_WORDS, HEADER_WORDS, STREAM_MAGIC, Kind, unsigned
from .patch import Patch, Scratch, apply_patches

log = logging.getLogger(__name__)


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
        # The one-pass applies' private bytes: an eighth of the version readied by the background
        # pass (dense_applied), grown as a denser delta needs.
        self._scratch = Scratch.for_deltas(layout.total, len(layout.entries))

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
        if not sums.stopped:  # (stopped: closing, or the next dense apply began)
            self._scratch.ready()

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
        patches: list[Patch] = []
        dense: list[int] = []
        base_ptr = slot.data_ptr()
        for i, e in enumerate(entries):
            w = HEADER_WORDS + ENTRY_WORDS * i
            kind_word, changed, pos_bytes, payload_bytes = words[w:w + 4]
            base_sum, new_sum, old_terms = (unsigned(x) for x in words[w + 4:w + 7])
            try:
                kind = Kind(kind_word)
            except ValueError:
                raise DeltaRefusedError(f"{e.name!r}: kind {kind_word}") from None
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
            # (the live tensor has the wire dtype: a tensor that takes deltas is received as is)
            patches.append(Patch(repr(e.name), live.data_ptr(), e.numel, dtype_from_name(e.wire_dtype).itemsize,
                                 base_ptr + e.offset, payload_bytes, pos_bytes, kind, changed, held, new_sum,
                                 old_terms))
        apply_patches(patches, self._threads, self._scratch)
        # Every sparse tensor is patched: the dense ones are copied (no check can fail now).
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
        batch.run(self._threads)
        for i, e in enumerate(entries):
            if deltable(e) and self._local[i] is not None:
                self.sums[i] = unsigned(words[HEADER_WORDS + ENTRY_WORDS * i + 5])


def _cast(buf: torch.Tensor, e: Entry, dst: torch.Tensor) -> None:
    with torch.no_grad():
        dst.copy_(_tensor_kernels.view_in(buf, e.offset, dtype_from_name(e.wire_dtype), e.shape))


def _dequantize(buf: torch.Tensor, e: Entry, dst: torch.Tensor) -> None:
    q = _tensor_kernels.view_in(buf, e.offset, dtype_from_name(e.wire_dtype), e.shape)
    scale = _tensor_kernels.view_in(buf, e.scale_offset, torch.float32, ())
    with torch.no_grad():
        dst.copy_(_tensor_kernels.dequantize_fp8(q, scale, dst.dtype))
