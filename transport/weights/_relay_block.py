"""The relay block of a stream subscriber: the control words of per-host relays, no I/O.

A subscriber that takes part in relays (``Subscriber(relay=True)``, host slots in copy mode)
registers one int64 region, ``StreamKeys.relay``, with two halves:

* as a **relay** (``S_*``, written by the publisher): the log of the version the publisher is
  pushing into this subscriber for its host. ``S_EPOCH`` names the order the log belongs to,
  rows at ``ROWS`` are the ``(slot offset, nbytes)`` ranges of the relay's slot that are
  complete (each written only after its bytes are in the relay's memory), ``S_COUNT`` how many
  rows are valid, ``S_END`` how the version ended in the relay (:class:`End`).
* as a **member** (``M_*``): the publisher's order to copy version ``M_VERSION`` from relay
  ``M_NAME``'s slot ``M_SRC`` into this subscriber's slot ``M_DST`` as its rows complete, and
  the member's acknowledgement (``M_ACK_EPOCH``, ``M_ACK``: :class:`Ack`). ``M_TAKEOVER``
  asks the member to stop copying (the publisher then pushes to it directly).

The publisher never writes a member's slots while an order to it is not acknowledged, and
makes a member's slot its front only after the member acknowledged ``DONE`` for the very
order of that publish; the member copies only rows of the order's epoch. So a relay that
stalls or dies, or a member that resumes after a stop, can leave nothing half-written that a
subscriber applies.

Every word here can be written by any peer: a member checks every field it reads (slot
indices, row ranges against its slot, the name's length) and refuses an order that does not
fit; the transport's own bounds checks guard every copy as well.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .._errors import TransportError
from .._peers import check_name
from ._layout import Layout

# The relay's half (written by the publisher into the relay's block).
S_EPOCH, S_COUNT, S_END = 0, 1, 2
# The member's half (the order: written by the publisher; the ack: by the member).
M_EPOCH, M_VERSION, M_SRC, M_DST, M_KIND, M_TAKEOVER, M_ACK_EPOCH, M_ACK = 8, 9, 10, 11, 12, 13, 14, 15
M_NAME_LEN, M_NAME = 16, 17
NAME_WORDS = 32  # 256 bytes: the longest peer name
ROWS = M_NAME + NAME_WORDS  # (offset, nbytes) rows from here on


class End(enum.IntEnum):
    """``S_END``: how the version ended in the relay (0 while it is being pushed)."""

    PUSHING = 0
    DENSE = 1  # every byte of the slot is in the logged rows
    DELTA = 2  # the rows hold the encodings; the relay's delta header of that slot is complete


class Ack(enum.IntEnum):
    """``M_ACK``: how a member ended the order ``M_ACK_EPOCH``."""

    DONE = 1  # every row is in its slot (and the delta header, for a delta): ready to be the front
    STOPPED = 2  # it stopped on ``M_TAKEOVER``
    FAILED = 3  # the relay failed, or the order did not fit: nothing of it may be used


def rows_capacity(layout: Layout) -> int:
    """How many rows a relay log of ``layout`` holds: a dense version logs one per bucket, a
    delta version one per tensor (an encoding, or the tensor dense) and its dense buckets."""
    return len(layout.buckets) + len(layout.entries) + 8


def block_words(layout: Layout) -> int:
    """The size of a subscriber's relay block for ``layout``, in int64 words."""
    return ROWS + 2 * rows_capacity(layout)


@dataclass(frozen=True)
class Order:
    """The publisher's order to a member: copy ``version`` from ``relay``'s slot ``src`` into
    the member's slot ``dst`` as the relay's log of ``epoch`` grows. ``extra``: words of the
    form that follow the relay's name (a mesh order's, :class:`MeshOrder`)."""

    epoch: int
    version: int
    relay: str
    src: int
    dst: int
    extra: tuple[int, ...] = ()

    def words(self) -> torch.Tensor:
        """The order as the member's words ``M_EPOCH`` .. the end of ``extra`` (its
        acknowledgement words are left out of the write: they are the member's)."""
        name = self.relay.encode()
        if len(name) > 8 * NAME_WORDS:
            raise TransportError(f"relay name {self.relay!r} is over {8 * NAME_WORDS} bytes")
        out = torch.zeros(ROWS - M_EPOCH + len(self.extra), dtype=torch.int64)
        out[0], out[M_VERSION - M_EPOCH], out[M_SRC - M_EPOCH], out[M_DST - M_EPOCH] = (
            self.epoch, self.version, self.src, self.dst)
        out[M_TAKEOVER - M_EPOCH] = 0  # (the acknowledgement words are the member's: order_spans leaves them out)
        out[M_NAME_LEN - M_EPOCH] = len(name)
        raw = out[M_NAME - M_EPOCH:ROWS - M_EPOCH].view(torch.uint8)
        raw[:len(name)] = torch.frombuffer(bytearray(name), dtype=torch.uint8)
        if self.extra:
            out[ROWS - M_EPOCH:] = torch.tensor(self.extra, dtype=torch.int64)
        return out

    @classmethod
    def read(cls, block: torch.Tensor, nslots: int, extra: int = 0) -> Order | None:
        """The order in a member's own block (or section of it, from its ``M_EPOCH``: ``block``
        starts at word 0 of it), or None when its fields do not fit (a slot past ``nslots``, a
        name of a bad length or not UTF-8). ``extra``: how many words follow the name."""
        n = int(block[M_NAME_LEN])
        src, dst = int(block[M_SRC]), int(block[M_DST])
        if not (0 < n <= 8 * NAME_WORDS and 0 <= src < nslots and 0 <= dst < nslots):
            return None
        try:
            name = check_name(bytes(block[M_NAME:M_NAME + NAME_WORDS].view(torch.uint8)[:n].numpy()).decode())
        except (UnicodeDecodeError, ValueError, TypeError):
            return None
        more = tuple(int(w) for w in block[ROWS:ROWS + extra])
        return cls(int(block[M_EPOCH]), int(block[M_VERSION]), name, src, dst, more)


