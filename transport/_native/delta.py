"""The native delta-sync primitives (``csrc/delta.h``; ``csrc/delta_*.cpp``): the diff + encode
of one tensor against its previous version, the in-place diff of a snapshot (with the fp32 ->
bf16 cast), the checksum both ends compute, and the bounds-checked scatter of an encoded delta.

Every call takes raw addresses and element counts; the caller owns the memory behind them and
keeps it alive for the call. The GIL is released for each call, so they run in parallel on
copy threads.

``$TRANSPORT_DELTA_ISA`` (``avx512``, ``avx2`` or ``scalar``; unset or ``auto``: the best this CPU
has) forces the vector path of every call made with :data:`Isa.AUTO`, :func:`scatter` included,
for the whole process (read once, at the first such call): benchmarks compare the paths with it.
A path this CPU lacks, or a value that names none, makes each of those calls raise
:class:`TransportInternalError` naming the variable, never run another path.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import TransportInternalError
from ._extension import load


class Kind(enum.IntEnum):
    """How one tensor of a version travels."""

    UNCHANGED = 0  # bit-identical to the base: nothing is sent
    DENSE = 1  # the whole tensor
    VARINT = 2  # changed values + LEB128 gaps between their positions
    BITMASK = 3  # changed values + one bit per element
    VARSTEP = 4  # 2-byte values as signed-byte steps from the values they replace (or escaped) + LEB128 gaps


class Isa(enum.IntEnum):
    """Which vector path runs the diff (``AUTO``: the best this CPU has, or the one
    ``$TRANSPORT_DELTA_ISA`` forces)."""

    AUTO = 0
    SCALAR = 1
    AVX2 = 2
    AVX512 = 3


class Refusal(enum.IntEnum):
    """Why :func:`scatter` refused a payload (``OK``: it did not)."""

    OK = 0
    BAD_KIND = 1
    BAD_SIZE = 2
    OUT_OF_RANGE = 3
    BAD_VARINT = 4
    COUNT_MISMATCH = 5
    BAD_BITMASK = 6
    BAD_ELEM_SIZE = 7
    BAD_STEPS = 8  # more escape steps than the payload's escape count


@dataclass(frozen=True)
class Encoded:
    """What :func:`encode` found and wrote."""

    kind: Kind
    changed: int  # elements that differ from the base (all of them without a base)
    payload_bytes: int  # bytes written at ``out`` (sparse kinds only)
    pos_bytes: int  # of which positions
    checksum: int  # without a base: the fresh tensor's checksum (with one: 0)
    sum_old: int  # with a base: the checksum terms of the base values at the changed positions
    sum_new: int  # and of the fresh values there (fresh's checksum: base's - sum_old + sum_new)


def _call(what: str, fn: str, *args: object) -> Any:
    try:
        return getattr(load(), fn)(*args)
    except (ValueError, RuntimeError) as exc:  # std::invalid_argument: a bad element size or ISA
        raise TransportInternalError(f"{what}: {exc}") from exc


def encode(fresh: int, base: int, snap: int, n: int, es: int, out: int, cap: int, isa: Isa = Isa.AUTO,
           steps: bool = False) -> Encoded:
    """Copies ``n`` elements of ``es`` bytes from ``fresh`` to ``snap`` (0: no copy), compares
    them bit for bit with ``base`` (0: no base, the result is DENSE) and, when the changed
    elements encode into at most ``cap`` bytes, writes the encoding at ``out``. With a base only
    the changed elements are hashed: the fresh checksum is the base's ``- sum_old + sum_new``.
    With ``steps``, 2-byte values go as VARSTEP (steps from the base values) where that form is
    the smaller.

    Raises:
        TransportInternalError: ``es`` is not 2 or 4, or this CPU lacks ``isa``.
    """
    kind, changed, payload, pos, checksum, sum_old, sum_new = _call("delta encode", "delta_encode", fresh, base, snap,
                                                                    n, es, out, cap, int(isa), steps)
    return Encoded(Kind(kind), changed, payload, pos, checksum, sum_old, sum_new)


# uint64s of one encode_many row: (fresh, base, snap, n, es, out, cap, dense_above, stream, varints, steps)
ENCODE_ROW = 11
ENCODE_RESULT = 7  # and of its result: an Encoded's fields, in order


def _uint64s(name: str, a: np.ndarray, shape: tuple[int, ...]) -> None:
    if a.dtype != np.uint64 or a.shape != shape or not a.flags.c_contiguous or not a.flags.writeable:
        raise ValueError(f"{name} must be a writable C-contiguous {shape} uint64 array, not {a.dtype} {a.shape}")


def encode_many(rows: np.ndarray, results: np.ndarray, cursor: np.ndarray, taken: np.ndarray, budget: int | None,
                isa: Isa = Isa.AUTO) -> int:
    """:func:`encode` of the rows this call claims, with the GIL released once: every thread
    that calls it with the same ``rows``, ``results`` and ``cursor`` claims the next unclaimed
    row (``cursor[0]``, incremented atomically) until none is left or it has diffed ``budget``
    bytes or more (None: no bound), so threads share a version's tensors as they free up.

    Args:
        rows: ``(N, ENCODE_ROW)`` uint64 rows of ``(fresh, base, snap, n, es, out, cap,
            dense_above, stream, varints, steps)``. Without a base (0) ``snap`` is written in
            the pass, as :func:`encode` does. With one, a sparse encoding of more than
            ``dense_above`` changed elements counts as DENSE, and a DENSE tensor is copied to
            ``snap`` when it is not 0 (with streaming stores when ``stream`` is not 0). With
            ``varints`` 0 the positions are a BITMASK whatever the density (no varints made).
            With ``steps`` not 0, as :func:`encode` with ``steps``.
        results: ``(N, ENCODE_RESULT)`` uint64: row ``i``'s :class:`Encoded` fields, in order
            (see :func:`encoded`), written when row ``i`` is claimed and done.
        cursor: ``(1,)`` uint64, 0 before the first call.
        taken: ``(N,)`` uint64, this caller's own: the indices of the rows this call claimed.

    Returns:
        How many rows this call claimed (0: none was left).

    Raises:
        ValueError: an array is not as above.
        TransportInternalError: an ``es`` is not 2 or 4, or this CPU lacks ``isa`` (the rows
            this call claimed after it are left undone).
    """
    n = len(rows)
    _uint64s("rows", rows, (n, ENCODE_ROW))
    _uint64s("results", results, (n, ENCODE_RESULT))
    _uint64s("cursor", cursor, (1,))
    _uint64s("taken", taken, (n,))
    bound = (1 << 64) - 1 if budget is None else max(1, budget)
    return int(_call("delta encode", "delta_encode_many", rows.ctypes.data, n, results.ctypes.data,
                     cursor.ctypes.data, bound, taken.ctypes.data, int(isa)))


APPLY_ROW = 10  # uint64s of one apply_many row: (live, n, es, payload, payload_len, kind, count, pos_bytes, pos, undo)
APPLY_RESULT = 4  # and of its result: (refusal, sum of the old terms, sum of the new terms, positions stored to)


def apply_many(rows: np.ndarray, results: np.ndarray, cursor: np.ndarray, taken: np.ndarray,
               isa: Isa = Isa.AUTO) -> int:
    """:func:`apply` of the rows this call claims, with the GIL released once, as
    :func:`encode_many` shares its rows between threads (with no budget: a call claims rows
    until none is left). Each row's ``pos_bytes`` position bytes are first copied from its
    payload's end to ``pos`` (the private copy :func:`apply` and :func:`undo` walk); more
    position bytes than payload are refused (``BAD_SIZE``) with nothing read or stored.

    Args:
        rows: ``(N, APPLY_ROW)`` uint64 rows of ``(live, n, es, payload, payload_len, kind,
            count, pos_bytes, pos, undo)``.
        results: ``(N, APPLY_RESULT)`` uint64: row ``i``'s ``(refusal, sum_old, sum_new,
            stored)``, as :func:`apply` returns them.
        cursor, taken: as for :func:`encode_many`.

    Returns:
        How many rows this call claimed (0: none was left).

    Raises:
        ValueError: an array is not as its argument says.
    """
    n = len(rows)
    _uint64s("rows", rows, (n, APPLY_ROW))
    _uint64s("results", results, (n, APPLY_RESULT))
    _uint64s("cursor", cursor, (1,))
    _uint64s("taken", taken, (n,))
    return int(_call("delta apply", "delta_apply_many", rows.ctypes.data, n, results.ctypes.data, cursor.ctypes.data,
                     taken.ctypes.data, int(isa)))


def encoded(result: np.ndarray) -> Encoded:
    """One :func:`encode_many` result row as an :class:`Encoded`."""
    kind, changed, payload, pos, checksum, sum_old, sum_new = (int(x) for x in result)
    return Encoded(Kind(kind), changed, payload, pos, checksum, sum_old, sum_new)


def sample_changed(fresh: int, base: int, n: int, es: int, runs: int, run: int, isa: Isa = Isa.AUTO) -> int:
    """Elements that differ between ``fresh`` and ``base`` (``n`` elements of ``es`` bytes) in
    ``runs`` ranges of ``run`` elements spread evenly over them: range ``j`` starts at
    ``(n - run) * j // (runs - 1)`` (one range at 0 when ``runs`` is 1); ``run`` is clamped to ``n``.

    Raises:
        TransportInternalError: ``es`` is not 2 or 4, or this CPU lacks ``isa``.
    """
    return int(_call("delta sample", "delta_sample_changed", fresh, base, n, es, runs, run, int(isa)))


def sample_changed_many(rows: np.ndarray, isa: Isa = Isa.AUTO) -> np.ndarray:
    """:func:`sample_changed` of several tensors in one call (the GIL released once): ``rows``
    is a C-contiguous ``(N, 6)`` uint64 array of ``(fresh, base, n, es, runs, run)``; returns
    the ``N`` counts.

    Raises:
        ValueError: ``rows`` is not such an array.
        TransportInternalError: an ``es`` is not 2 or 4, or this CPU lacks ``isa``.
    """
    if rows.dtype != np.uint64 or rows.ndim != 2 or rows.shape[1] != 6 or not rows.flags.c_contiguous:
        raise ValueError(f"rows must be a C-contiguous (N, 6) uint64 array, not {rows.dtype} {rows.shape}")
    changed = np.zeros(len(rows), dtype=np.uint64)
    if len(rows):
        _call("delta sample", "delta_sample_changed_many", rows.ctypes.data, len(rows), changed.ctypes.data, int(isa))
    return changed


def reserve_scratch(count: int, n: int) -> None:
    """Readies ``count`` of the scratch buffers the native diffs lease (one a call, for its
    duration), written once, for tensors of up to ``n`` elements: the first diffs then fault
    none of their pages in (the scratch grows as diffs need without it).

    Raises:
        MemoryError: the buffers cannot be allocated.
    """
    _call("delta scratch", "delta_reserve_scratch", count, n)


def checksum(ptr: int, n: int, es: int, first: int = 0, dst: int = 0, isa: Isa = Isa.AUTO) -> int:
    """The checksum of ``n`` elements of ``es`` bytes at ``ptr`` whose indices start at
    ``first`` (a tensor's checksum is the sum of its pieces', mod 2**64); copies them to
    ``dst`` on the way when it is not 0.

    Raises:
        TransportInternalError: ``es`` is not 2 or 4, or this CPU lacks ``isa``.
    """
    return int(_call("delta checksum", "delta_checksum", ptr, n, es, first, dst, int(isa)))


def scatter(live: int, n: int, es: int, payload: int, payload_len: int, kind: int, count: int, pos_bytes: int,
            write: bool) -> tuple[Refusal, int, int]:
    """Checks ``payload`` as the encoding of ``count`` changed elements of a tensor of ``n``
    elements at ``live`` and sums the checksum terms of the new values at its positions (and,
    without ``write`` and with ``live`` not 0, of the live values there); with ``write`` also
    stores the new values. No store ever lands outside ``[live, live + n * es)``; a refused
    payload stops the walk where it failed, so check first: without ``write`` and with ``live``
    0, only the payload is read. A VARSTEP payload's new values are steps from the live ones: it
    needs ``live`` (refused with 0, ``BAD_SIZE``), and the sums are over the live values and
    the values the steps make of them.

    Returns:
        (refusal, sum of the old terms (0 unless read), sum of the new terms).
    """
    refusal, old, new = _call("delta scatter", "delta_scatter", live, n, es, payload, payload_len, kind, count,
                              pos_bytes, write)
    return Refusal(refusal), old, new


def apply(live: int, n: int, es: int, payload: int, payload_len: int, kind: int, count: int, pos_bytes: int,
          pos: int, undo: int, isa: Isa = Isa.AUTO) -> tuple[Refusal, int, int, int]:
    """The checked apply of ``payload`` (the encoding of ``count`` changed elements of a tensor
    of ``n`` elements at ``live``) in one pass: each position is checked against ``n`` before
    its store, the live value there saved at ``undo`` (``count * es`` bytes), the new value
    read once (a VARSTEP payload's step, and escaped value, once each), stored and summed.
    ``pos`` is a private copy of the payload's ``pos_bytes`` position bytes (:func:`undo` walks
    it again); the values are read from ``payload``. A
    bitmask payload goes a vector of elements at a time on ``isa`` AVX512 (the default where the
    CPU has it); varints, and bitmasks on the other ISAs, one position at a time.

    Returns:
        (refusal, sum of the old terms, sum of the new terms, positions stored to). On a
        refusal, or sums other than expected, :func:`undo` the stores made.
    """
    refusal, old, new, stored = _call("delta apply", "delta_apply", live, n, es, payload, payload_len, kind, count,
                                      pos_bytes, pos, undo, int(isa))
    return Refusal(refusal), old, new, stored


def undo(live: int, n: int, es: int, kind: int, pos: int, pos_bytes: int, stored: int, saved: int) -> None:
    """Restores the live values :func:`apply` saved at ``saved`` for its first ``stored``
    positions (read from the same private ``pos``)."""
    _call("delta undo", "delta_undo", live, n, es, kind, pos, pos_bytes, stored, saved)


def diff_in_place(fresh: int, snap: int, n: int, es: int, offset: int, positions: int, old: int, cap: int,
                  isa: Isa = Isa.AUTO) -> int:
    """Compares ``n`` elements of ``es`` bytes at ``fresh`` with those at ``snap``, records the
    byte offset (``offset + index * es``, into the uint64 array at ``positions``) and the old
    value (at ``old``) of each changed one while fewer than ``cap`` are recorded, and copies
    ``fresh`` into ``snap``.

    Returns:
        How many elements changed (past ``cap`` too: then the record is incomplete).
    """
    return int(_call("delta diff", "delta_diff_in_place", fresh, snap, n, es, offset, positions, old, cap, int(isa)))


def diff_bf16_in_place(fresh: int, snap: int, n: int, offset: int, positions: int, old: int, cap: int,
                       isa: Isa = Isa.AUTO) -> int:
    """:func:`diff_in_place` of ``n`` fp32 elements at ``fresh`` against their bf16 cast at
    ``snap``: each is cast as c10::BFloat16 rounds (to nearest even, every NaN to ``0x7FC0``) on the
    way, so fp32 weights are packed and diffed in one pass. Positions are byte offsets of the
    2-byte elements (``offset + index * 2``).

    Returns:
        How many elements changed (past ``cap`` too: then the record is incomplete).
    """
    return int(_call("delta diff", "delta_diff_bf16_in_place", fresh, snap, n, offset, positions, old, cap, int(isa)))


def cut_runs(units: int, old: int, new: int, count: int, runs: int, nruns: int, out_units: int, out_old: int,
             out_new: int) -> int:
    """The ``count`` changes (sorted uint64 unit positions of a snapshot, uint16 old and new
    values) that fall in ``nruns`` byte runs (int64 ``(snapshot offset, slot offset, nbytes)``
    rows sorted by snapshot offset, not overlapping there), written as slot unit positions with
    their values in the order of the changes. Returns how many were written."""
    return int(_call("delta cut", "delta_cut_runs", units, old, new, count, runs, nruns, out_units, out_old, out_new))


NO_FIT = (1 << 64) - 1


def encode_positions(positions: int, count: int, out: int, cap: int) -> int | None:
    """Writes the LEB128 gaps of ``count`` strictly increasing uint64 positions at ``out`` (the
    positions of a VARINT payload). Returns the bytes written, or None when they take more
    than ``cap`` or do not increase."""
    got = int(_call("delta positions", "delta_encode_positions", positions, count, out, cap))
    return None if got == NO_FIT else got


def terms(values: int, positions: int, count: int, es: int) -> int:
    """The sum of the checksum terms of ``count`` values of ``es`` bytes (packed at
    ``values``) at the uint64 ``positions``, mod 2**64."""
    return int(_call("delta terms", "delta_terms", values, positions, count, es))


def checksum_runs(base: int, runs: int, count: int, addr_col: int, pos_col: int, isa: Isa = Isa.AUTO) -> int:
    """The checksum, in 2-byte units, of the bytes of ``count`` byte runs (an int64 ``(count,
    3)`` array at ``runs``): each at ``base + row[addr_col]``, its units indexed from
    ``row[pos_col] / 2``.

    Raises:
        TransportInternalError: a column outside {0, 1}, or a run with an odd offset or length.
    """
    return int(_call("delta checksum runs", "delta_checksum_runs", base, runs, count, addr_col, pos_col, int(isa)))


def best_isa() -> str:
    """The vector path :data:`Isa.AUTO` picks in this process: ``"avx512"``, ``"avx2"`` or
    ``"scalar"``.

    Raises:
        TransportInternalError: ``$TRANSPORT_DELTA_ISA`` names a path this CPU lacks, or none.
    """
    return str(_call("delta isa", "delta_best_isa"))


def supports(isa: Isa) -> bool:
    """Whether this CPU runs ``isa``."""
    return bool(load().delta_supports(int(isa)))
