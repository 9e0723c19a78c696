"""The leader's commit of a mesh replica (rank 0 of its generator ranks).

The leader picks the newest version every rank of the replica holds in full in the same slot
and commits it at every rank with the two-flag handshake of :mod:`._mesh_control`: it writes
``PROPOSED`` at every rank, reads every rank's ``DONE`` words again, and writes ``COMMIT`` only
when they still say complete (else it takes the proposal back: a trainer rank began to write
that slot). Any peer can write a generator rank's words, so the trainer ranks' own read-only
control blocks bound what is committed (a scribbled ``DONE`` of 2**60 must not wedge the
replica), and a committed version past them is not trusted: the newest version complete at
every rank replaces it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from .._errors import TransportError
from ._control import decode_front, encode_front, memory_barrier, read_words
from ._mesh_control import COMMIT, PROPOSED, SNAPVER0, ctl_words_for, slot_of, slot_version

if TYPE_CHECKING:
    from ._mesh_replica import ReplicaNow, ReplicaView

log = logging.getLogger(__name__)


class Committer:
    """Commits for the leader whose replica ``view`` shows.

    Owns what it noticed last: the committed version it found past the trainer ranks' (logged
    once per version).
    """

    def __init__(self, view: ReplicaView) -> None:
        self._view = view
        self.t, self.keys, self.replica, self.rank, self.size = view.t, view.keys, view.replica, view.rank, view.size
        self._distrusted: int | None = None  # the last committed version found past the trainers' (logged)

    async def commit(self, now: ReplicaNow, ctl: torch.Tensor) -> int | None:
        """Commits the newest version complete at every rank of ``now`` (``ctl``: the leader's
        own control words), unless the trusted committed version is that new already.

        Returns:
            The committed version (None: none yet).

        Raises:
            TransportError: a rank of the replica could not be read or written (it failed).

        Cancellation: see :meth:`MeshSubscriber.commit` (a proposal may stay behind).
        """
        peers, plans = now.ranks, now.plans
        front = decode_front(int(ctl[COMMIT]))
        current = None if front is None else front[0]
        words = {r: ctl_words_for(plans[r].sources()) for r in range(self.size)}

        async def ctls() -> dict[int, torch.Tensor]:
            return {r: await self._ctl_of(ctl, peers[r], words[r]) for r in range(self.size)}

        newest = await self._trainers_newest(now, {t for r in range(self.size) for t in plans[r].sources()})

        def complete(ctls: Mapping[int, torch.Tensor], slot: int) -> int | None:
            """The version every rank holds in full in ``slot`` (ranks fed by nobody aside), if
            no trainer rank's own read-only control block says it is from the future (any peer
            can write DONE words: a scribbled 2**60 must not wedge the replica)."""
            versions = {slot_version(ctls[r], slot, plans[r].sources()) for r in range(self.size)
                        if plans[r].sources()}
            v = versions.pop() if len(versions) == 1 else None
            return v if v is not None and (newest is None or v <= newest) else None

        # Our COMMIT word is writable by any peer too: a committed version no trainer rank has
        # snapshotted (a scribbled 2**60) holds back no version they vouch for.
        trusted = current if current is None or newest is None or current <= newest else None
        if trusted is None and current is not None and current != self._distrusted:
            self._distrusted = current
            log.warning("%s/%s: committed version %d is past what the trainer ranks have published (%d): "
                        "not trusted; the newest version complete at every rank replaces it", self.replica,
                        self.rank, current, newest)
        seen = await ctls()
        best = max((v for v in (complete(seen, 0), complete(seen, 1)) if v is not None), default=None)
        if best is None or (trusted is not None and best <= trusted):
            return current
        s = slot_of(best)
        word = encode_front(best, s)
        for r in range(self.size):
            await self._write(ctl, peers[r], PROPOSED, word)
        if complete(await ctls(), s) != best:  # look again (two-flag handshake)
            back = encode_front(trusted, slot_of(trusted)) if trusted is not None else 0
            for r in range(self.size):  # a trainer rank started writing that slot: not this time
                await self._write(ctl, peers[r], PROPOSED, back)
            return current
        for r in range(self.size):
            await self._write(ctl, peers[r], COMMIT, word)
        return best

    async def _trainers_newest(self, now: ReplicaNow, sources: set[int]) -> int | None:
        """The newest version any trainer rank of ``sources`` has snapshotted (its own SNAPVER
        words, which only it can write); None when none of them can be read."""
        newest = None
        for t in sorted(sources):
            peer = now.trainers.get(t)
            if peer is None:
                continue
            try:
                tctl = await self._view.trainer_words(peer)
            except TransportError as exc:
                log.debug("%s/%s: cannot read trainer rank %d's control block: %s", self.replica, self.rank, t, exc)
                continue
            v = max(int(tctl[SNAPVER0]), int(tctl[SNAPVER0 + 1])) - 1
            newest = v if newest is None else max(newest, v)
        return newest

    async def _ctl_of(self, ctl: torch.Tensor, peer: str, words: int) -> torch.Tensor:
        """The first ``words`` control words of ``peer`` (a rank of this replica; ``ctl``: ours)."""
        if peer == self.t.name:
            return ctl[:words].clone()
        return await read_words(self.t, peer, self.keys.ctl, words)

    async def _write(self, ctl: torch.Tensor, peer: str, word: int, value: int) -> None:
        """Writes control word ``word`` of ``peer`` (a rank of this replica; ``ctl``: ours)."""
        if peer == self.t.name:
            ctl[word] = value
            memory_barrier()
            return
        await self.t.put(torch.tensor([value], dtype=torch.int64), peer, key=self.keys.ctl, offset=word * 8)
