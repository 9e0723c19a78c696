"""Prepared transfers: many segments, checked once, moved with one completion.

A :class:`PreparedTransfer` is built by ``Transport.prepare_put`` / ``prepare_get`` from
(local tensor, remote key, offset) items, or by ``prepare_put_runs`` / ``prepare_get_runs``
from one local tensor, one remote region and an ``(N, 3)`` int64 array of runs (local byte
offset, remote byte offset, nbytes), which stays an array down to the backends' native lists.
Local checks (tensor type, layout, memory kind, offsets, overlaps) run once, at prepare time;
the remote checks (key, dtype, bounds, writability) run once against the peer's record, and
again only when the peer's incarnation or its record's revision changed. Adjacent segments
(the same local storage and the same remote region, both contiguous) are coalesced once.
Every ``start()`` then moves the whole list and returns one :class:`~transport.Transfer`.

The prepared transfer only holds what was prepared and its checks against a record; the
transfer engine that made it starts it, and owns the plans it builds for it (one per record
of the peer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ._errors import BoundsError, LayoutError
from ._ordering import spans_of
from ._regions import check
from ._tensors import MemoryKind, byte_offset, check_tensor, dtype_name, memory_kind, nbytes_of
from ._transfer import Transfer
from ._wire import PeerRecord, RegionRecord, TransferOp

if TYPE_CHECKING:
    from ._transfers import TransferEngine


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


@dataclass(frozen=True)
class Runs:
    """The runs of a prepared transfer made from an array: ``tensor`` <-> region ``key``, one
    row per run of ``array`` (int64 ``(N, 3)``: local byte offset, remote byte offset, nbytes),
    coalesced and in remote order. Backends turn the array into their native lists as it is."""

    tensor: torch.Tensor
    kind: MemoryKind
    key: str
    array: np.ndarray


def check_runs(op: TransferOp, tensor: torch.Tensor, runs: object, what: str) -> np.ndarray:
    """``runs`` as a coalesced int64 ``(N, 3)`` array in remote order, checked against the local
    ``tensor``: offsets and sizes non-negative and multiples of its item size, every run
    inside it, and (for a put) no two runs writing the same remote bytes. Empty runs are
    dropped.

    Raises:
        TypeError: not an integer array of shape (N, 3). ValueError: no runs.
        BoundsError: a run outside the local tensor, negative or misaligned, or overlapping
            another one's remote bytes (a put).
    """
    if isinstance(runs, torch.Tensor):
        runs = runs.detach().cpu().numpy()
    if not isinstance(runs, np.ndarray) or runs.ndim != 2 or runs.shape[1] != 3 or runs.dtype.kind not in "iu":
        raise TypeError(f"{what}: runs must be an integer array of shape (N, 3), got "
                        f"{getattr(runs, 'shape', type(runs).__name__)} {getattr(runs, 'dtype', '')}")
    if len(runs) == 0:
        raise ValueError(f"{what}: a prepared transfer needs at least one run")
    if runs.dtype.kind == "u" and len(runs) and int(runs.max()) >= 1 << 62:
        raise BoundsError(f"{what}: a run offset or size is out of range")
    a = runs.astype(np.int64, copy=False)
    local, remote, n = a[:, 0], a[:, 1], a[:, 2]
    item = tensor.element_size()
    if (a < 0).any():
        raise BoundsError(f"{what}: run {int(np.argmax((a < 0).any(axis=1)))} has a negative offset or size")
    if item > 1 and ((a % item) != 0).any():
        raise BoundsError(f"{what}: run {int(np.argmax(((a % item) != 0).any(axis=1)))} is not aligned to the "
                          f"{item}-byte items of {tensor.dtype}")
    limit = nbytes_of(tensor)
    if (local + n > limit).any():
        i = int(np.argmax(local + n > limit))
        raise BoundsError(f"{what}: run {i} reads bytes {int(local[i])}..{int(local[i] + n[i])} of a "
                          f"{limit}-byte local tensor")
    a = a[n > 0]
    if len(a) == 0:
        return a.reshape(0, 3)
    a = a[np.argsort(a[:, 1], kind="stable")]
    local, remote, n = a[:, 0], a[:, 1], a[:, 2]
    if op == TransferOp.PUT and len(a) > 1 and (remote[1:] < remote[:-1] + n[:-1]).any():
        i = int(np.argmax(remote[1:] < remote[:-1] + n[:-1]))
        raise BoundsError(f"{what}: two runs write remote bytes {int(remote[i + 1])}.."
                          f"{int(min(remote[i] + n[i], remote[i + 1] + n[i + 1]))} (the order inside one "
                          "transfer is undefined; split it into two)")
    # Coalesce: a run that starts where the previous one ended, here and there, joins it.
    joins = np.zeros(len(a), dtype=bool)
    joins[1:] = (remote[1:] == remote[:-1] + n[:-1]) & (local[1:] == local[:-1] + n[:-1])
    if joins.any():
        starts = np.flatnonzero(~joins)
        a = np.stack([local[starts], remote[starts], np.add.reduceat(n, starts)], axis=1)
    return np.ascontiguousarray(a)


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

    Build with ``Transport.prepare_put`` / ``prepare_get`` (items) or ``prepare_put_runs`` /
    ``prepare_get_runs`` (an array of runs); the local tensors stay referenced (and are read,
    or written, at every :meth:`start`): fill them, start, await, repeat.

    Attributes:
        op: PUT or GET.
        peer: the peer's name.
        nbytes: bytes moved by one start.
        segments: segments (or runs) after coalescing (what the backend moves).
        items: segments (or runs) as given.
    """

    def __init__(self, op: TransferOp, peer: str, items: Sequence[tuple[torch.Tensor, str, int]],
                 engine: TransferEngine, known: PeerRecord | None) -> None:
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
        self.runs: Runs | None = None
        self._given = segments
        self._segments = _coalesce([s for s in segments if s.nbytes])
        self._check_overlap()
        self.nbytes = sum(s.nbytes for s in self._segments)
        self._spans = spans_of((s.key, s.offset, s.nbytes) for s in self._segments)
        self._init_common(engine, known)

    @classmethod
    def of_runs(cls, op: TransferOp, peer: str, tensor: torch.Tensor, key: str, runs: object,
                engine: TransferEngine, known: PeerRecord | None) -> PreparedTransfer:
        """A prepared transfer of ``runs`` (see :func:`check_runs`) between ``tensor`` and the
        peer's region ``key``.

        Raises:
            As :func:`check_runs`; TypeError, LayoutError for the tensor or key; as ``bind``
            when ``known``.
        """
        tensor = check_tensor(tensor, "tensor")
        if not tensor.is_contiguous():
            raise LayoutError("a prepared transfer's tensor must be contiguous (its bytes are read or written in "
                              "place at every start)")
        if not isinstance(key, str) or not key:
            raise TypeError("key must be a non-empty str")
        array = check_runs(op, tensor, runs, f"prepared {op.value} to {peer}:{key!r}")
        self = cls.__new__(cls)
        self.op, self.peer, self.first_key = op, peer, key
        self.items = len(runs)  # type: ignore[arg-type]
        self.runs = Runs(tensor, memory_kind(tensor, "tensor"), key, array)
        self._given, self._segments = [], []
        self.nbytes = int(array[:, 2].sum()) if len(array) else 0
        self._spans = {key: (int(array[0, 1]), int(array[-1, 1] + array[-1, 2]))} if len(array) else {}
        self._init_common(engine, known)
        return self

    def _init_common(self, engine: TransferEngine, known: PeerRecord | None) -> None:
        self._engine = engine
        self._bound: tuple[str, int, list[Bound]] | None = None  # (incarnation, seq, segments)
        # One tensor per distinct local storage: a storage given new memory (resize_, set_)
        # since the plan was built makes the plan stale (its native list has the old addresses).
        tensors = [s.tensor for s in self._segments] + ([self.runs.tensor] if self.runs is not None else [])
        reps: dict[int, torch.Tensor] = {}
        for t in tensors:
            reps.setdefault(t.untyped_storage().data_ptr(), t)
        self._storages = list(reps.values())
        # One CUDA tensor per local device: where each start records the event its CUDA
        # segments wait for (the work queued on that device's current stream by then).
        self.cuda_anchors = {t.device.index: t for t in tensors if t.is_cuda}
        if known is not None:
            self.bind(known)  # all remote checks now, when the peer's record is at hand

    @property
    def segments(self) -> int:
        return len(self.runs.array) if self.runs is not None else len(self._segments)

    def single(self) -> Segment | None:
        """The one segment of an item-built transfer that has exactly one, else None."""
        return self._segments[0] if self.runs is None and len(self._segments) == 1 else None

    def memory(self) -> tuple[int, ...]:
        """Where the local storages are now: a plan built for other addresses is stale."""
        return tuple(t.untyped_storage().data_ptr() for t in self._storages)

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
        if self.runs is not None:  # one region: the span's check covers every run
            r = self.runs
            lo, hi = self._spans.get(r.key, (0, 0))
            check(self.op, record.name, r.key, record.regions.get(r.key), dtype_name(r.tensor.dtype), lo, hi - lo,
                  known=record.regions.keys())
            seg = Segment(r.tensor, r.kind, r.key, lo, hi - lo)
            bound = [Bound(seg, record.regions[r.key])]
            self._bound = (record.incarnation, record.seq, bound)
            return bound
        for s in self._given:  # the items as given, so that errors name them
            check(self.op, record.name, s.key, record.regions.get(s.key), dtype_name(s.tensor.dtype), s.offset,
                  s.nbytes, known=record.regions.keys())
        bound = [Bound(s, record.regions[s.key]) for s in self._segments]
        self._bound = (record.incarnation, record.seq, bound)
        return bound

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
        return self._engine.start_prepared(self, timeout)

    def __repr__(self) -> str:
        return (f"<PreparedTransfer {self.op.value} {self.peer} {self.items} items -> {self.segments} segments, "
                f"{self.nbytes} B>")
