"""The native ABI of the kernels in ``csrc/kernels/transport_kernels.cu``: their names, launch
bounds and parameter layouts, and the host copy of their CPU reference.

Parameters are packed with struct's native ("@") layout: each field at its natural alignment,
no trailing padding, which is the C ABI layout ``cuLaunchKernel`` expects in its parameter
buffer. Pointers are device (or pinned host) addresses, as integers.
"""

from __future__ import annotations

import ctypes
import struct

# kBlockThreads in transport_kernels.cu: every kernel's __launch_bounds__, so every launch's block.
BLOCK_THREADS = 256
# struct Segment { uint64 src, dst, nbytes; }: one entry of batched_copy's device table.
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
