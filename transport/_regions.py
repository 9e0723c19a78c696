"""Registered regions (local) and peers (remote views of what they registered)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ._tensors import byte_view, dtype_name, nbytes_of
from ._wire import PeerRecord, RegionRecord


@dataclass(eq=False)
class Region:
    """A local tensor exposed to remote ``put``/``get`` under ``key``.

    The Transport keeps a reference to ``tensor`` while it is registered; its memory must not be
    resized or freed by other means in that time. ``shared`` is the library-owned shareable
    buffer the tensor lives in, when it was allocated with :meth:`Transport.empty`.
    """

    key: str
    tensor: torch.Tensor
    writable: bool
    shared: Any = None  # transport._C.SharedBuffer or None
    device: str = "cpu"  # "cpu" or "cuda:<GPU UUID>" (as published in the peer record)
    view: memoryview | None = field(init=False, repr=False)  # the bytes, for host memory only
    # Backends' per-registration state (e.g. an exported CUDA IPC descriptor): it lives and dies
    # with this registration, so a later tensor at the same address never inherits it.
    backend_state: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.view = byte_view(self.tensor) if self.tensor.device.type == "cpu" else None

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.tensor)

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    def record(self, descriptors: Mapping[str, bytes]) -> RegionRecord:
        return RegionRecord(
            key=self.key,
            dtype=dtype_name(self.dtype),
            shape=tuple(self.tensor.shape),
            nbytes=self.nbytes,
            writable=self.writable,
            descriptors=dict(descriptors),
            device=self.device,
        )


class Peer:
    """What a peer has published: its identity, backends and registered regions.

    Attributes:
        name: the peer's name.
        incarnation: changes every time a process takes the name anew (a restart).
        backends: the backends the peer speaks.
        regions: key -> region description (dtype, shape, nbytes, writable).
    """

    def __init__(self, record: PeerRecord) -> None:
        self._record = record

    @property
    def name(self) -> str:
        return self._record.name

    @property
    def incarnation(self) -> str:
        return self._record.incarnation

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self._record.backends)

    @property
    def regions(self) -> Mapping[str, RegionRecord]:
        return self._record.regions

    def __repr__(self) -> str:
        return (
            f"Peer({self.name!r}, incarnation={self.incarnation!r}, backends={self.backends}, "
            f"regions={len(self.regions)})"
        )
