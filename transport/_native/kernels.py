"""The native ABI of the kernels in ``csrc/kernels/transport_kernels.cu``: their names, launch
bounds and parameter layouts, and the host copy of their CPU reference.

Parameters are packed with struct's native ("@") layout: each field at its natural alignment,
no trailing padding, which is the C ABI layout ``cuLaunchKernel`` expects in its parameter
buffer. Pointers are device (or pinned host) addresses, as integers.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterable, Sequence

from .copy import Segment

# kBlockThreads in transport_kernels.cu: every kernel's __launch_bounds__, so every launch's block.
BLOCK_THREADS = 256
# struct Segment { uint64 dst, src, nbytes; }: one entry of batched_copy's device table, a
# :data:`Segment` as three u64.
SEGMENT_BYTES = 24

BATCHED_COPY = "transport_batched_copy"
AMAX_BF16 = "transport_amax_bf16"
QUANTIZE_BF16_FP8 = "transport_quantize_bf16_fp8"
DEQUANTIZE_FP8_BF16 = "transport_dequantize_fp8_bf16"
KERNEL_NAMES = (BATCHED_COPY, AMAX_BF16, QUANTIZE_BF16_FP8, DEQUANTIZE_FP8_BF16)

_BATCHED_COPY_PARAMS = struct.Struct("@Qi")  # const Segment* segs, int nsegs
_AMAX_PARAMS = struct.Struct("@QQQ")  # const bf16* x, u64 n, float* amax
_QUANTIZE_PARAMS = struct.Struct("@QQQQQ")  # const bf16* x, u64 n, const float* amax, u8* q, float* scale
_DEQUANTIZE_PARAMS = struct.Struct("@QQQQ")  # const u8* q, u64 n, const float* scale, bf16* out


def batched_copy_params(segments: int, count: int) -> bytes:
    """``transport_batched_copy(segs, nsegs)``: ``count`` segments in a device table at ``segments``.

    Raises:
        struct.error: ``count`` does not fit a C ``int``.
    """
    return _BATCHED_COPY_PARAMS.pack(segments, count)


def amax_bf16_params(x: int, n: int, amax: int) -> bytes:
    """``transport_amax_bf16(x, n, amax)``: folds max |x| of ``n`` bf16 values into the float
    at ``amax`` (zeroed by the caller)."""
    return _AMAX_PARAMS.pack(x, n, amax)


def quantize_bf16_fp8_params(x: int, n: int, amax: int, q: int, scale: int) -> bytes:
    """``transport_quantize_bf16_fp8(x, n, amax, q, scale_out)``."""
    return _QUANTIZE_PARAMS.pack(x, n, amax, q, scale)


def dequantize_fp8_bf16_params(q: int, n: int, scale: int, out: int) -> bytes:
    """``transport_dequantize_fp8_bf16(q, n, scale, out)``."""
    return _DEQUANTIZE_PARAMS.pack(q, n, scale, out)


def host_memmove(dst: int, src: int, nbytes: int) -> None:
    """Copies ``nbytes`` between host addresses of this process (ranges may overlap)."""
    ctypes.memmove(dst, src, nbytes)


# Launch geometry: every block has BLOCK_THREADS threads (the kernels' __launch_bounds__).
BLOCK = (BLOCK_THREADS, 1, 1)
MAX_GRID = 4096
# The batched copy splits long ranges into pieces so that blocks balance: about TARGET_PIECES
# pieces per launch (enough for every SM of an H100 several times over), each between MIN_PIECE
# (a block start is amortised) and MAX_PIECE bytes. Pieces are multiples of 16 bytes, so each
# piece keeps the alignment of its range and the kernel's 16-byte words.
MIN_PIECE = 64 << 10
MAX_PIECE = 1 << 20
TARGET_PIECES = 1024


def grid_for(n: int, per_block: int) -> tuple[int, int, int]:
    """The grid of a launch over ``n`` items, ``per_block`` per block (at most MAX_GRID blocks)."""
    return (max(1, min(MAX_GRID, -(-n // per_block))), 1, 1)


def piece_bytes(total: int) -> int:
    """The piece size the batched copy splits ranges into, for ``total`` bytes in one launch."""
    piece = min(MAX_PIECE, max(MIN_PIECE, -(-total // TARGET_PIECES)))
    return (piece + 15) & ~15


def segment_table(copies: Iterable[Segment], piece: int) -> list[Segment]:
    """The kernel's segment list for (dst, src, nbytes) copies: empty copies dropped, longer ones
    split into pieces of ``piece`` bytes (the last one shorter).

    Raises:
        ValueError: ``piece`` is not a positive multiple of 16, or a copy has nbytes < 0.
    """
    if piece <= 0 or piece % 16:
        raise ValueError(f"piece must be a positive multiple of 16 bytes, not {piece}")
    table: list[Segment] = []
    for dst, src, n in copies:
        if n < 0:
            raise ValueError(f"negative byte count {n}")
        table.extend((dst + start, src + start, min(piece, n - start)) for start in range(0, n, piece))
    return table


def table_of(copies: Sequence[Segment]) -> list[Segment]:
    """The segment list of one batched-copy launch over ``copies``.

    Raises:
        ValueError: more segments than one launch takes (or as :func:`segment_table`).
    """
    table = segment_table(copies, piece_bytes(sum(n for _, _, n in copies)))
    if len(table) >= 1 << 31:
        raise ValueError(f"{len(table)} segments do not fit one launch")
    return table
