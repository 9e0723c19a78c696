"""The delta codec's wire formats, versioned by their magics: what a stream publisher and a mesh
trainer rank write beside a subscriber's slot, and what the subscriber reads before it trusts a
byte. Pure data: no I/O, no threads.

* The **stream** form (``STREAM_MAGIC``, "WDLT1"; :mod:`.encode` writes it, :mod:`.apply` reads
  it): an index region of ``HEADER_WORDS`` int64 words (magic, version, base version, entries),
  then ``ENTRY_WORDS`` per tensor of the layout (kind, changed, position bytes, payload bytes,
  base checksum, new checksum, base terms); each sparse tensor's encoding lies in its own byte
  range of the slot. Kind 4 (VARSTEP: steps from the base values, 2-byte elements) was added
  within "WDLT1" on 2026-12-06: a reader from before refuses it (an unknown kind) and pulls
  the version dense.
* The **mesh** form (``MESH_MAGIC``, "WLDM1"; :mod:`.runs`): a table of ``TABLE_WORDS`` per
  trainer rank (rank, offset, cap) in the read-only ``dtab`` region, and per trainer rank a
  sub-area of a ``HEAD_BYTES`` header then its payload.

Checksums are unsigned 64-bit sums carried in int64 words (:func:`signed` / :func:`unsigned`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..._native import delta as native
from .._layout import Layout

Kind = native.Kind  # how one tensor travels: unchanged, dense, varint, bitmask or varstep
# The kinds that carry a payload of changes: values (or, VARSTEP, steps from the values they
# replace, for 2-byte elements) and their positions (csrc/delta.h has the layouts).
SPARSE_KINDS = frozenset({Kind.VARINT, Kind.BITMASK, Kind.VARSTEP})

MASK64 = (1 << 64) - 1
SPARSE_MAX = 0.5  # a sparse encoding is used only up to this fraction of the tensor's dense bytes

# -- the stream form ------------------------------------------------------------------------------

STREAM_MAGIC = 0x31_54_4C_44_57  # "WDLT1"
HEADER_WORDS = 4  # magic, version, base version, entries
ENTRY_WORDS = 7  # kind, changed, position bytes, payload bytes, base checksum, new checksum, base terms


def index_bytes(layout: Layout) -> int:
    """Bytes of a stream's delta index region (its header) for ``layout``."""
    return 8 * (HEADER_WORDS + ENTRY_WORDS * len(layout.entries))


# -- the mesh form --------------------------------------------------------------------------------

MESH_MAGIC = 0x31_4D_44_4C_57  # "WLDM1"
HEAD_BYTES = 64  # a trainer rank's sub-area header
TABLE_WORDS = 3  # per trainer rank: rank, offset, cap


def area_table(sent: Mapping[int, int]) -> tuple[np.ndarray, int]:
    """The delta area of a slot fed ``sent[t]`` bytes by each trainer rank ``t``.

    Returns:
        The table (int64 rows ``(rank, offset, cap)``, by rank) and the area's size in bytes.
    """
    rows, at = [], 0
    for t in sorted(sent):
        cap = int(sent[t] * SPARSE_MAX) // 64 * 64
        rows.append((t, at, cap))
        at += HEAD_BYTES + cap
    return np.array(rows, dtype=np.int64).reshape(-1, TABLE_WORDS), max(at, HEAD_BYTES)


def read_table(raw: torch.Tensor, area_bytes: int) -> dict[int, tuple[int, int]]:
    """Trainer rank -> (offset, cap) from a generator rank's table (a peer's bytes: entries
    that do not fit its area, or overlap another, are dropped)."""
    words = raw.view(torch.int64).numpy().reshape(-1, TABLE_WORDS) if raw.numel() % (8 * TABLE_WORDS) == 0 else None
    out: dict[int, tuple[int, int]] = {}
    if words is None:
        return out
    end = 0
    for t, off, cap in sorted((int(a), int(b), int(c)) for a, b, c in words):
        if off < end or off % 64 or cap < 0 or cap % 64 or off + HEAD_BYTES + cap > area_bytes:
            continue
        out[t] = (off, cap)
        end = off + HEAD_BYTES + cap
    return out


# -- checksums in int64 words -----------------------------------------------------------------------


def signed(x: int) -> int:
    """An unsigned 64-bit value as the int64 word that carries it."""
    return x - (1 << 64) if x >= 1 << 63 else x


def unsigned(x: int) -> int:
    """An int64 word as the unsigned 64-bit value it carries."""
    return x & MASK64
