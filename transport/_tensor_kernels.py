"""Kernels on tensors -- bucket pack/unpack, fp8 quantisation, the batched copy: their CPU
references and their CUDA launches.

The operations, with the semantics the CUDA kernels (csrc/kernels/transport_kernels.cu) match:

* ``pack``: gather many tensors into one contiguous byte bucket at given offsets;
* ``unpack``: scatter a bucket back into many tensors (casting to each destination's dtype);
* ``quantize_fp8`` / ``dequantize_fp8``: bf16/fp16/fp32 -> float8 e4m3 with one float32 scale
  per tensor (scale = amax / 448, so the largest magnitude maps to e4m3's largest finite value);
* ``batched_copy``: many (dst, src, nbytes) device byte ranges (:data:`Segment`) in one launch,
  which is what ``pack`` and ``unpack`` run on CUDA tensors; ``batched_copy_reference`` is its
  CPU twin.

Dispatch: CPU tensors run the torch code here (the references). CUDA tensors run the kernels,
one launch per call on the device's current stream, when this build embeds them and a CUDA
driver is usable (``transport._cuda`` loads the kernel module; it does not import this one);
otherwise the same torch code runs on the device. Either way a call on CUDA tensors returns once
the work is enqueued, like ``Tensor.copy_``: the caller orders later use of the outputs through
that stream.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence

import torch

from . import _cuda
from ._cuda import Kernels
from ._errors import BackendUnavailableError
from ._native import kernels as abi
from ._native.copy import Segment
from ._native.kernels import (  # noqa: F401 - part of this module's API
    MAX_PIECE,
    MIN_PIECE,
    piece_bytes,
    segment_table,
)

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448

_BLOCK = abi.BLOCK
SEGMENT_BYTES = abi.SEGMENT_BYTES  # struct Segment { uint64 dst, src, nbytes; }: one Segment


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_ranges(capacity: int, ranges: Sequence[tuple[int, int]], what: str) -> None:
    """Raises ValueError unless every (offset, nbytes) lies in [0, capacity) and none overlap."""
    for off, n in ranges:
        if off < 0 or off + n > capacity:
            raise ValueError(f"{what} of {n} bytes at offset {off} overflows the {capacity}-byte bucket")
    spans = sorted((off, off + n) for off, n in ranges if n)
    for (a0, a1), (b0, _) in itertools.pairwise(spans):
        if b0 < a1:
            raise ValueError(f"{what}s overlap in the bucket: bytes [{a0}, {a1}) and [{b0}, ...)")


def pack(out: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """Copies each tensor's bytes into the uint8 buffer ``out`` at its byte offset.

    CUDA ``out`` with all tensors on its device: one kernel launch (or torch copies on the
    device without kernels); any other mix of devices: one torch copy per tensor.

    Raises:
        ValueError: ``out`` is not a 1-D uint8 tensor, or a tensor's range overflows ``out`` or
            overlaps another's. Raised before any byte is copied.
    """
    if out.dtype != torch.uint8 or out.dim() != 1:
        raise ValueError("out must be a 1-D uint8 tensor")
    tensors = list(tensors)
    offsets = [int(o) for o in offsets]
    if len(tensors) != len(offsets):
        raise ValueError(f"{len(tensors)} tensors but {len(offsets)} offsets")
    _check_ranges(out.numel(), [(off, _nbytes(t)) for t, off in zip(tensors, offsets, strict=True)], "tensor")
    srcs = [t.contiguous() for t in tensors]
    if out.is_cuda and out.is_contiguous() and all(s.device == out.device for s in srcs):
        kernels = _kernels_for(out.device)
        if kernels is not None:
            base = out.data_ptr()
            copies = [(base + off, s.data_ptr(), _nbytes(s)) for s, off in zip(srcs, offsets, strict=True)]
            _launch_batched_copy(kernels, out.device, copies)
            return
    for s, off in zip(srcs, offsets, strict=True):
        n = _nbytes(s)
        if n:
            out[off : off + n].copy_(as_bytes(s))


def view_in(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The tensor of ``dtype``/``shape`` stored at byte ``offset`` of the uint8 buffer (a view).

    Raises:
        ValueError: the tensor does not lie inside ``buf``.
    """
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * dtype.itemsize
    if offset < 0 or offset + nbytes > buf.numel():
        raise ValueError(f"{nbytes} bytes at offset {offset} overflow the {buf.numel()}-byte buffer")
    if numel == 0:
        return torch.empty(tuple(shape), dtype=dtype, device=buf.device)
    return buf[offset : offset + nbytes].view(dtype).view(tuple(shape))


