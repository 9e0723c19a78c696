"""A prepared transfer's run list, as a value: what ``Transport.prepare_*`` checked once.

:class:`RunList` is built from (local tensor, remote key, offset) items (``prepare_put`` /
``prepare_get``) or from one local tensor, one remote region and an ``(N, 3)`` int64 array of
runs (local byte offset, remote byte offset, nbytes; ``prepare_put_runs`` / ``prepare_get_runs``),
which stays an array down to the backends' native lists. The local checks (tensor type, layout,
memory kind, offsets, overlaps) run here, once. Items become the same arrays of runs
(:class:`~transport._tensors.Runs`, one per local storage, dtype and remote key), and adjacent
runs (contiguous both here and there) are coalesced once. :meth:`RunList.check` runs the remote
checks (key, dtype, bounds, writability) against one record of the peer; it caches nothing.
:meth:`RunList.subset` makes the run list of one start of some of an array's runs
(``PreparedTransfer.start(runs=...)``), checked against those runs alone (vectorised).

It knows no engine and no backend: the transfer engine keeps, per run list, the plan it built for
one record of the peer (and checks again only when the incarnation, the record's revision or the
local memory changed); :class:`~transport._transfers.prepared.PreparedTransfer` is the public
handle over one run list.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from .._errors import BoundsError, LayoutError
from .._regions import check
from .._tensors import (
    LocalBuffer,
    MemoryKind,
    Runs,
    byte_offset,
    check_tensor,
    dtype_name,
    memory_kind,
    nbytes_of,
    spans_of,
)
from .._wire import PeerRecord, RegionRecord, TransferOp


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
    a = _rows(runs, tensor, what)
    local, n = a[:, 0], a[:, 2]
    limit = nbytes_of(tensor)
    if (local + n > limit).any():
        i = int(np.argmax(local + n > limit))
        raise BoundsError(f"{what}: run {i} reads bytes {int(local[i])}..{int(local[i] + n[i])} of a "
                          f"{limit}-byte local tensor")
    return _ordered(op, a[n > 0], what, "runs")


def _rows(runs: object, tensor: torch.Tensor, what: str) -> np.ndarray:
    """``runs`` as an int64 ``(N, 3)`` array, none negative, each offset and size a multiple of
    ``tensor``'s item size (what :func:`check_runs` and :meth:`RunList.subset` check first).

    Raises:
        TypeError: not an integer array of shape (N, 3). ValueError: no runs.
        BoundsError: a negative, misaligned or out-of-range offset or size.
    """
    if isinstance(runs, torch.Tensor):
        runs = runs.detach().cpu().numpy()
    if not isinstance(runs, np.ndarray) or runs.ndim != 2 or runs.shape[1] != 3 or runs.dtype.kind not in "iu":
        raise TypeError(f"{what}: runs must be an integer array of shape (N, 3), got "
                        f"{getattr(runs, 'shape', type(runs).__name__)} {getattr(runs, 'dtype', '')}")
    if len(runs) == 0:
        raise ValueError(f"{what}: a prepared transfer needs at least one run")
    if runs.dtype.kind == "u" and int(runs.max()) >= 1 << 62:
        raise BoundsError(f"{what}: a run offset or size is out of range")
    a = runs.astype(np.int64, copy=False)
    item = tensor.element_size()
    if (a < 0).any():
        raise BoundsError(f"{what}: run {int(np.argmax((a < 0).any(axis=1)))} has a negative offset or size")
    if (a >= 1 << 62).any():  # (so that an offset plus a size cannot overflow)
        raise BoundsError(f"{what}: run {int(np.argmax((a >= 1 << 62).any(axis=1)))} has an offset or size out of "
                          "range")
    if item > 1 and ((a % item) != 0).any():
        raise BoundsError(f"{what}: run {int(np.argmax(((a % item) != 0).any(axis=1)))} is not aligned to the "
                          f"{item}-byte items of {tensor.dtype}")
    return a


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


# A container of a subset's rows, where a get's runs share remote bytes: (local-to-remote
# displacement, first remote byte, end), compared in that order.
_KEYED = np.dtype([("d", "<i8"), ("lo", "<i8"), ("hi", "<i8")])


def _containers(array: np.ndarray) -> tuple[np.ndarray, bool]:
    """The runs ``array`` (remote order) as the containers the rows of a subset must lie in:
    as they are, when no two share remote bytes (a put's never do); else (a get's may) merged
    where runs with the same local-to-remote displacement overlap or touch, keyed by
    (displacement, remote offset) for a lexicographic search (the flag)."""
    if len(array) < 2 or not (array[1:, 1] < array[:-1, 1] + array[:-1, 2]).any():
        return array, False
    disp = array[:, 0] - array[:, 1]
    order = np.lexsort((array[:, 1], disp))
    merged: list[list[int]] = []
    for d, lo, n in zip(disp[order].tolist(), array[order, 1].tolist(), array[order, 2].tolist(), strict=True):
        if merged and merged[-1][0] == d and lo <= merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], lo + n)
        else:
            merged.append([d, lo, lo + n])
    out = np.zeros(len(merged), dtype=_KEYED)
    m = np.array(merged, dtype=np.int64)
    out["d"], out["lo"], out["hi"] = m[:, 0], m[:, 1], m[:, 2]
    return out, True


def _outside(containers: np.ndarray, keyed: bool, rows: np.ndarray) -> np.ndarray:
    """A mask of the ``rows`` (local, remote, nbytes) that lie inside no container (see
    :func:`_containers`) at the same place on both sides: vectorised, one binary search a row."""
    local, remote, end = rows[:, 0], rows[:, 1], rows[:, 1] + rows[:, 2]
    if keyed:  # the last container at or before (displacement, remote offset)
        key = np.zeros(len(rows), dtype=_KEYED)
        key["d"], key["lo"], key["hi"] = local - remote, remote, np.iinfo(np.int64).max
        c = containers[np.maximum(np.searchsorted(containers, key, side="right") - 1, 0)]
        out: np.ndarray = (c["d"] != local - remote) | (remote < c["lo"]) | (end > c["hi"])
        return out
    c = containers[np.maximum(np.searchsorted(containers[:, 1], remote, side="right") - 1, 0)]
    out = (remote < c[:, 1]) | (end > c[:, 1] + c[:, 2]) | (local - remote != c[:, 0] - c[:, 1])
    return out


def _base(t: torch.Tensor) -> torch.Tensor:
    """A one-dimensional tensor of ``t``'s dtype over the whole of its storage, from its first
    byte: the local base of the runs it takes part in."""
    storage, item = t.untyped_storage(), t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (storage.nbytes() // item,), (1,))



class RunList:
    """The runs of one prepared put or get to one peer, checked here once (a value: no engine,
    no backend; nothing cached but its own runs in the form :meth:`subset` searches).

    Build with :meth:`of_items` or :meth:`of_array`.

    Attributes:
        op: PUT or GET.
        peer: the peer's name.
        items: items (or runs) as given.
        runs: the runs, one :class:`~transport._tensors.Runs` per remote key and local base,
            in key order.
        segments: runs after coalescing (what the backends move).
        nbytes: bytes moved by one start.
        first_key: the first remote key (named by a transfer of no bytes).
        spans: per remote key, the byte span the runs cover (for the ordering rule); empty
            when every item is empty.
        one_array: made of one array of runs (:meth:`of_array`, or :meth:`subset`): a start
            may move a subset of them.
        single: (local view, memory kind, remote key, remote offset) when there is exactly one
            run (it moves as a single put or get would), else None.
        cuda_anchors: one CUDA tensor per local device, where each start records the event its
            CUDA runs wait for (the work queued on that device's current stream by then).
    """

    __slots__ = ("__weakref__", "_containers", "_given", "_storages", "cuda_anchors", "first_key", "items", "nbytes",
                 "one_array", "op", "peer", "runs", "segments", "single", "spans")

    def __init__(self, op: TransferOp, peer: str, items: int, runs: list[Runs],
                 given: list[tuple[str, str, int, int]] | None) -> None:
        """Use :meth:`of_items` or :meth:`of_array`. ``given``: the items as given, (key, dtype,
        offset, nbytes), checked one by one against a record so that errors name them; None for
        an array of runs into one region (its span is checked)."""
        runs.sort(key=lambda r: (r.key, r.span))
        if op == TransferOp.PUT:  # the same remote bytes from two local bases
            for k, same_key in itertools.groupby(runs, key=lambda r: r.key):
                mine = list(same_key)
                if len(mine) > 1:
                    rows = np.concatenate([r.array for r in mine])
                    rows = rows[np.argsort(rows[:, 1], kind="stable")]
                    _no_overlap(rows[:, 1], rows[:, 2], f"prepared put to {peer}:{k!r}", "items")
        self.op, self.peer, self.items, self.runs, self._given = op, peer, items, runs, given
        self.one_array = False  # one array of runs between one tensor and one region (of_array)
        self._containers: tuple[np.ndarray, bool] | None = None  # what subset() searches, made at its first call
        self.first_key = runs[0].key if runs else (given or [("", "", 0, 0)])[0][0]
        self.segments = sum(len(r.array) for r in runs)
        self.nbytes = sum(r.nbytes for r in runs)
        self.spans = spans_of((r.key, *_lo_n(r)) for r in runs)
        # One tensor per distinct local storage: a storage given new memory (resize_, set_)
        # since a plan was built makes the plan stale (its native list has the old addresses).
        reps: dict[int, torch.Tensor] = {}
        for r in runs:
            reps.setdefault(r.local.tensor.untyped_storage().data_ptr(), r.local.tensor)
        self._storages = list(reps.values())
        self.cuda_anchors = {t.device.index: t for t in self._storages if t.is_cuda}
        self.single: tuple[torch.Tensor, MemoryKind, str, int] | None = None
        if len(runs) == 1 and len(runs[0].array) == 1:
            (view, offset), = runs[0].pieces()
            self.single = (view, runs[0].local.kind, runs[0].key, offset)

    @classmethod
    def of_items(cls, op: TransferOp, peer: str, items: Sequence[tuple[torch.Tensor, str, int]]) -> RunList:
        """The runs of (local tensor, remote key, remote offset) items.

        Raises:
            TypeError, ValueError: not a non-empty sequence of such tuples. LayoutError: a
                tensor not contiguous. BoundsError: an offset out of range, or (a put) two items
                writing the same remote bytes.
        """
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
        return cls(op, peer, len(given), runs, given)

    @classmethod
    def of_array(cls, op: TransferOp, peer: str, tensor: torch.Tensor, key: str, runs: object) -> RunList:
        """The runs ``runs`` (see :func:`check_runs`) between ``tensor`` and the peer's region
        ``key``.

        Raises:
            As :func:`check_runs`; TypeError, LayoutError for the tensor or key.
        """
        tensor = check_tensor(tensor, "tensor")
        if not tensor.is_contiguous():
            raise LayoutError("a prepared transfer's tensor must be contiguous (its bytes are read or written in "
                              "place at every start)")
        if not isinstance(key, str) or not key:
            raise TypeError("key must be a non-empty str")
        array = check_runs(op, tensor, runs, f"prepared {op.value} to {peer}:{key!r}")
        flat = tensor.reshape(-1) if tensor.numel() else tensor.new_empty(0)
        kind = memory_kind(tensor, "tensor")
        # No bytes to move (every run empty): the region is still checked, as an empty item.
        given = None if len(array) else [(key, dtype_name(tensor.dtype), 0, 0)]
        lists = [Runs(LocalBuffer(flat, kind), key, array)] if len(array) else []
        made = cls(op, peer, len(runs), lists, given)  # type: ignore[arg-type]
        made.one_array = True
        return made

    def subset(self, rows: object) -> RunList:
        """The run list of one start that moves only ``rows`` of these runs' bytes (see
        ``PreparedTransfer.start``): rows ``(local offset, remote offset, nbytes)``, each inside
        one of these runs at the same place on both sides (so inside the local tensor and the
        remote bytes these runs were checked for), empty ones dropped, the rest in remote order
        and coalesced. Checked vectorised, one binary search a row; nothing else is checked
        again. Only for a run list of one array (:meth:`of_array`).

        Raises:
            ValueError: not a run list of one array; no rows, or none with bytes.
            TypeError: ``rows`` is not an integer array of shape (N, 3).
            BoundsError: a row negative, misaligned, outside every run, or (a put) two rows
                writing the same remote bytes.
        """
        if not self.one_array:
            raise ValueError("a start with runs= needs a prepared transfer of one array of runs (prepare_put_runs / "
                             "prepare_get_runs)")
        key = self.runs[0].key if self.runs else self.first_key
        what = f"a start of prepared {self.op.value} to {self.peer}:{key!r}"
        if not self.runs:  # nothing was prepared: no row lies inside it
            raise BoundsError(f"{what}: its prepared runs are all empty, so no run lies inside them")
        mine = self.runs[0]
        a = _rows(rows, mine.local.tensor, what)
        a = a[a[:, 2] > 0]
        if len(a) == 0:
            raise ValueError(f"{what}: no run has bytes to move")
        if self._containers is None:
            self._containers = _containers(mine.array)
        outside = _outside(*self._containers, a)
        if outside.any():
            i = int(np.argmax(outside))
            raise BoundsError(f"{what}: run (local {int(a[i, 0])}, remote {int(a[i, 1])}, {int(a[i, 2])} bytes) lies "
                              "inside none of its prepared runs")
        made = RunList(self.op, self.peer, len(a), [Runs(mine.local, mine.key, _ordered(self.op, a, what, "runs"))],
                       None)
        made.one_array = True
        return made

    def memory(self) -> tuple[int, ...]:
        """Where the local storages are now: a plan built for other addresses is stale."""
        return tuple(t.untyped_storage().data_ptr() for t in self._storages)

    def check(self, record: PeerRecord) -> list[tuple[Runs, RegionRecord]]:
        """The runs, each with the region of ``record`` it goes to, checked against it.

        Raises:
            RegistrationError, ReadOnlyRegionError, DTypeMismatchError, BoundsError: as a
                single put/get would, for the first item that fails (given order); for an array
                of runs, for the span they cover.
        """
        if self._given is None:  # one region: the span's check covers every run
            for r in self.runs:
                lo, hi = r.span
                check(self.op, record.name, r.key, record.regions.get(r.key), dtype_name(r.local.tensor.dtype), lo,
                      hi - lo, known=record.regions.keys())
        for key, dtype, offset, n in self._given or ():  # the items as given, so that errors name them
            check(self.op, record.name, key, record.regions.get(key), dtype, offset, n, known=record.regions.keys())
        return [(r, record.regions[r.key]) for r in self.runs]


def _lo_n(r: Runs) -> tuple[int, int]:
    lo, hi = r.span
    return lo, hi - lo
