"""Who takes part in a mesh stream, as the rendezvous lists it now (both sides use it).

Trainer ranks are the peers with the stream's ``tctl`` region (their rank is in its ``TRANK``
word), generator ranks those with its ``rank`` and ``ctl`` regions (their replica, place and
needs are in the ``rank`` region). Each is read once per incarnation of a peer and forgotten
when the peer is no longer listed. A peer whose record, regions or layout cannot be used is
logged once and left out of the scan; it never fails the scan for the others.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import torch

from .._errors import ClosedError, MalformedRegionError, MeshLayoutError, TransportError
from ..plan import MAX_LAYOUT_BYTES, RankLayout, TrainerLayout, decode_rank, decode_trainer
from ._mesh_control import MAX_TRAINER_RANKS, TCTL_WORDS, TRANK, MeshKeys
from ._polling import PENDING, Pending, poll

if TYPE_CHECKING:
    from .. import Peer, Transport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeshMembers:
    """One look at the store: trainer rank -> its peer, generator peer name -> (its peer, its
    layout), and every peer listed as looked up (None: its record is left by an exited process,
    or unreadable)."""

    trainers: dict[int, Peer]
    generators: dict[str, tuple[Peer, RankLayout]]
    listed: dict[str, Peer | None] = field(default_factory=dict)


class MeshPeers:
    """The members of the stream ``keys`` names, seen from ``transport``."""

    def __init__(self, transport: Transport, keys: MeshKeys) -> None:
        self.t, self.keys = transport, keys
        self._trainer_ranks: dict[str, tuple[str, int]] = {}  # peer -> (incarnation, trainer rank)
        self._layouts: dict[str, tuple[str, RankLayout | None]] = {}  # peer -> (incarnation, layout)
        self._failed: dict[str, tuple[str, float]] = {}  # peer -> (incarnation, not read again before)

    async def scan(self) -> MeshMembers:
        """The members now (this process included, when it is one).

        Each peer is read on its own: one whose record or regions cannot be used (a region of
        the wrong size, control words that cannot be read, a layout that does not decode) is
        left out of this scan, logged and noted in the flight record; it never fails the scan
        for the others. A peer whose reads failed is not read again for ``_RETRY_S`` seconds.

        Raises:
            TransportError: the store's listing cannot be read.
        """
        listed = set(await self.t.peers())
        self._trainer_ranks = {n: v for n, v in self._trainer_ranks.items() if n in listed}
        self._layouts = {n: v for n, v in self._layouts.items() if n in listed}
        self._failed = {n: v for n, v in self._failed.items() if n in listed}
        trainers: dict[int, Peer] = {}
        generators: dict[str, tuple[Peer, RankLayout]] = {}
        looked: dict[str, Peer | None] = {}
        for n in sorted(listed):
            peer: Peer | None = None
            try:
                peer = looked[n] = await self.t.lookup(n)
                if peer is None or self._backing_off(peer):
                    continue
                rank = await self._trainer_rank(peer)
                if rank is not None and 0 <= rank < MAX_TRAINER_RANKS:
                    trainers[rank] = peer
                layout = await self._generator_layout(peer)
                if layout is not None:
                    generators[n] = (peer, layout)
            except ClosedError:
                raise
            except TransportError as exc:
                self._refuse(n, peer.incarnation if peer is not None else "", exc)
        return MeshMembers(trainers, generators, looked)

    def _backing_off(self, peer: Peer) -> bool:
        failed = self._failed.get(peer.name)
        return failed is not None and failed[0] == peer.incarnation and anyio.current_time() < failed[1]

    def _refuse(self, name: str, incarnation: str, exc: BaseException) -> None:
        first = self._failed.get(name, ("", 0.0))[0] != incarnation
        self._failed[name] = (incarnation, anyio.current_time() + _RETRY_S)
        if first:  # once per incarnation: a scan runs every publish and every commit
            stream = self.keys.tctl.rsplit(".", 1)[0]
            log.warning("%s: %s is left out of mesh stream %s: %s", self.t.name, name, stream, exc)
            self.t._flight.event("mesh-peer-refused", name, f"incarnation {incarnation}: {exc}")

    async def _trainer_rank(self, peer: Peer) -> int | None:
        region = peer.regions.get(self.keys.tctl)
        if region is None:
            return None
        rank = self._trainer_ranks.get(peer.name)
        if rank is None or rank[0] != peer.incarnation:
            if region.nbytes != TCTL_WORDS * 8:
                raise MalformedRegionError(f"{peer.name}'s {self.keys.tctl} region holds {region.nbytes} bytes, "
                                           f"not {TCTL_WORDS * 8}")
            words = torch.empty(TCTL_WORDS, dtype=torch.int64)
            await self.t.get(words, peer.name, key=self.keys.tctl)
            rank = self._trainer_ranks[peer.name] = (peer.incarnation, int(words[TRANK]) - 1)
        return rank[1]

    async def _generator_layout(self, peer: Peer) -> RankLayout | None:
        if self.keys.rank not in peer.regions or self.keys.ctl not in peer.regions:
            return None
        layout = self._layouts.get(peer.name)
        if layout is None or layout[0] != peer.incarnation:
            layout = self._layouts[peer.name] = (peer.incarnation, await self._read(peer))
        return layout[1]

    async def _read(self, peer: Peer) -> RankLayout | None:
        nbytes = peer.regions[self.keys.rank].nbytes
        if not 0 < nbytes <= MAX_LAYOUT_BYTES:  # sized from a record: checked before anything is allocated
            log.warning("%s: %s publishes a %d-byte generator layout (%s): left out", self.t.name, peer.name,
                        nbytes, self.keys.rank)
            return None
        raw = torch.empty(nbytes, dtype=torch.uint8)
        try:
            await self.t.get(raw, peer.name, key=self.keys.rank)
            return decode_rank(raw.numpy().tobytes())
        except ClosedError:
            raise
        except (TransportError, MeshLayoutError) as exc:
            log.warning("%s: cannot use %s's generator layout (%s): %s", self.t.name, peer.name, self.keys.rank, exc)
            return None


_RETRY_S = 5.0  # a peer whose reads failed is left out of scans for this long before it is read again
_LOOK_S = 0.1  # read_trainer_layout looks at the store again after this


async def read_trainer_layout(transport: Transport, name: str, *, timeout: float) -> TrainerLayout:
    """The trainer layout of mesh stream ``name``, read from its lowest trainer rank that
    publishes one (waiting for one to be listed), e.g. for a generator that takes its tensor
    list from the trainer.

    Raises:
        TransferTimeoutError: no trainer rank with a readable layout within ``timeout``
            (the message says what was seen).

    Cancellation: nothing is left behind (it only reads).
    """
    keys = MeshKeys.of(name)
    peers = MeshPeers(transport, keys)
    why = f"no trainer rank of stream {name!r} is listed"

    async def look() -> TrainerLayout | Pending:
        nonlocal why
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
        return PENDING

    # Every look scans the store: at a steady pace, not backing off from a fast first one.
    return await poll(look, timeout=timeout, what=f"{transport.name}: no trainer layout of stream {name!r}",
                      why=lambda: why, first=_LOOK_S, longest=_LOOK_S)
