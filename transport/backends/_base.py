"""The one small interface every backend implements.

A backend moves bytes between a local buffer and a peer's registered region. It advertises
capability flags instead of raising NotImplementedError, publishes opaque descriptors (for its
endpoint and for each region) that travel in the peer record, and says *why* it cannot reach a
peer rather than failing on the wire. Validation of keys, dtypes and bounds happens before a
backend is called; a backend only moves bytes and maps its own failures to the error tree.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from anyio.abc import TaskGroup

from .._auth import Authenticator
from .._native import Copier
from .._regions import Region
from .._tensors import MemoryKind, byte_view
from .._wire import HostId, PeerRecord, RegionRecord


@dataclass
class BackendContext:
    """What a backend gets from its Transport."""

    name: str
    incarnation: str
    pid: int
    host: HostId
    tg: TaskGroup
    copier: Copier
    timeout: float
    auth: Authenticator
    lanes: int | None = None  # parallel channels per peer where a backend supports it (ucx)


@dataclass
class LocalBuffer:
    """The local side of one transfer: a contiguous tensor (staged if the caller's was not)."""

    tensor: torch.Tensor
    kind: MemoryKind
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


class Backend(abc.ABC):
    """Moves bytes between local buffers and peers' registered regions."""

    name: ClassVar[str]
    one_sided: ClassVar[bool]  # True when the target's Python takes no part in a transfer
    memory_kinds: ClassVar[frozenset[MemoryKind]]

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx

    @classmethod
    @abc.abstractmethod
    def unavailable_reason(cls) -> str | None:
        """None when the backend can run in this process, else why not and what to install."""

    def endpoint_descriptor(self) -> bytes:
        """Opaque bytes peers need to reach this endpoint (published in the peer record)."""
        return b""

    def region_descriptor(self, region: Region) -> bytes | None:
        """Opaque bytes peers need for ``region``, or None when the backend needs none."""
        return None

    def unreachable_reason(self, peer: PeerRecord, region: RegionRecord, local: MemoryKind) -> str | None:
        """None when this backend can move bytes between ``local`` memory and ``region``."""
        return None

    def published(self, seq: int) -> None:  # noqa: B027 - optional hook
        """Called after this endpoint published record number ``seq``."""

    def live_seq(self, peer: PeerRecord) -> int | None:
        """The seq of ``peer``'s latest record if this backend can see it cheaply (else None):
        lets an initiator notice a newer record before it moves bytes one-sidedly."""
        return None

    @abc.abstractmethod
    async def put(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        """Writes ``local`` into the remote region; returns when the bytes are in its memory."""

    @abc.abstractmethod
    async def get(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        """Reads the remote range into ``local``."""

    def forget_peer(self, peer: str) -> None:  # noqa: B027 - optional hook
        """Drops cached connections, mappings and keys of ``peer`` (it left or restarted)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases everything; called once, after every transfer has finished."""