def unpack(
    buf: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int], dtypes: Sequence[torch.dtype]
) -> None:
    """Copies from the uint8 buffer into each destination (cast to its dtype).

    A destination that is contiguous, of the stored dtype and on ``buf``'s device receives the
    stored bytes as they are (at any offset); on CUDA all of those are copied by one kernel
    launch when kernels are available. The others are cast with ``copy_``, which needs the
    offset to be a multiple of the stored dtype's size.

    Raises:
        ValueError: a stored tensor does not lie inside ``buf``. Raised before any byte is copied.
    """
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError("buf must be a 1-D uint8 tensor")
    items = list(zip(dsts, [int(o) for o in offsets], dtypes, strict=True))
    for dst, off, dtype in items:
        n = dst.numel() * dtype.itemsize
        if off < 0 or off + n > buf.numel():
            raise ValueError(f"tensor of {n} bytes at offset {off} overflows the {buf.numel()}-byte bucket")
    raw: list[tuple[torch.Tensor, int]] = []
    cast: list[tuple[torch.Tensor, int, torch.dtype]] = []
    for dst, off, dtype in items:
        if dst.dtype == dtype and dst.is_contiguous() and dst.device == buf.device:
            raw.append((dst, off))
        else:
            cast.append((dst, off, dtype))
    kernels = _kernels_for(buf.device) if buf.is_cuda and buf.is_contiguous() and raw else None
    if kernels is not None:
        base = buf.data_ptr()
        _launch_batched_copy(kernels, buf.device, [(dst.data_ptr(), base + off, _nbytes(dst)) for dst, off in raw])
    else:
        for dst, off in raw:
            n = _nbytes(dst)
            if n:
                as_bytes(dst).copy_(buf[off : off + n])
    for dst, off, dtype in cast:
        dst.copy_(view_in(buf, off, dtype, dst.shape))


def quantize_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaled float8 (e4m3) quantisation: q = e4m3(t / scale), rounded to nearest
    even and saturated to +-448, with scale = amax(|t|) / 448, or 1 where that is not positive
    (amax 0 or NaN, or a float32 amax so small that the division underflows).

    CUDA bf16 tensors run the kernels (two launches) when available; the result is bit for bit
    the CPU reference's except for the sign bit of NaN outputs. Non-finite inputs: a NaN makes
    amax NaN, hence scale 1 (the other values saturate) and a NaN output; an inf (without NaN)
    makes scale inf, so finite values become +-0 and the infs NaN.

    Returns:
        (q, scale): ``q`` float8_e4m3fn of ``t``'s shape and a 0-d float32 ``scale`` with
        ``t ≈ q.float() * scale``, both on ``t``'s device.
    """
    if t.is_cuda and t.dtype == torch.bfloat16:
        kernels = _kernels_for(t.device)
        if kernels is not None:
            return _launch_quantize_bf16(kernels, t)
    x = t.detach().float()
    amax = x.abs().max() if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    # Divide by a tensor, not the Python float: on CUDA, torch turns division by a scalar into a
    # multiplication by its reciprocal, which can be off by one ulp from the kernels' division.
    scale = amax / torch.full((), FP8_MAX, dtype=torch.float32, device=x.device)
    scale = torch.where(scale > 0, scale, one).to(torch.float32)
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dtype(float(q) * scale)``, rounded to nearest even. CUDA float8 ``q`` to bf16 runs the
    kernel when available (NaN outputs may differ from the reference in payload only)."""
    if q.is_cuda and q.dtype == FP8 and dtype == torch.bfloat16:
        kernels = _kernels_for(q.device)
        if kernels is not None:
            return _launch_dequantize_bf16(kernels, q, scale)
    return (q.float() * scale.float()).to(dtype)


