"""A prepared transfer's runs cut into PUTR / GETR frames (made once, when it is prepared):
small runs staged (packed by one native copy job), larger ones as views received in place;
for striping, frames of about ``most`` bytes, long runs cut to fit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._tensors import Runs, dtype_name
from ..._wire import RegionRecord
from ._frames import MAX_RUN_GROUPS, MAX_STAGED_BYTES, RunsRequest

FRAME_RUNS = 16384  # runs per PUTR / GETR frame (a 256 KiB binary table)
FRAME_META = 256 << 10  # bytes of a PUTR / GETR frame's group table (well under MAX_META)
STAGE_RUN_MAX = 64 << 10  # runs up to this size travel staged (packed by one native copy job)


@dataclass(frozen=True)
class RunsFrame:
    """One PUTR / GETR frame of a prepared array of runs: staged (``copies``: the rows of its
    native copy job, staging offsets in the first column) or in place (``views``); ``nbytes``:
    its data bytes."""

    meta: dict[str, Any]
    table: memoryview
    copies: np.ndarray | None
    nbytes: int
    views: list[memoryview]


def build_frames(lists: Sequence[tuple[Runs, RegionRecord]], most: int | None) -> list[RunsFrame]:
    """The frames of ``lists`` (each array of runs and its region): every frame led by its
    binary run table, made here from the arrays' columns. With ``most`` (a multiple of every
    element size), each in-place frame holds less than ``2 * most`` bytes, runs longer than
    ``most`` cut to fit (chunks to stripe); else frames are as large as the frame limits allow."""
    names = [(region.key, dtype_name(r.local.tensor.dtype)) for r, region in lists]
    cost = np.array([len(k.encode()) + len(d.encode()) + 32 for k, d in names], dtype=np.int64)
    addresses = np.array([r.local.address for r, _ in lists], dtype=np.int64)
    frames: list[RunsFrame] = []
    for staged in (True, False):
        parts = [(i, r.array[(r.array[:, 2] <= STAGE_RUN_MAX) == staged]) for i, (r, _) in enumerate(lists)]
        parts = [(i, rows) for i, rows in parts if len(rows)]
        if not parts:
            continue
        rows = np.concatenate([rows for _, rows in parts])
        owner = np.concatenate([np.full(len(rows), i, dtype=np.int64) for i, rows in parts])
        if most is not None and not staged:
            rows, owner = split_runs(rows, owner, most)
        for chunk, whose in cut_frames(rows, owner, cost, staged, None if staged else most):
            starts = np.flatnonzero(np.diff(whose, prepend=-1))
            counts = np.diff(starts, append=len(whose)).tolist()
            groups = tuple((*names[i], n) for i, n in zip(whose[starts].tolist(), counts, strict=True))
            table = memoryview(np.ascontiguousarray(chunk[:, 1:], dtype="<i8").tobytes())
            meta = RunsRequest(groups, staged).to_meta()
            nbytes = int(chunk[:, 2].sum())
            if staged:  # (staging offset, local address, nbytes): the copy job, less the buffer's address
                at = np.cumsum(chunk[:, 2]) - chunk[:, 2]
                job = np.stack([at, chunk[:, 0] + addresses[whose], chunk[:, 2]], axis=1)
                frames.append(RunsFrame(meta, table, job, nbytes, []))
            else:
                views = {i: lists[i][0].local.view for i in set(whose.tolist())}
                cuts = [views[i][a : a + n] for (a, _, n), i in zip(chunk.tolist(), whose.tolist(), strict=True)]
                frames.append(RunsFrame(meta, table, None, nbytes, cuts))
    return frames


def split_runs(runs: np.ndarray, owner: np.ndarray, most: int) -> tuple[np.ndarray, np.ndarray]:
    """``runs`` (and their ``owner``) with every run longer than ``most`` bytes cut into runs
    of ``most`` (a multiple of every element size) and the rest."""
    pieces = (runs[:, 2] + most - 1) // most
    if (pieces <= 1).all():
        return runs, owner
    which = np.repeat(np.arange(len(runs)), pieces)
    nth = np.arange(len(which)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    out = runs[which].copy()
    out[:, 0] += nth * most
    out[:, 1] += nth * most
    out[:, 2] = np.minimum(most, runs[which, 2] - nth * most)
    return out, owner[which]


def cut_frames(runs: np.ndarray, owner: np.ndarray, cost: np.ndarray, staged: bool,
               most: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """``runs`` (``owner[i]``: the index of the list run ``i`` came from) cut into frames of at
    most ``FRAME_RUNS`` runs, at most MAX_RUN_GROUPS groups, a group table of at most
    ``FRAME_META`` bytes (``cost``: a list's bytes in it), staged, at most MAX_STAGED_BYTES
    of data (every staged run is at most ``STAGE_RUN_MAX``), and with ``most`` (runs of at
    most that), a new frame where the bytes before a run cross a multiple of ``most`` (a frame
    then holds less than ``2 * most``). A list cut by a frame boundary starts a group again in
    the next frame, hence the one group (and one cost) of slack."""
    count = np.arange(len(runs)) // FRAME_RUNS
    new = np.diff(owner, prepend=-1) != 0
    groups = (np.cumsum(new) - 1) // (MAX_RUN_GROUPS - 1)
    meta = np.cumsum(np.where(new, cost[owner], 0)) // (FRAME_META - int(cost.max()))
    edges = (np.diff(count) != 0) | (np.diff(groups) != 0) | (np.diff(meta) != 0)
    if staged:
        before = np.cumsum(runs[:, 2]) - runs[:, 2]
        edges |= np.diff(before // (MAX_STAGED_BYTES - STAGE_RUN_MAX)) != 0
    if most is not None:
        before = np.cumsum(runs[:, 2]) - runs[:, 2]
        edges |= np.diff(before // most) != 0
    cuts = np.flatnonzero(edges) + 1
    return list(zip(np.split(runs, cuts), np.split(owner, cuts), strict=True))
