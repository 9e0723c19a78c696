"""Who takes part in a mesh stream, as the rendezvous lists it now (both sides use it).

Trainer ranks are the peers with the stream's ``tctl`` region (their rank is in its ``TRANK``
word), generator ranks those with its ``rank`` and ``ctl`` regions (their replica, place and
needs are in the ``rank`` region). Each is read once per incarnation of a peer and forgotten
when the peer is no longer listed; a layout that cannot be read or decoded is logged once and
leaves that peer out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import torch

from .._errors import TransferTimeoutError, TransportError
from ..plan._codec import MAX_LAYOUT_BYTES, RankLayout, decode_rank, decode_trainer
from ..plan._layouts import MeshLayoutError, TrainerLayout
from ._mesh_control import MAX_TRAINER_RANKS, TCTL_WORDS, TRANK, MeshKeys

if TYPE_CHECKING:
    from .. import Peer, Transport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeshMembers:
    """One look at the store: trainer rank -> its peer, and generator peer name -> (its peer,
    its layout)."""

    trainers: dict[int, Peer]
    generators: dict[str, tuple[Peer, RankLayout]]


class MeshPeers:
    """The members of the stream ``keys`` names, seen from ``transport``."""

    def __init__(self, transport: Transport, keys: MeshKeys) -> None:
        self.t, self.keys = transport, keys
        self._trainer_ranks: dict[str, tuple[str, int]] = {}  # peer -> (incarnation, trainer rank)
        self._layouts: dict[str, tuple[str, RankLayout | None]] = {}  # peer -> (incarnation, layout)

    async def scan(self) -> MeshMembers:
        """The members now (this process included, when it is one).

        Raises:
            TransportError: the store cannot be read, or a trainer rank's control words.
        """
        listed = set(await self.t.peers())
        self._trainer_ranks = {n: v for n, v in self._trainer_ranks.items() if n in listed}
        self._layouts = {n: v for n, v in self._layouts.items() if n in listed}
        trainers: dict[int, Peer] = {}
        generators: dict[str, tuple[Peer, RankLayout]] = {}
        for n in sorted(listed):
            peer = await self.t.lookup(n)
            if peer is None:
                continue
            if self.keys.tctl in peer.regions:
                rank = self._trainer_ranks.get(n)
                if rank is None or rank[0] != peer.incarnation:
                    words = torch.empty(TCTL_WORDS, dtype=torch.int64)
                    await self.t.get(words, n, key=self.keys.tctl)
                    rank = self._trainer_ranks[n] = (peer.incarnation, int(words[TRANK]) - 1)
                if 0 <= rank[1] < MAX_TRAINER_RANKS:
                    trainers[rank[1]] = peer
            if self.keys.rank in peer.regions and self.keys.ctl in peer.regions:
                layout = self._layouts.get(n)
                if layout is None or layout[0] != peer.incarnation:
                    layout = self._layouts[n] = (peer.incarnation, await self._read(peer))
                if layout[1] is not None:
                    generators[n] = (peer, layout[1])
        return MeshMembers(trainers, generators)

    async def _read(self, peer: Peer) -> RankLayout | None:
        raw = torch.empty(peer.regions[self.keys.rank].nbytes, dtype=torch.uint8)
        try:
            await self.t.get(raw, peer.name, key=self.keys.rank)
            return decode_rank(raw.numpy().tobytes())
        except (TransportError, MeshLayoutError) as exc:
            log.warning("%s: cannot use %s's generator layout (%s): %s", self.t.name, peer.name, self.keys.rank, exc)
            return None


_LOOK_S = 0.1  # read_trainer_layout looks at the store again after this


async def read_trainer_layout(transport: Transport, name: str, *, timeout: float) -> TrainerLayout:
    """The trainer layout of mesh stream ``name``, read from its lowest trainer rank that
    publishes one (waiting for one to be listed), e.g. for a generator that takes its tensor
    list from the trainer.

    Raises:
        TransferTimeoutError: no trainer rank with a readable layout within ``timeout``
            (the message says what was seen).
    """
    keys = MeshKeys.of(name)
    peers = MeshPeers(transport, keys)
    why = f"no trainer rank of stream {name!r} is listed"
    with anyio.move_on_after(timeout):
        while True:
            try:
                members = await peers.scan()
                for r in sorted(members.trainers):
                    peer = members.trainers[r]
                    region = peer.regions.get(keys.trainer)
                    if region is None or not 0 < region.nbytes <= MAX_LAYOUT_BYTES:
                        why = f"trainer rank {r} ({peer.name}) publishes no readable layout"
                        continue
                    raw = torch.empty(region.nbytes, dtype=torch.uint8)
                    await transport.get(raw, peer.name, key=keys.trainer)
                    return decode_trainer(raw.numpy().tobytes())
            except (TransportError, MeshLayoutError) as exc:
                why = str(exc)
            await anyio.sleep(_LOOK_S)
    raise TransferTimeoutError(f"{transport.name}: no trainer layout of stream {name!r} within {timeout:g}s: {why}")
