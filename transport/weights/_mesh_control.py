"""The control protocol of mesh sync (sharded trainer ranks -> TP generator replicas).

Regions of a stream called N (``mesh.N.*``):

* every trainer rank: ``trainer`` (the trainer layout, JSON, read-only; the same on every rank),
  ``tctl`` (``int64[TCTL_WORDS]``, read-only), ``snap0``/``snap1`` (its shards packed at the
  wire dtype, read-only: what restarted generator ranks pull from), and with FP8 tensors
  ``amax0``/``amax1`` (its partial block maxima, float32, read by the other trainer ranks);
* every generator rank: ``rank`` (its replica, place and needs, JSON, read-only), ``ctl``
  (``int64[CTL_WORDS]``, written by trainer ranks and its replica's leader), ``slot0``/``slot1``,
  and with delta sync ``delta0``/``delta1`` (the payloads waiting for each slot, written by
  trainer ranks) with their table ``dtab`` (read-only; see :mod:`._mesh_delta_intake`), and with
  relays ``relay`` (one section of orders and logs per trainer rank: :mod:`._relay_block`,
  :mod:`._mesh_relays`).

Version ``v`` always travels in slot ``v % 2`` (snapshots likewise), so that trainer ranks that
never talk to each other still agree on where it goes.

Generator ``ctl`` words: ``COMMIT`` (the version the replica committed, front-encoded with its
slot), ``READING`` (the slot ``apply()`` is copying, or -1), ``APPLIED`` (``v + 1``),
``PROPOSED`` (the version the leader is about to commit), ``MAT0 + s`` (``v + 1`` once slot
``s`` holds all of version ``v``, as this rank read it: what a delta into it may build on, see
:mod:`._mesh_delta_intake`; 0 while the rank writes the slot itself), and from ``DONE0`` one word per
(trainer rank, slot), the two slots of a trainer rank side by side (so the words of ranks
``0..T-1`` are the first ``2T``, read without the rest): ``v + 1`` once that trainer rank's
bytes of version ``v`` are all in the slot, ``-(v + 1)`` while it is writing them.

The two races that matter are settled by the classic two-flag handshake on words of the same
generator's ``ctl``, each side completing its own write before reading the other's flag:

* a trainer rank marks ``DONE`` as writing, then reads ``PROPOSED``/``COMMIT``/``READING``; if
  the slot is committed or proposed and not yet applied, it restores its word and skips;
* the leader writes ``PROPOSED`` at every rank of its replica, then re-reads every ``DONE``; it
  writes ``COMMIT`` only if all still say complete.

So a committed slot is never written until its rank applied it, and a version is committed only
when every rank of the replica holds all of it.

Trainer ``tctl`` words: ``FRONT`` (newest complete snapshot, front-encoded), ``SNAPVER0 + s``
(``v + 1`` of snapshot ``s``), ``GEN0 + s`` (odd while snapshot ``s`` is being written: a
seqlock for pullers), ``TRANK`` (the trainer rank + 1), ``AMAXVER0 + s`` (``v + 1`` once the
partial FP8 block maxima of version ``v`` are in ``amax<s>``; 0 while they are written).

Where each tensor's bytes lie in the snapshots and slots is the binding's (:mod:`._binding`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

# Generator ctl.
COMMIT, READING, APPLIED, PROPOSED, MAT0 = 0, 1, 2, 3, 4
HEADER_WORDS = 8
MAX_TRAINER_RANKS = 4096
DONE0 = HEADER_WORDS
CTL_WORDS = HEADER_WORDS + 2 * MAX_TRAINER_RANKS
# Trainer tctl.
FRONT, SNAPVER0, GEN0, TRANK, AMAXVER0 = 0, 1, 3, 5, 6
TCTL_WORDS = 8


def done_word(slot: int, trainer_rank: int) -> int:
    """Index of the DONE word of ``trainer_rank`` for ``slot`` in a generator's ctl."""
    return DONE0 + 2 * trainer_rank + slot


def ctl_words_for(sources: Sequence[int]) -> int:
    """How many leading ctl words hold the header and the DONE words of ``sources``."""
    return done_word(1, max(sources)) + 1 if sources else HEADER_WORDS


def slot_version(ctl: torch.Tensor, slot: int, sources: Iterable[int]) -> int | None:
    """The version complete in ``slot`` of a generator rank whose ctl words are ``ctl``: every
    trainer rank of ``sources`` marked the same version of that slot done (None otherwise)."""
    words = {int(ctl[done_word(slot, t)]) for t in sources}
    if len(words) != 1:
        return None
    v = words.pop() - 1
    return v if v >= 0 and slot_of(v) == slot else None


def slot_of(version: int) -> int:
    return version % 2


@dataclass(frozen=True)
class MeshKeys:
    """Region names of the mesh stream called ``name``."""

    trainer: str
    tctl: str
    snaps: tuple[str, str]
    rank: str
    ctl: str
    slots: tuple[str, str]
    amax: tuple[str, str]
    deltas: tuple[str, str]
    dtab: str
    relay: str  # generator rank: its relay block (ranks that take part in relays; ._relay_block)
    relay_wake: str  # generator rank: the signal rung with each relay order
    relay_ack: str  # trainer rank: the signal a member rings once it acknowledged an order

    @classmethod
    def of(cls, name: str) -> MeshKeys:
        p = f"mesh.{name}."
        return cls(p + "trainer", p + "tctl", (p + "snap0", p + "snap1"), p + "rank", p + "ctl",
                   (p + "slot0", p + "slot1"), (p + "amax0", p + "amax1"), (p + "delta0", p + "delta1"), p + "dtab",
                   p + "relay", p + "relaywake", p + "relayack")
