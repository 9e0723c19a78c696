"""Bucket and conversion kernels: CPU reference implementations.

These are the semantics the optional CUDA kernels must match, and what runs on CPU tensors:

* ``pack``: gather many tensors into one contiguous byte bucket at given offsets;
* ``unpack``: scatter a bucket back into many tensors (casting to each destination's dtype);
* ``quantize_fp8`` / ``dequantize_fp8``: bf16/fp16/fp32 -> float8 e4m3 with one float32 scale
  per tensor (scale = amax / 448, so the largest magnitude maps to e4m3's largest finite value).
"""

from __future__ import annotations

from typing import Sequence

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def pack(out: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """Copies each tensor's bytes into the uint8 buffer ``out`` at its byte offset."""
    if out.dtype != torch.uint8 or out.dim() != 1:
        raise ValueError("out must be a 1-D uint8 tensor")
    for t, off in zip(tensors, offsets, strict=True):
        src = as_bytes(t.contiguous())
        if off < 0 or off + src.numel() > out.numel():
            raise ValueError(f"tensor of {src.numel()} bytes at offset {off} overflows the {out.numel()}-byte bucket")
        out[off : off + src.numel()].copy_(src)


def view_in(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The tensor of ``dtype``/``shape`` stored at byte ``offset`` of the uint8 buffer (a view)."""
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * dtype.itemsize
    if numel == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return buf[offset : offset + nbytes].view(dtype).view(tuple(shape))


def unpack(buf: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int], dtypes: Sequence[torch.dtype]) -> None:
    """Copies from the uint8 buffer into each destination (cast to its dtype)."""
    for dst, off, dtype in zip(dsts, offsets, dtypes, strict=True):
        dst.copy_(view_in(buf, off, dtype, dst.shape))


def quantize_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaled float8 (e4m3) quantisation.

    Returns:
        (q, scale): ``q`` float8_e4m3fn of ``t``'s shape and a 0-d float32 ``scale`` with
        ``t ≈ q.float() * scale``.
    """
    x = t.detach().float()
    amax = x.abs().max() if x.numel() else torch.tensor(0.0)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones((), dtype=torch.float32)).to(torch.float32)
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)
