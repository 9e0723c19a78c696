"""The control protocol of a weight-sync stream: region names, control blocks, front words.

Both sides publish a small control block (``int64[CTL_WORDS]``) next to their data:

* the publisher's (``pubctl``, read-only to peers): ``FRONT`` (its newest complete snapshot),
  ``LAYOUT_ID``, ``FILLING`` (a newer version whose snapshot is still being filled),
  ``LATEST`` (the newest version it has begun to push), ``DIFFING`` (deltas may come) and one
  generation counter per snapshot at ``GEN0 + slot``: odd while the snapshot is being written,
  so a one-sided reader (``pull``) keeps a copy only if the counter was even and did not move
  during its read (a seqlock);
* each subscriber's (``ctl``, written by the publisher): ``FRONT`` (its newest complete slot),
  ``READING`` (the slot being read: copy mode while applying, zero-copy mode the slot the model
  lives in), ``APPLIED``, ``LAYOUT_ID``, ``TRYING`` (the slot a zero-copy apply is claiming) and
  ``DELTA`` (1: it takes delta versions, :mod:`transport.weights._codec`).

A front word packs (version, slot) into one aligned 8-byte store, so a reader never sees one
without the other. Flags written by one side and read by the other are ordered with
:func:`memory_barrier` (the classic two-flag handshake; a reader's side of it on a slot is
:func:`claim` and :func:`release`).

A subscriber on the publisher's host reads the publisher's block through its own read-only
mapping of it (:class:`LocalBlock`): without the network, from any thread, and after the
publisher has gone (the mapping keeps what it wrote last).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .._errors import TransportError
from .._host import process_alive
from .._native import memory_fence
from .._wire import TransferOp

if TYPE_CHECKING:
    from .. import Peer, Transport
    from .._wire import PeerRecord
    from ..backends import Backend
    from ..backends._base import Mover

# Word indices. Subscriber control block (DELTA: 1 when it takes delta versions):
FRONT, READING, APPLIED, LAYOUT_ID, TRYING, DELTA = 0, 1, 2, 3, 4, 5
# Publisher control block: FRONT, LAYOUT_ID, the generation of snapshot s at GEN0 + s,
# FILLING: a version whose snapshot is being filled in the background (0: none), which a
# puller waits for rather than taking the older FRONT, and LATEST: the newest version it has
# begun to push, which bounds the versions a subscriber accepts (only the publisher writes
# its block; any peer can write a subscriber's).
FILLING = 1
LATEST = 2  # the newest version the publisher has begun to push (set before any push of it)
# DIFFING: 1 while the publisher's next version may go to some subscriber as a delta (its
# measurements say one may pay there); its subscribers checksum their weights ahead of a delta
# in the background after a dense apply only then (else at the first delta, in its apply).
DIFFING = 3
GEN0 = 4
CTL_WORDS = 8
NO_SLOT = -1  # READING / TRYING / APPLIED when nothing is being read, claimed or applied


def encode_front(version: int, slot: int) -> int:
    """The front word for ``slot`` holding ``version``: ``((version << 2) | slot) + 1``.

    0 stays "nothing yet"; two bits of slot cover copy mode's two slots and zero-copy's three.
    """
    return ((version << 2) | slot) + 1


def decode_front(word: int, nslots: int = 4) -> tuple[int, int] | None:
    """(version, slot) of a front word, or None for "nothing yet" and for a word naming a
    slot past ``nslots`` (any peer may write a subscriber's words: they are range-checked)."""
    if word <= 0:
        return None
    word -= 1
    if (word & 3) >= nslots:
        return None
    return word >> 2, word & 3


def publisher_latest(pubctl: torch.Tensor) -> int:
    """The newest version a publisher's control block vouches for: what it has begun to push,
    what its snapshots hold or are being filled with (0: nothing yet)."""
    front = decode_front(int(pubctl[FRONT]))
    return max(int(pubctl[LATEST]), int(pubctl[FILLING]), front[0] if front is not None else 0)


class LocalBlock:
    """A same-host peer's read-only control block (``Transport.empty(..., writable=False)``:
    only its owner writes it), read here without the network.

    Reads go through the ``ipc`` backend's synchronous path (``Backend.mover``): a copy out of
    this process's read-only mapping of the owner's memfd, or else one cross-memory-attach read.
    Each word is read on its own, with one aligned 8-byte load, so a word the owner stores
    meanwhile is seen whole. Any thread may read. The mapping lives as long as this object, so
    once the owner has exited, crashed or closed, :meth:`read` still returns the last words it
    wrote (over cross-memory attach it returns None then).

    Make one with :meth:`of`, on the event loop.
    """

    def __init__(self, ipc: Backend, record: PeerRecord, move: Mover, words: int) -> None:
        self._ipc, self._record, self._move, self._words = ipc, record, move, words

    @classmethod
    def of(cls, transport: Transport, peer: Peer, key: str, words: int) -> LocalBlock | None:
        """``peer``'s read-only int64 region ``key`` of at least ``words`` words, as published in
        ``peer`` (what ``Transport.peer``/``lookup`` returned); None where it cannot be read
        here without the network: the Transport has no ``ipc`` backend, the peer is on another
        host, the region is not such a block, or neither a mapping nor cross-memory attach is
        permitted."""
        # The one place weight sync reaches below the Transport's API: its same-host backend's
        # synchronous path, for the record the Transport resolved.
        ipc = next((b for b in transport._backends if b.same_host), None)
        record: PeerRecord = peer._record
        region = record.regions.get(key)
        if (ipc is None or region is None or region.writable or region.device != "cpu" or region.dtype != "int64"
                or region.nbytes < 8 * words):
            return None
        move = ipc.mover(TransferOp.GET, record, region)
        return None if move is None else cls(ipc, record, move, words)

    @property
    def incarnation(self) -> str:
        """The owner's incarnation this block belongs to."""
        return self._record.incarnation

    def read(self) -> torch.Tensor | None:
        """The block's words now (int64), or None when it cannot be read any more."""
        out = torch.zeros(self._words, dtype=torch.int64)
        base = out.data_ptr()
        for i in range(self._words):
            if self._move(base + 8 * i, 8 * i, 8) is not True:
                return None
        return out

    def current(self) -> bool:
        """Whether the owner still publishes this very block: its process lives and its
        Transport's record is still the one the block was found in (the ``ipc`` control page
        says so with one load). False once it exited, crashed, closed its Transport or
        published another record (the block may have been replaced: ask it again)."""
        record = self._record
        try:
            return process_alive(record.pid, record.pid_start) and self._ipc.live_seq(record) == record.seq
        except Exception:  # noqa: BLE001 - a closed Transport's backend: not known to be current
            return False


def free_slot(ctl: torch.Tensor, nslots: int) -> int | None:
    """A subscriber slot the publisher may write, given a copy of the subscriber's control block.

    Not the front (the newest complete version, which the subscriber may apply at any moment),
    not the one it reads or lives in, not the one a zero-copy apply is claiming.

    Returns:
        The lowest such slot index, or None when every slot is taken (the publisher waits).
    """
    front = decode_front(int(ctl[FRONT]))
    busy = {int(ctl[READING]), int(ctl[TRYING])} | ({front[1]} if front is not None else set())
    return next((s for s in range(nslots) if s not in busy), None)


def memory_barrier() -> None:
    """A full CPU memory barrier (sequentially consistent fence) in this thread.

    Orders this thread's store of a flag before its next load of the other side's flag. Not to
    be confused with ``Transport.fence()``, which waits for earlier transfers to a peer.
    """
    memory_fence()


def claim(ctl: torch.Tensor, at: int, slot: int, front_at: int, front: int) -> bool:
    """The reader's half of the two-flag handshake on its own control block ``ctl``.

    Announces in ``ctl[at]`` that it reads ``slot``, then reads the front word ``ctl[front_at]``
    again. When that still is ``front`` (the word the slot was chosen by), the slot is the
    reader's until :func:`release`: a writer stores its own flag before it reads the
    announcement, and keeps out of an announced slot. Otherwise the writer moved on meanwhile:
    the announcement is withdrawn (``NO_SLOT``) and False returned (choose from the new front).
    Both subscribers, stream and mesh, claim their slots this way.
    """
    ctl[at] = slot
    memory_barrier()
    if int(ctl[front_at]) == front:
        return True
    ctl[at] = NO_SLOT
    return False


def release(ctl: torch.Tensor, at: int) -> None:
    """Ends a :func:`claim`: the reads of the slot are ordered before the store that frees it."""
    memory_barrier()
    ctl[at] = NO_SLOT


@dataclass(frozen=True)
class StreamKeys:
    """The region and signal names of one stream (``wsync.<name>.*``)."""

    layout: str  # publisher: the encoded Layout
    pubctl: str  # publisher: its control block
    snapshots: tuple[str, str]  # publisher: the two packed snapshots
    ctl: str  # subscriber: its control block
    slots: tuple[str, str, str]  # subscriber: slots 0 and 1; slot 2 for zero-copy subscribers only
    deltas: tuple[str, str]  # subscriber: the delta header of slot 0 and 1 (subscribers that take deltas)
    doorbell: str  # subscriber: the signal rung with each complete version
    relay: str  # subscriber: its relay block (subscribers that take part in relays; ._relay_block)
    relay_wake: str  # subscriber: the signal rung with each relay order
    relay_ack: str  # publisher: the signal a member rings once it acknowledged an order

    @classmethod
    def of(cls, name: str) -> StreamKeys:
        """The keys of the stream called ``name``."""
        p = f"wsync.{name}."
        return cls(
            layout=p + "layout",
            pubctl=p + "pubctl",
            snapshots=(p + "snap0", p + "snap1"),
            ctl=p + "ctl",
            slots=(p + "slot0", p + "slot1", p + "slot2"),
            deltas=(p + "delta0", p + "delta1"),
            doorbell=p + "version",
            relay=p + "relay",
            relay_wake=p + "relaywake",
            relay_ack=p + "relayack",
        )


async def read_words(transport: Transport, peer: str, key: str, words: int, *,
                     timeout: float | None = None) -> torch.Tensor:
    """The first ``words`` int64 control words of ``peer``'s region ``key``, read now
    (one-sided: the peer does nothing).

    Raises:
        TransportError: they cannot be read (the peer left, or did not answer within
            ``timeout``: default, the Transport's).
    """
    out = torch.empty(words, dtype=torch.int64)
    await transport.get(out, peer, key=key, timeout=timeout)
    return out


def withdraw(transport: Transport, keys: Iterable[str]) -> None:
    """Unregisters ``keys`` in order; a closed Transport has withdrawn them already.

    Args:
        transport: the Transport the keys are registered with.
        keys: region keys.
    """
    for key in keys:
        try:
            transport.unregister(key)
        except TransportError:
            pass
