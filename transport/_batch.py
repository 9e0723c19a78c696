"""Prepared transfers: many segments, checked once, moved with one completion.

A :class:`PreparedTransfer` is built by ``Transport.prepare_put`` / ``prepare_get`` from
(local tensor, remote key, offset) items, or by ``prepare_put_runs`` / ``prepare_get_runs``
from one local tensor, one remote region and an ``(N, 3)`` int64 array of runs (local byte
offset, remote byte offset, nbytes), which stays an array down to the backends' native lists.
Local checks (tensor type, layout, memory kind, offsets, overlaps) run once, at prepare time;
the remote checks (key, dtype, bounds, writability) run once against the peer's record, and
again only when the peer's incarnation or its record's revision changed. Items become the
same arrays of runs (:class:`~transport._tensors.Runs`, one per local storage, dtype and
remote key), and adjacent runs (contiguous both here and there) are coalesced once. Every
``start()`` then moves every run and returns one :class:`~transport.Transfer`.

The prepared transfer only holds what was prepared and its checks against a record; the
transfer engine that made it starts it, and owns the plans it builds for it (one per record
of the peer).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ._errors import BoundsError, LayoutError
from ._ordering import spans_of
from ._regions import check
from ._tensors import LocalBuffer, MemoryKind, Runs, byte_offset, check_tensor, dtype_name, memory_kind, nbytes_of
from ._transfer import Transfer
from ._wire import PeerRecord, RegionRecord, TransferOp

if TYPE_CHECKING:
    from ._transfers import TransferEngine


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
    local, n = a[:, 0], a[:, 2]
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
    return _ordered(op, a[n > 0], what, "runs")


def _ordered(op: TransferOp, a: np.ndarray, what: str, noun: str) -> np.ndarray:
    """Rows ``(local, remote, nbytes)`` of one region, none empty, in remote order and
    coalesced: a row that starts where the previous one ended, here and there, joins it.

    Raises:
        BoundsError: a put writing the same remote bytes twice.
    """
    if len(a) == 0:
        return a.reshape(0, 3)
    a = a[np.argsort(a[:, 1], kind="stable")]
    local, remote, n = a[:, 0], a[:, 1], a[:, 2]
    if op == TransferOp.PUT:
        _no_overlap(remote, n, what, noun)
    joins = np.zeros(len(a), dtype=bool)
    joins[1:] = (remote[1:] == remote[:-1] + n[:-1]) & (local[1:] == local[:-1] + n[:-1])
    if joins.any():
        starts = np.flatnonzero(~joins)
        a = np.stack([local[starts], remote[starts], np.add.reduceat(n, starts)], axis=1)
    return np.ascontiguousarray(a)


def _no_overlap(remote: np.ndarray, n: np.ndarray, what: str, noun: str) -> None:
    """Raises BoundsError when two of the sorted remote ranges ``remote`` / ``n`` share bytes."""
    if len(remote) > 1 and (remote[1:] < remote[:-1] + n[:-1]).any():
        i = int(np.argmax(remote[1:] < remote[:-1] + n[:-1]))
        raise BoundsError(f"{what}: two {noun} write bytes {int(remote[i + 1])}.."
                          f"{int(min(remote[i] + n[i], remote[i + 1] + n[i + 1]))} (the order inside one "
                          "transfer is undefined; split it into two)")


def _base(t: torch.Tensor) -> torch.Tensor:
    """A one-dimensional tensor of ``t``'s dtype over the whole of its storage, from its first
    byte: the local base of the runs it takes part in."""
    storage, item = t.untyped_storage(), t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (storage.nbytes() // item,), (1,))


class PreparedTransfer:
    """A reusable put or get of many segments to one peer, with one completion per start.

    Build with ``Transport.prepare_put`` / ``prepare_get`` (items) or ``prepare_put_runs`` /
    ``prepare_get_runs`` (an array of runs); the local tensors stay referenced (and are read,
    or written, at every :meth:`start`): fill them, start, await, repeat.

    Either way it holds :class:`~transport._tensors.Runs`: items become one array of runs per
    (local storage, dtype, memory kind, remote key), over a base tensor spanning the storage.

    Attributes:
        op: PUT or GET.
        peer: the peer's name.
        nbytes: bytes moved by one start.
        segments: runs after coalescing (what the backends move).
        items: items (or runs) as given.
        runs: the runs, a list per remote key and local base, in key order.
    """

    def __init__(self, op: TransferOp, peer: str, items: Sequence[tuple[torch.Tensor, str, int]],
                 engine: TransferEngine, known: PeerRecord | None) -> None:
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise TypeError("items must be a sequence of (tensor, key, offset) tuples")
        given: list[tuple[str, str, int, int]] = []  # (key, dtype, offset, nbytes): checked as given
        groups: dict[tuple[int, torch.dtype, torch.device, str], tuple[LocalBuffer, list[tuple[int, int, int]]]] = {}
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
            kind, offset, n = memory_kind(tensor, what), byte_offset(offset), nbytes_of(tensor)
            if not -(1 << 62) < offset < 1 << 62:
                raise BoundsError(f"{what}: offset {offset} is out of range")
            given.append((key, dtype_name(tensor.dtype), offset, n))
            if n == 0:
                continue
            storage = tensor.untyped_storage().data_ptr()
            group = groups.get((storage, tensor.dtype, tensor.device, key))
            if group is None:
                group = groups[(storage, tensor.dtype, tensor.device, key)] = (LocalBuffer(_base(tensor), kind), [])
            group[1].append((int(tensor.storage_offset()) * tensor.element_size(), offset, n))
        if not given:
            raise ValueError("a prepared transfer needs at least one item")
        what = f"prepared {op.value} to {peer}"
        runs = [Runs(local, key, _ordered(op, np.array(rows, dtype=np.int64), f"{what}:{key!r}", "items"))
                for (_, _, _, key), (local, rows) in groups.items()]
        self._given: list[tuple[str, str, int, int]] | None = given
        self._init_common(op, peer, len(given), runs, engine, known)

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
        flat = tensor.reshape(-1) if tensor.numel() else tensor.new_empty(0)
        self = cls.__new__(cls)
        kind = memory_kind(tensor, "tensor")
        # No bytes to move (every run empty): the region is still checked, as an empty item.
        self._given = None if len(array) else [(key, dtype_name(tensor.dtype), 0, 0)]
        lists = [Runs(LocalBuffer(flat, kind), key, array)] if len(array) else []
        self._init_common(op, peer, len(runs), lists, engine, known)  # type: ignore[arg-type]
        return self

    def _init_common(self, op: TransferOp, peer: str, items: int, runs: list[Runs], engine: TransferEngine,
                     known: PeerRecord | None) -> None:
        runs.sort(key=lambda r: (r.key, r.span))
        if op == TransferOp.PUT:  # the same remote bytes from two local bases
            for k, same_key in itertools.groupby(runs, key=lambda r: r.key):
                mine = list(same_key)
                if len(mine) > 1:
                    rows = np.concatenate([r.array for r in mine])
                    rows = rows[np.argsort(rows[:, 1], kind="stable")]
                    _no_overlap(rows[:, 1], rows[:, 2], f"prepared put to {peer}:{k!r}", "items")
        self.op, self.peer, self.items, self.runs = op, peer, items, runs
        self.first_key = runs[0].key if runs else (self._given or [('', '', 0, 0)])[0][0]
        self.segments = sum(len(r.array) for r in runs)
        self.nbytes = sum(r.nbytes for r in runs)
        self._spans = spans_of((r.key, *_lo_n(r)) for r in runs)
        self._engine = engine
        self._bound: tuple[str, int, list[tuple[Runs, RegionRecord]]] | None = None  # (incarnation, seq, runs)
        # One tensor per distinct local storage: a storage given new memory (resize_, set_)
        # since the plan was built makes the plan stale (its native list has the old addresses).
        reps: dict[int, torch.Tensor] = {}
        for r in runs:
            reps.setdefault(r.local.tensor.untyped_storage().data_ptr(), r.local.tensor)
        self._storages = list(reps.values())
        # One CUDA tensor per local device: where each start records the event its CUDA
        # segments wait for (the work queued on that device's current stream by then).
        self.cuda_anchors = {t.device.index: t for t in self._storages if t.is_cuda}
        self._single: tuple[torch.Tensor, MemoryKind, str, int] | None = None
        if len(runs) == 1 and len(runs[0].array) == 1:
            (view, offset), = runs[0].pieces()
            self._single = (view, runs[0].local.kind, runs[0].key, offset)
        if known is not None:
            self.bind(known)  # all remote checks now, when the peer's record is at hand

    def single(self) -> tuple[torch.Tensor, MemoryKind, str, int] | None:
        """(local view, memory kind, remote key, remote offset) of the one run of a transfer
        that has exactly one, else None."""
        return self._single

    def memory(self) -> tuple[int, ...]:
        """Where the local storages are now: a plan built for other addresses is stale."""
        return tuple(t.untyped_storage().data_ptr() for t in self._storages)

    def spans(self) -> dict[str, tuple[int, int]]:
        """Per remote key, the byte span the segments cover (for ordering against other
        transfers); empty when every item is empty. Fixed at prepare time."""
        return self._spans

    def bind(self, record: PeerRecord) -> list[tuple[Runs, RegionRecord]]:
        """The runs, each with the region of ``record`` it goes to, checked against it (cached
        per incarnation and revision).

        Raises:
            RegistrationError, ReadOnlyRegionError, DTypeMismatchError, BoundsError: as a
                single put/get would, for the first item that fails (given order); for an array
                of runs, for the span they cover.
        """
        cached = self._bound
        if cached is not None and cached[0] == record.incarnation and cached[1] == record.seq:
            return cached[2]
        if self._given is None:  # one region: the span's check covers every run
            for r in self.runs:
                lo, hi = r.span
                check(self.op, record.name, r.key, record.regions.get(r.key), dtype_name(r.local.tensor.dtype), lo,
                      hi - lo, known=record.regions.keys())
        for key, dtype, offset, n in self._given or ():  # the items as given, so that errors name them
            check(self.op, record.name, key, record.regions.get(key), dtype, offset, n, known=record.regions.keys())
        bound = [(r, record.regions[r.key]) for r in self.runs]
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

    async def warm(self, *, timeout: float | None = None) -> None:
        """Readies the first start ahead of time, so that it costs what later starts do: builds
        the plan for the peer's current record and lets each backend set up what the first
        start would on its way (over ``ipc``: maps the peer's memory and fills this process's
        page tables for exactly the pages the runs touch, which a first copy would otherwise
        fault in one by one). Moves no byte; the peer sees nothing. Optional: call it where
        the time is free (e.g. while the trainer computes), not just before :meth:`start`.
        A single host segment (which starts as a plain put) has nothing to ready.

        Args:
            timeout: seconds (default: the Transport's timeout).

        Raises:
            ClosedError: the Transport is closed. TransferTimeoutError: not done in time.
            As :meth:`start` for the checks against the peer's record (unknown peer or region,
            bounds, dtype), which run here too.

        Cancellation: safe; what was readied stays readied (it only saves work later).
        """
        await self._engine.warm_prepared(self, timeout)

    def __repr__(self) -> str:
        return (f"<PreparedTransfer {self.op.value} {self.peer} {self.items} items -> {self.segments} runs, "
                f"{self.nbytes} B>")


def _lo_n(r: Runs) -> tuple[int, int]:
    lo, hi = r.span
    return lo, hi - lo
