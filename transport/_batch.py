"""Prepared transfers: many (local tensor, remote key, offset) segments, checked once, moved with
one completion.

A :class:`PreparedTransfer` is built by ``Transport.prepare_put`` / ``prepare_get``. Local
checks (tensor type, layout, memory kind, offset type) run once, at prepare time; the remote
checks (key, dtype, bounds, writability) run once against the peer's record, and again only
when the peer's incarnation or its record's revision changed. Adjacent segments (the same
local storage and the same remote region, both contiguous) are coalesced once. Every
``start()`` then moves the whole list and returns one :class:`~transport.Transfer`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from ._errors import BoundsError, LayoutError
from ._regions import check
from ._tensors import MemoryKind, byte_offset, check_tensor, dtype_name, memory_kind, nbytes_of
from ._transfer import Transfer
from ._wire import PeerRecord, RegionRecord, TransferOp

_Plan = TypeVar("_Plan")


@dataclass(frozen=True)
class Segment:
    """One coalesced piece of a prepared transfer: ``tensor`` <-> ``nbytes`` bytes at byte
    ``offset`` of the remote region ``key``."""

    tensor: torch.Tensor
    kind: MemoryKind
    key: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Bound:
    """A segment checked against one record of the peer: the region it goes to."""

    segment: Segment
    region: RegionRecord


def _coalesce(segments: list[Segment]) -> list[Segment]:
    """Merges runs of segments that are adjacent both here (one storage, one dtype) and there
    (one region), in remote order."""
    out: list[Segment] = []
    for seg in sorted(segments, key=lambda s: (s.key, s.offset)):
        if out:
            last = out[-1]
            a, b = last.tensor, seg.tensor
            if (last.key == seg.key and last.offset + last.nbytes == seg.offset and a.dtype == b.dtype
                    and a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                    and a.storage_offset() + a.numel() == b.storage_offset()):
                merged = torch.empty(0, dtype=a.dtype, device=a.device)
                merged.set_(a.untyped_storage(), a.storage_offset(), (a.numel() + b.numel(),), (1,))
                out[-1] = Segment(merged, last.kind, last.key, last.offset, last.nbytes + seg.nbytes)
                continue
        out.append(seg)
    return out


class PreparedTransfer:
    """A reusable put or get of many segments to one peer, with one completion per start.

    Build with ``Transport.prepare_put`` / ``prepare_get``; the local tensors stay referenced
    (and are read, or written, at every :meth:`start`): fill them, start, await, repeat.

    Attributes:
        op: PUT or GET.
        peer: the peer's name.
        nbytes: bytes moved by one start.
        segments: segments after coalescing (what the backend moves).
        items: segments as given.
    """

    def __init__(self, op: TransferOp, peer: str, items: Sequence[tuple[torch.Tensor, str, int]],
                 starter: Callable[[PreparedTransfer, float | None], Transfer], known: PeerRecord | None) -> None:
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise TypeError("items must be a sequence of (tensor, key, offset) tuples")
        segments = []
        for i, item in enumerate(items):
            if not isinstance(item, tuple) or len(item) != 3:
                raise TypeError(f"item {i} must be a (tensor, key, offset) tuple, got {item!r:.80}")
            tensor, key, offset = item
            what = f"item {i} ({key!r})"
            tensor = check_tensor(tensor, what)
            if not tensor.is_contiguous():
                raise LayoutError(f"{what}: a prepared transfer's tensors must be contiguous (its bytes are read "
                                  "or written in place at every start)")
            if not isinstance(key, str) or not key:
                raise TypeError(f"{what}: key must be a non-empty str")
            segments.append(Segment(tensor, memory_kind(tensor, what), key, byte_offset(offset), nbytes_of(tensor)))
        if not segments:
            raise ValueError("a prepared transfer needs at least one item")
        self.op = op
        self.peer = peer
        self.items = len(segments)
        self.first_key = segments[0].key
        self._given = segments
        self._segments = _coalesce([s for s in segments if s.nbytes])
        self._check_overlap()
        self.nbytes = sum(s.nbytes for s in self._segments)
        self._spans: dict[str, tuple[int, int]] = {}
        for seg in self._segments:
            lo, hi = self._spans.get(seg.key, (seg.offset, seg.offset + seg.nbytes))
            self._spans[seg.key] = (min(lo, seg.offset), max(hi, seg.offset + seg.nbytes))
        self._starter = starter
        self._bound: tuple[str, int, list[Bound]] | None = None  # (incarnation, seq, segments)
        # One tensor per distinct local storage: a storage given new memory (resize_, set_)
        # since the plan was built makes the plan stale (its native list has the old addresses).
        reps: dict[int, torch.Tensor] = {}
        for seg in self._segments:
            reps.setdefault(seg.tensor.untyped_storage().data_ptr(), seg.tensor)
        self._storages = list(reps.values())
        # One CUDA tensor per local device: where each start records the event its CUDA
        # segments wait for (the work queued on that device's current stream by then).
        self.cuda_anchors = {s.tensor.device.index: s.tensor for s in self._segments if s.kind == MemoryKind.CUDA}
        self._plan: tuple[tuple[object, ...], Any] | None = None  # (what it was built for, plan)
        if known is not None:
            self.bind(known)  # all remote checks now, when the peer's record is at hand

    @property
    def segments(self) -> int:
        return len(self._segments)

    def spans(self) -> dict[str, tuple[int, int]]:
        """Per remote key, the byte span the segments cover (for ordering against other
        transfers); empty when every item is empty. Fixed at prepare time."""
        return self._spans

    def _check_overlap(self) -> None:
        if self.op != TransferOp.PUT:
            return
        for a, b in zip(self._segments, self._segments[1:], strict=False):
            if a.key == b.key and b.offset < a.offset + a.nbytes:
                raise BoundsError(f"prepared put to {self.peer}: two items write bytes {b.offset}.."
                                  f"{min(a.offset + a.nbytes, b.offset + b.nbytes)} of {a.key!r} (the order "
                                  "inside one transfer is undefined; split it into two)")

    def bind(self, record: PeerRecord) -> list[Bound]:
        """The segments checked against ``record`` (cached per incarnation and revision).

        Raises:
            RegistrationError, ReadOnlyRegionError, DTypeMismatchError, BoundsError: as a
                single put/get would, for the first segment that fails (given order).
        """
        cached = self._bound
        if cached is not None and cached[0] == record.incarnation and cached[1] == record.seq:
            return cached[2]
        for s in self._given:  # the items as given, so that errors name them
            check(self.op, record.name, s.key, record.regions.get(s.key), dtype_name(s.tensor.dtype), s.offset,
                  s.nbytes, known=record.regions.keys())
        bound = [Bound(s, record.regions[s.key]) for s in self._segments]
        self._bound = (record.incarnation, record.seq, bound)
        return bound

    def plan(self, record: PeerRecord, build: Callable[[list[Bound]], _Plan]) -> _Plan:
        """What ``build`` makes of the segments bound to ``record`` (see :meth:`bind`), kept
        while the peer's incarnation and record, and the local memory, stay the same: the
        backends' native descriptor lists, made once.

        Raises:
            As :meth:`bind`; what ``build`` raises.
        """
        bound = self.bind(record)
        ident = (record.incarnation, record.seq, *(t.untyped_storage().data_ptr() for t in self._storages))
        cached = self._plan
        if cached is not None and cached[0] == ident:
            return cast(_Plan, cached[1])
        plan = build(bound)
        self._plan = (ident, plan)
        return plan

    def start(self, *, timeout: float | None = None) -> Transfer:
        """Starts moving every segment; returns one handle for all of them.

        Args:
            timeout: seconds for the whole list (default: the Transport's timeout).

        Returns:
            A :class:`~transport.Transfer` (``nbytes`` is the total); awaiting it returns once
            every segment is in place.

        Raises:
            As ``Transport.put`` / ``get`` (here, or when awaiting the handle; remote checks
            always before any byte moves). Segments already moved when one fails are not
            undone (``partial`` says so).

        Cancellation: as a single transfer's (see :class:`~transport.Transfer`).
        """
        return self._starter(self, timeout)

    def __repr__(self) -> str:
        return (f"<PreparedTransfer {self.op.value} {self.peer} {self.items} items -> {self.segments} segments, "
                f"{self.nbytes} B>")