def order_spans(order: Order, base: int = 0) -> list[tuple[torch.Tensor, int]]:
    """The (words, byte offset in the block) writes that place ``order`` in a member's block
    (in the section that starts at word ``base``), in the order they must land: the order's
    fields, name and extra words first, its epoch last (a member acts on a new epoch only, so
    it never reads a half-written order as one). The member's acknowledgement words are left
    out: the publisher never writes them."""
    w = order.words()
    return [(w[1:M_ACK_EPOCH - M_EPOCH], 8 * (base + M_EPOCH + 1)), (w[M_NAME_LEN - M_EPOCH:], 8 * (base + M_NAME_LEN)),
            (w[:1], 8 * (base + M_EPOCH))]


# -- mesh sync: one section per trainer rank ---------------------------------------------------
#
# A generator rank's relay block (``MeshKeys.relay``) holds one section of ``SECTION_WORDS`` per
# trainer rank below ``RELAY_TRAINER_RANKS``, laid out as a stream block up to its rows, which
# it has none of: a mesh log counts pieces (``S_COUNT``: pieces ``0 .. count - 1`` of the
# trainer rank's runs are in the relay's slot), and the member cuts the same pieces from the
# same runs itself. The order's extra words (``X_*``, after the relay's name) say which runs
# and how they are cut, and for a delta where its payload lies.
X_FPRINT, X_PIECE, X_SRC_OFF, X_DST_OFF, X_NBYTES, X_FLAGS = range(ROWS, ROWS + 6)
MESH_EXTRA = 6
RELAYS_ON = 1  # X_FLAGS: the member is itself a relay (of a chain): it logs what it copied in its own section
SECTION_WORDS = 56
RELAY_TRAINER_RANKS = 1024  # trainer ranks at and past this push to every generator rank directly
MAX_PIECES = 1 << 20  # the most pieces a mesh order may cut its runs into


def mesh_block_words() -> int:
    """The size of a generator rank's relay block, in int64 words."""
    return SECTION_WORDS * RELAY_TRAINER_RANKS


def section(trainer_rank: int) -> int:
    """The first word of ``trainer_rank``'s section in a generator rank's relay block."""
    return SECTION_WORDS * trainer_rank


@dataclass(frozen=True)
class MeshOrder:
    """A mesh order's extra words: the fingerprint of the runs from the trainer rank into
    relay and member alike (:func:`transport.weights._mesh_push.runs_fingerprint`), the piece
    size they are cut by, for a delta the payload's (offset in the relay's delta area, offset
    in the member's, nbytes; all zero for a dense version), and ``flags`` (:data:`RELAYS_ON`:
    the member relays on to others as it copies: it counts each part copied in the ``S_*``
    words of its own section, whose epoch the trainer rank set to the order's, and then how the
    version ended)."""

    fingerprint: int
    piece_bytes: int
    src_off: int = 0
    dst_off: int = 0
    nbytes: int = 0
    flags: int = 0

    def words(self) -> tuple[int, ...]:
        return (self.fingerprint, self.piece_bytes, self.src_off, self.dst_off, self.nbytes, self.flags)

    @classmethod
    def of(cls, extra: tuple[int, ...]) -> MeshOrder:
        return cls(*extra)


def check_rows(rows: torch.Tensor, slot_bytes: int) -> bool:
    """Whether ``(offset, nbytes)`` rows (int64 ``[n, 2]``) all lie inside a slot of
    ``slot_bytes`` (non-negative, non-empty)."""
    if rows.numel() == 0:
        return True
    off, n = rows[:, 0], rows[:, 1]
    return bool(((off >= 0) & (n > 0) & (off <= slot_bytes - n)).all())
