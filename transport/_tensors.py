"""Tensors as the library sees them: dtype names, byte views, memory kinds, the two sides of
one transfer as backends get them (:class:`LocalBuffer`, :class:`RemoteTarget`), and the one
shape a prepared transfer's bytes have on their way down (:class:`Runs`)."""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ._errors import BackendUnavailableError, LayoutError
from ._wire import PeerRecord, RegionRecord


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
    if t.is_cpu:
        return MemoryKind.CPU
    if t.is_cuda:
        return MemoryKind.CUDA
    raise BackendUnavailableError(f"{what} lives on {t.device}; transport moves cpu and cuda memory only")


def check_tensor(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse or t.layout != torch.strided:
        raise LayoutError(f"{what} has layout {t.layout}; only dense (strided) tensors move")
    return t


def byte_offset(value: object) -> int:
    """An offset argument as an int: any integer type (numpy's too), not a bool or a float.

    Raises:
        TypeError: it is not an integer.
    """
    if isinstance(value, bool):
        raise TypeError("offset must be an integer number of bytes, got a bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"offset must be an integer number of bytes, got {type(value).__name__}") from None


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable uint8 memoryview over a contiguous CPU tensor's bytes (no copy)."""
    if t.numel() == 0:
        return memoryview(bytearray())
    # as_strided, not reshape: a contiguous tensor may still carry odd strides on size-1 dims.
    flat = t.detach().as_strided((t.numel(),), (1,))
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray is a Buffer


@dataclass
class LocalBuffer:
    """The local side of one transfer: a contiguous tensor (staged if the caller's was not)."""

    tensor: torch.Tensor
    kind: MemoryKind
    # CUDA only: a torch.cuda.Event recorded on the caller's current stream when the transfer
    # was started. A backend makes its own stream wait on it before touching ``tensor``.
    ready: Any = None
    _view: memoryview | None = field(default=None, repr=False)

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    @property
    def view(self) -> memoryview:
        if self._view is None:
            self._view = byte_view(self.tensor)
        return self._view


@dataclass(frozen=True)
class RemoteTarget:
    """The remote side of one transfer, already validated against the peer's record."""

    peer: PeerRecord
    region: RegionRecord
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Runs:
    """Byte runs between one local tensor and one remote region: what a prepared transfer is
    made of, from ``prepare_put`` / ``prepare_put_runs`` down to a backend's native list, where
    (and only where) rows become ``(dst address, src address, nbytes)``.

    Attributes:
        local: the runs' local base (contiguous, one dimension; ``ready`` unset): local offsets
            count from its first byte.
        key: the remote region.
        array: int64 ``(N, 3)``, N >= 1, rows ``(local byte offset, remote byte offset,
            nbytes)``: checked against ``local`` (inside it, aligned to its items), no row
            empty, coalesced, in remote order.
    """

    local: LocalBuffer
    key: str
    array: np.ndarray

    @property
    def span(self) -> tuple[int, int]:
        """The remote bytes ``[lo, hi)`` the runs lie in."""
        a = self.array
        return int(a[0, 1]), int(a[-1, 1] + a[-1, 2])

    @property
    def nbytes(self) -> int:
        return int(self.array[:, 2].sum())

    def copies(self, put: bool, there: int) -> np.ndarray:
        """The runs as native copy rows ``(dst address, src address, nbytes)``, int64 ``(N, 3)``,
        with the remote region's bytes at address ``there``: the one place rows change order."""
        a = self.array
        here, remote = a[:, 0] + self.local.address, a[:, 1] + there
        return np.stack([remote, here, a[:, 2]] if put else [here, remote, a[:, 2]], axis=1)

    def pieces(self) -> list[tuple[torch.Tensor, int]]:
        """Each run as (a view of the local base with its dtype, remote byte offset): for the
        paths that move run by run."""
        base, item = self.local.tensor, self.local.tensor.element_size()
        return [(base[a // item : (a + n) // item], b) for a, b, n in self.array.tolist()]


def spans_of(ranges: Iterable[tuple[str, int, int]]) -> dict[str, tuple[int, int]]:
    """Per region key, the byte span ``(lo, hi)`` that the ``(key, offset, nbytes)`` ranges
    cover (what a transfer of all of them counts as, for the ordering rule)."""
    out: dict[str, tuple[int, int]] = {}
    for key, offset, nbytes in ranges:
        lo, hi = out.get(key, (offset, offset + nbytes))
        out[key] = (min(lo, offset), max(hi, offset + nbytes))
    return out
