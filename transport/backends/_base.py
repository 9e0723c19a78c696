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
from typing import Any, Callable, ClassVar, Mapping

import torch
from anyio.abc import TaskGroup

from .._auth import Authenticator
from .._errors import TransportInternalError
from .._native import Copier
from .._regions import Region
from .._rendezvous import Store
from .._tensors import MemoryKind, byte_view
from .._wire import FrameKind, HostId, PeerRecord, RegionRecord

RegionCheck = Callable[[FrameKind, Mapping[str, Any], int], Region]


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
    store: Store | None = None  # the rendezvous store (e.g. for exchanging NCCL unique ids)
    # The Transport's one transport._cuda.CudaEngine (streams, pinned staging, IPC imports),
    # created on first use; the Transport closes it after its backends.
    cuda: Callable[[], Any] | None = None


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

    async def serve_request(self, meta: Mapping[str, Any], check_region: RegionCheck) -> Mapping[str, Any]:
        """Serves a control request a peer's instance of this backend sent to our agent
        (``FrameKind.BACKEND``), e.g. "post the receive for my send". ``check_region(op, meta,
        nbytes)`` validates key/dtype/bounds/writability and returns the local :class:`Region`.
        Returns the reply's metadata; raises TransportError to refuse."""
        raise TransportInternalError(f"backend {self.name} serves no requests")

    def forget_peer(self, peer: str) -> None:  # noqa: B027 - optional hook
        """Drops cached connections, mappings and keys of ``peer`` (it left or restarted)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases everything; called once, after every transfer has finished."""