# -- batched copy ---------------------------------------------------------------------------------


def batched_copy_reference(segments: Iterable[Segment]) -> None:
    """CPU reference of the batched copy: for each (dst, src, nbytes) of host addresses, copies
    nbytes bytes from src to dst. Segments must not overlap another's destination (the kernel's
    blocks run in no particular order)."""
    for dst, src, n in segments:
        if n:
            abi.host_memmove(dst, src, n)


def batched_copy(copies: Sequence[Segment], device: torch.device | int) -> None:
    """Copies every (dst, src, nbytes) range of memory that ``device`` can address (its own,
    or pinned host memory) with one kernel launch on its current stream. Returns once enqueued.

    Raises:
        BackendUnavailableError: no CUDA driver, or this build has no kernels (says why).
    """
    device = torch.device("cuda", device) if isinstance(device, int) else device
    _launch_batched_copy(_cuda.kernels(_device_index(device)), device, list(copies))


# -- launches -------------------------------------------------------------------------------------
# Kernel names and parameter layouts are the native ABI: transport._native.kernels.


def _device_index(device: torch.device) -> int:
    index: int | None = device.index  # None: the current device (torch's stubs say int)
    return index if index is not None else torch.cuda.current_device()


def _kernels_for(device: torch.device) -> Kernels | None:
    """The kernels loaded on a CUDA device, or None when this build or machine cannot run them."""
    try:
        return _cuda.kernels(_device_index(device))
    except BackendUnavailableError as exc:
        log.debug("transfer kernels unavailable on %s, using torch copies: %s", device, exc)
        return None


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _launch_batched_copy(kernels: Kernels, device: torch.device, copies: list[Segment]) -> None:
    table = abi.table_of(copies)
    if not table:
        return
    # The table lives in a stream-ordered caching-allocator block: freeing it after the launch
    # is enqueued is safe, the memory is reused only by later work on the same stream.
    device_table = torch.tensor(table, dtype=torch.int64).to(device, non_blocking=True)
    kernels.launch(
        abi.BATCHED_COPY,
        abi.grid_for(len(table), 1),
        _BLOCK,
        abi.batched_copy_params(device_table.data_ptr(), len(table)),
        _stream(device),
    )


def _launch_quantize_bf16(kernels: Kernels, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = t.detach().contiguous()
    n = x.numel()
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    grid = abi.grid_for(n, abi.BLOCK_THREADS * 8)
    stream = _stream(x.device)
    kernels.launch(abi.AMAX_BF16, grid, _BLOCK, abi.amax_bf16_params(x.data_ptr(), n, amax.data_ptr()), stream)
    kernels.launch(
        abi.QUANTIZE_BF16_FP8,
        grid,
        _BLOCK,
        abi.quantize_bf16_fp8_params(x.data_ptr(), n, amax.data_ptr(), q.data_ptr(), scale.data_ptr()),
        stream,
    )
    return q, scale


def _launch_dequantize_bf16(kernels: Kernels, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q = q.contiguous()
    scale = scale.to(device=q.device, dtype=torch.float32).contiguous()
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    n = q.numel()
    kernels.launch(
        abi.DEQUANTIZE_FP8_BF16,
        abi.grid_for(n, abi.BLOCK_THREADS * 8),
        _BLOCK,
        abi.dequantize_fp8_bf16_params(q.data_ptr(), n, scale.data_ptr(), out.data_ptr()),
        _stream(q.device),
    )
    return out
