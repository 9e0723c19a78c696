"""A generator rank's intake of mesh deltas: the delta areas beside its two slots.

Trainer ranks whose publisher sends deltas write only the changed units of a version into a
delta area beside the slot it travels in (:mod:`transport.weights._codec.runs`); the rank applies
them into the slot, checked, when it reads the committed version (:meth:`SlotDeltas.materialize`).
The areas are sized by what each trainer rank sends here under the plan, so they are made once
the rank has seen its replica's plan (:meth:`SlotDeltas.make`).

A slot's ``MAT0 + s`` word says which version it holds all of, as this rank made it whole: what
a delta into it may build on (0 while this rank writes the slot itself: :meth:`SlotDeltas.writing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ._codec.format import area_table
from ._codec.runs import Materializer
from ._control import memory_barrier
from ._mesh_control import MAT0, MeshKeys

if TYPE_CHECKING:
    import numpy as np

    from .. import Transport


class SlotDeltas:
    """The delta areas of one generator rank, and the version each slot was last made whole with.

    Args:
        transport: the rank's Transport (registers the areas).
        keys: the stream's region names.
        wanted: take deltas; False, or once the plan says they cannot be taken here: dense only.
    """

    def __init__(self, transport: Transport, keys: MeshKeys, wanted: bool) -> None:
        self.t, self.keys = transport, keys
        self._wanted = wanted
        self._materializer: Materializer | None = None  # the delta areas, once the plan is known
        self._materialized: tuple[int, int] | None = None  # (version, slot) last made whole here
        self._areas: list[torch.Tensor] = []
        self.last: tuple[int, int] = (0, 0)  # of the last version read: (trainer ranks' deltas, units)

    @property
    def awaiting_plan(self) -> bool:
        """Whether deltas are wanted and their areas wait for the replica's plan."""
        return self._wanted and self._materializer is None

    def make(self, slots: Sequence[torch.Tensor], runs: dict[int, np.ndarray]) -> None:
        """Registers the delta areas and their table, sized by ``runs`` (trainer rank -> its byte
        runs into this rank under the plan), beside ``slots``."""
        if not runs or any(bool((r & 1).any()) for r in runs.values()):
            self._wanted = False  # nothing fed here, or odd-sized runs (one-byte elements): dense only
            return
        table, nbytes = area_table({t: int(r[:, 2].sum()) for t, r in runs.items()})
        areas = self._areas = [self.t.empty(k, nbytes, torch.uint8) for k in self.keys.deltas]
        tab = self.t.empty(self.keys.dtab, max(1, table.size) * 8, torch.uint8, writable=False)
        tab.view(torch.int64)[: table.size].copy_(torch.from_numpy(table.reshape(-1)))
        self._materializer = Materializer(slots, areas, {int(t): (int(o), int(c)) for t, o, c in table}, runs)

    def areas(self) -> list[torch.Tensor]:
        """The two delta areas (empty until made, and where deltas are not taken)."""
        return self._areas

    def materialize(self, ctl: torch.Tensor, v: int, s: int) -> None:
        """Applies the deltas of version ``v`` waiting for slot ``s`` (held for reading) into
        it, once: the slot then holds all of ``v``."""
        m = self._materializer
        if m is None or self._materialized == (v, s):
            return
        self.writing(ctl, s)
        memory_barrier()
        m.materialize(v, s)
        self.last = (m.sources_delta, m.applied_units)
        self.whole(ctl, v, s)

    @staticmethod
    def writing(ctl: torch.Tensor, s: int) -> None:
        """Slot ``s`` is written here now: no delta may build on it (``ctl``: this rank's)."""
        ctl[MAT0 + s] = 0

    def clear(self, s: int) -> None:
        """Slot ``s`` was filled whole from the snapshots: no delta waits for it."""
        if self._materializer is not None:
            self._materializer.clear(s)

    def whole(self, ctl: torch.Tensor, v: int, s: int) -> None:
        """Slot ``s`` holds all of version ``v`` now: deltas of the next versions may build on it."""
        self._materialized = (v, s)
        ctl[MAT0 + s] = v + 1
        memory_barrier()
