"""The control protocol of a weight-sync stream: region names, control blocks, front words.

Both sides publish a small control block (``int64[CTL_WORDS]``) next to their data:

* the publisher's (``pubctl``, read-only to peers): ``FRONT`` (its newest complete snapshot),
  ``LAYOUT_ID``, ``FILLING`` (a newer version whose snapshot is still being filled) and one
  generation counter per snapshot at ``GEN0 + slot``: odd while the snapshot is being written,
  so a one-sided reader (``pull``) keeps a copy only if the counter was even and did not move
  during its read (a seqlock);
* each subscriber's (``ctl``, written by the publisher): ``FRONT`` (its newest complete slot),
  ``READING`` (the slot being read: copy mode while applying, zero-copy mode the slot the model
  lives in), ``APPLIED``, ``LAYOUT_ID``, ``TRYING`` (the slot a zero-copy apply is claiming) and
  ``DELTA`` (1: it takes delta versions, :mod:`transport.weights._delta`).

A front word packs (version, slot) into one aligned 8-byte store, so a reader never sees one
without the other. Flags written by one side and read by the other are ordered with
:func:`memory_barrier` (the classic two-flag handshake).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .._errors import TransportError
from .._native import memory_fence

if TYPE_CHECKING:
    from .. import Transfer, Transport

# Word indices. Subscriber control block (DELTA: 1 when it takes delta versions):
FRONT, READING, APPLIED, LAYOUT_ID, TRYING, DELTA = 0, 1, 2, 3, 4, 5
# Publisher control block: FRONT, LAYOUT_ID, the generation of snapshot s at GEN0 + s,
# FILLING: a version whose snapshot is being filled in the background (0: none), which a
# puller waits for rather than taking the older FRONT, and LATEST: the newest version it has
# begun to push, which bounds the versions a subscriber accepts (only the publisher writes
# its block; any peer can write a subscriber's).
FILLING = 1
LATEST = 2  # the newest version the publisher has begun to push (set before any push of it)
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
        )


def over_memory(transfer: Transfer) -> bool:
    """Whether ``transfer`` went (in part) over ``ipc``: a link as fast as the memory pass that
    finds a delta, where delta sync does not pay (``delta="auto"`` sends such peers dense)."""
    return "ipc" in (transfer.backend or "").split(",")


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
