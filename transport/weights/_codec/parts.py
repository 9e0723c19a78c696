"""The runs of a delta version as the diff hands them to the pushes: the buffers they are sent
from (:class:`Source`), and the collector that hands them out a part at a time while the rest
is diffed (:class:`Parts`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

# A publisher whose diff leaves cores free has it hand out the encodings in about this many parts
# (see DeltaEncoder.encode), so that the pushes send them while it diffs the rest. Where the diff
# takes every core, the pushes' own work (socket copies, and on one host the receivers') takes
# cores from it: on a 2-core VM over tcp shaped to 10 Gbit/s, 8 parts made the diff of the 100M
# model 1.6-2x slower (31-41 ms against 16-21) and the version no sooner live.
PARTS = 8


@dataclass(frozen=True, eq=False)
class Source:
    """A buffer a delta push sends from: the encoder's staging buffer (the sparse encodings,
    one per encoder, never replaced) or a snapshot (the tensors that travel dense).

    Attributes:
        buffer: the whole buffer (uint8).
        window: int64 ``(N, 3)`` rows (buffer offset, slot offset, nbytes): every run a part
            takes from this buffer lies inside one of them, at the same place on both sides.
            A push prepares one transfer of them per subscriber and slot, and starts it with
            each part's runs (``PreparedTransfer.start(runs=...)``).
    """

    buffer: torch.Tensor
    window: np.ndarray


# What a delta push sends of one part of a version: per source, int64 (N, 3) runs (offset in
# the source, offset in the slot, nbytes), none empty.
Part = list[tuple[Source, np.ndarray]]
Row = tuple[int, int, int]  # one run of a part, as the diff found it


def _part(rows: Mapping[Source, list[Row]]) -> Part:
    return [(source, np.array(r, dtype=np.int64).reshape(-1, 3)) for source, r in rows.items() if r]


class Parts:
    """Collects the runs of the tensors whose diff is done (from any copy thread) and hands
    them to ``ready`` a part at a time: once about ``every`` bytes of the version were diffed
    since the last part (None: not before :meth:`flush`), and at :meth:`flush`. Keeps them all
    (:meth:`runs`)."""

    def __init__(self, ready: Callable[[Part], None] | None, every: int | None) -> None:
        self._ready = ready
        self._every = every
        self._lock = threading.Lock()
        self._pending: dict[Source, list[Row]] = {}
        self._diffed = 0  # bytes of the version diffed since the last part
        self._all: dict[Source, list[Row]] = {}

    def done(self, nbytes: int, source: Source, rows: list[Row]) -> None:
        """A tensor of ``nbytes`` is done; ``rows`` of ``source`` carry it (none when
        unchanged)."""
        with self._lock:  # held while ``ready`` runs: parts go out one at a time, in order
            if rows:
                self._all.setdefault(source, []).extend(rows)
                self._pending.setdefault(source, []).extend(rows)
            self._diffed += nbytes
            if self._every is not None and self._diffed >= self._every:
                self._hand_out(True)

    def flush(self, send: bool) -> None:
        """Every tensor is done: hands out what is left when ``send`` (else keeps it back)."""
        with self._lock:
            self._hand_out(send)

    def _hand_out(self, send: bool) -> None:
        part, self._pending, self._diffed = self._pending, {}, 0
        if part and send and self._ready is not None:
            self._ready(_part(part))

    def runs(self) -> Part:
        """Every run collected, per source."""
        with self._lock:
            return _part(self._all)
