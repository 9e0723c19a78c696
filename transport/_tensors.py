"""Small helpers that look at torch tensors: dtype names, byte views, memory kinds."""

from __future__ import annotations

import enum

import torch

from ._errors import BackendUnavailableError, LayoutError


class MemoryKind(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def memory_kind(t: torch.Tensor, what: str) -> MemoryKind:
    if t.device.type == "cpu":
        return MemoryKind.CPU
    if t.device.type == "cuda":
        return MemoryKind.CUDA
    raise BackendUnavailableError(f"{what} lives on {t.device}; transport moves cpu and cuda memory only")


def check_tensor(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse or t.layout != torch.strided:
        raise LayoutError(f"{what} has layout {t.layout}; only dense (strided) tensors move")
    return t


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable uint8 memoryview over a contiguous CPU tensor's bytes (no copy)."""
    if t.numel() == 0:
        return memoryview(bytearray())
    # as_strided, not reshape: a contiguous tensor may still carry odd strides on size-1 dims.
    flat = t.detach().as_strided((t.numel(),), (1,))
    return memoryview(flat.view(torch.uint8).numpy())
