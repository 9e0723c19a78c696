"""How a received version becomes the local weights: the copy plan worked out once per layout
(``ApplyPlan``), and the host copies and conversions that carry it out (``host_unpack``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from .. import _tensor_kernels
from .._tensors import dtype_from_name, dtype_name
from ._copy import HostCopies
from ._layout import Entry


@dataclass
class Copies:
    """Destinations filled by one ``_tensor_kernels.unpack`` from a slot: (tensor, byte offset, stored dtype)."""

    dsts: list[torch.Tensor] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)

    def add(self, entry: Entry, dst: torch.Tensor) -> None:
        self.dsts.append(dst)
        self.offsets.append(entry.offset)
        self.dtypes.append(dtype_from_name(entry.wire_dtype))


@dataclass
class ApplyPlan:
    """How a slot becomes the local weights, worked out once per layout.

    ``copies`` and ``converted`` (fp8 entries: dequantised) make a copy apply and ``pull``;
    zero-copy apply re-points ``repoint`` (tensor, storage offset in elements, strides) at the
    slot and fills the rest (``zc_copies``, ``converted``) by copying.
    """

    copies: Copies
    converted: list[tuple[Entry, torch.Tensor]]
    repoint: list[tuple[Entry, torch.Tensor, tuple[int, ...]]]
    zc_copies: Copies

    @classmethod
    def of(cls, matched: list[tuple[Entry, torch.Tensor]]) -> ApplyPlan:
        plan = cls(Copies(), [], [], Copies())
        for e, dst in matched:
            if e.scale_offset >= 0:
                plan.converted.append((e, dst))
                continue
            plan.copies.add(e, dst)
            if e.wire_dtype == dtype_name(dst.dtype) and e.numel:
                plan.repoint.append((e, dst, torch.empty(e.shape, device="meta").stride()))
            else:
                plan.zc_copies.add(e, dst)
        return plan


def dequantize_into(buf: torch.Tensor, converted: list[tuple[Entry, torch.Tensor]]) -> None:
    for e, dst in converted:
        _dequantize_one(buf, e, dst)


def _dequantize_one(buf: torch.Tensor, e: Entry, dst: torch.Tensor) -> None:
    q = _tensor_kernels.view_in(buf, e.offset, dtype_from_name(e.wire_dtype), e.shape)
    scale = _tensor_kernels.view_in(buf, e.scale_offset, torch.float32, ())
    with torch.no_grad():  # grad mode is per thread: this may run on a copy thread
        dst.copy_(_tensor_kernels.dequantize_fp8(q, scale, dst.dtype))


def _cast_into(buf: torch.Tensor, offset: int, dtype: torch.dtype, dst: torch.Tensor) -> None:
    with torch.no_grad():
        dst.copy_(_tensor_kernels.view_in(buf, offset, dtype, dst.shape))


def host_unpack(buf: torch.Tensor, copies: Copies, converted: list[tuple[Entry, torch.Tensor]],
                 threads: int) -> None:
    """``_tensor_kernels.unpack`` + ``_dequantize_into`` for a host ``buf`` and host destinations,
    split across ``threads`` (same-dtype contiguous destinations are plain memcpys)."""
    batch = HostCopies()
    base = buf.data_ptr()
    for dst, off, dtype in zip(copies.dsts, copies.offsets, copies.dtypes, strict=True):
        n = dst.numel() * dtype.itemsize
        if not n:
            continue
        if dst.dtype == dtype and dst.is_contiguous():
            batch.add_raw(dst.data_ptr(), base + off, n)
        else:
            batch.add(n, functools.partial(_cast_into, buf, off, dtype, dst))
    for e, dst in converted:
        batch.add(e.nbytes, functools.partial(_dequantize_one, buf, e, dst))
    batch.run(threads)
