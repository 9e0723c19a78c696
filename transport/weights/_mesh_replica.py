"""One generator rank's view of its mesh replica and of the trainer ranks that feed it.

:meth:`ReplicaView.now` is one look at the store: the ranks of the replica, the trainer ranks,
the trainer layout (read once per trainer incarnation) and the replica's plan (made here from
the published layouts, reused while they are unchanged). Trainer ranks need not be there: when
they have all left, the layout read last stands, so that what they completed into the slots
before they left can still be committed. :meth:`ReplicaView.runs` binds this rank's part of the
plan to byte runs, and :meth:`ReplicaView.trainer_words` is the one read of a trainer rank's
control words.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .._errors import ClosedError, CommitError, TransportError
from ..plan import MAX_LAYOUT_BYTES, GeneratorRank, Planner, RankPlan, Replica, ReplicaPlan, decode_trainer
from ._binding import Offsets, byte_runs, snapshot_layout
from ._control import read_words
from ._mesh_control import TCTL_WORDS, MeshKeys
from ._mesh_peers import MeshPeers

if TYPE_CHECKING:
    import numpy as np

    from .. import Peer, Transport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaNow:
    """This replica as the store lists it now (see :meth:`ReplicaView.now`)."""

    ranks: dict[int, str]  # rank of the replica -> peer name
    plans: list[RankPlan]  # per rank of the replica
    trainers: dict[int, str]  # trainer rank -> peer name
    planner: Planner  # of the trainer layout


class ReplicaView:
    """Rank ``rank`` of replica ``replica`` (``size`` ranks) of the stream ``name``, needing
    ``layout``, whose slot holds tensor name -> ``offsets`` (byte offset, size)."""

    def __init__(self, transport: Transport, name: str, *, replica: str, rank: int, size: int,
                 layout: GeneratorRank, offsets: Offsets) -> None:
        self.t, self.name, self.keys = transport, name, MeshKeys.of(name)
        self.replica, self.rank, self.size = replica, rank, size
        self.layout, self._offsets = layout, offsets
        self._members = MeshPeers(transport, self.keys)
        # The trainer layout's planner, keyed by the trainer rank it was read from (name, incarnation).
        self._trainer: tuple[tuple[str, str], Planner] | None = None
        self._plan: ReplicaPlan | None = None

    async def now(self) -> ReplicaNow:
        """One look at the store: this replica's ranks, its plan (made here from the published
        layouts, reused while they are unchanged) and the trainer ranks.

        The trainer layout is read once per trainer incarnation. When no trainer rank is listed
        (they all left: exited, crashed, restarting) or its layout cannot be read any more, the
        one read last is used: what trainer ranks completed into the slots before they left
        can still be committed. ``trainers`` then lists only those still listed.

        Raises:
            CommitError: a rank of the replica is not listed; or no trainer rank is listed (or
                its layout cannot be read) and none was ever seen here.
        """
        members = await self._members.scan()
        if members.trainers:
            await self._read_trainer_layout(members.trainers[min(members.trainers)])
        if self._trainer is None:
            raise CommitError(f"{self.replica}/{self.rank}: no trainer rank of stream {self.name!r} in the store")
        planner = self._trainer[1]
        ranks = {rl.rank: n for n, (_, rl) in members.generators.items() if rl.replica == self.replica}
        missing = [r for r in range(self.size) if r not in ranks]
        if missing:
            raise CommitError(f"replica {self.replica}: ranks {missing} are not in the store")
        layouts = tuple(self.layout if r == self.rank else members.generators[ranks[r]][1].layout
                        for r in range(self.size))
        # Tie-broken by the host of its rank 0, as the trainer ranks plan it (MeshPublisher).
        balance = members.generators[ranks[0]][0].host
        self._plan = planner.plan_replica(Replica(self.replica, layouts, balance=balance), self._plan)
        return ReplicaNow(ranks, list(self._plan.ranks), {r: p.name for r, p in members.trainers.items()}, planner)

    async def _read_trainer_layout(self, source: Peer) -> None:
        """Reads ``source``'s trainer layout unless it is the one read last. A trainer rank that
        is gone by now (its record still listed after a crash) leaves the one read last in place.

        Raises:
            CommitError: it publishes no layout, or one of a bad size, or it cannot be read and
                none was read before.
        """
        if self._trainer is not None and self._trainer[0] == (source.name, source.incarnation):
            return
        if self.keys.trainer not in source.regions:
            raise CommitError(f"{self.replica}/{self.rank}: trainer {source.name} publishes no layout")
        nbytes = source.regions[self.keys.trainer].nbytes
        if not 0 < nbytes <= MAX_LAYOUT_BYTES:  # sized from a record: checked before anything is allocated
            raise CommitError(f"{self.replica}/{self.rank}: trainer {source.name} publishes a {nbytes}-byte layout")
        raw = torch.empty(nbytes, dtype=torch.uint8)
        try:
            await self.t.get(raw, source.name, key=self.keys.trainer)
        except ClosedError:
            raise
        except TransportError as exc:
            if self._trainer is not None:
                log.info("%s/%s: trainer %s's layout cannot be read (%s): using the one read before", self.replica,
                         self.rank, source.name, exc)
                return
            raise CommitError(f"{self.replica}/{self.rank}: trainer {source.name}'s layout cannot be read: "
                              f"{exc}") from exc
        self._trainer = ((source.name, source.incarnation), Planner(decode_trainer(raw.numpy().tobytes())))

    def runs(self, planner: Planner, mine: RankPlan) -> dict[int, np.ndarray]:
        """Trainer rank -> its byte runs into this rank under the plan (``(snapshot offset,
        slot offset, nbytes)`` rows)."""
        local = {lt.name: lt for lt in self.layout.tensors}
        return {t: byte_runs(planner, (m for m in mine.moves if m.src == t), local,
                             snapshot_layout(planner.trainer, t)[1], self._offsets) for t in mine.sources()}

    async def trainer_words(self, peer: str) -> torch.Tensor:
        """Trainer rank ``peer``'s control words now (``TCTL_WORDS``; only it writes them).

        Raises:
            TransportError: it cannot be read (it left, or does not answer).
        """
        return await read_words(self.t, peer, self.keys.tctl, TCTL_WORDS)
