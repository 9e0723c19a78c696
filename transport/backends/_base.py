"""The one small interface every backend implements.

A backend moves bytes between a local buffer and a peer's registered region. It advertises
capability flags instead of raising NotImplementedError, publishes opaque descriptors (for its
endpoint and for each region) that travel in the peer record, and says *why* it cannot reach a
peer rather than failing on the wire. Validation of keys, dtypes and bounds happens before a
backend is called; a backend only moves bytes and maps its own failures to the error tree.
"""

from __future__ import annotations

import abc
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from anyio.abc import TaskGroup

from .. import _pieces
from .._auth import Authenticator
from .._errors import TransportInternalError
from .._native import Copier
from .._pieces import Ready
from .._regions import Region, RegionTable
from .._rendezvous import Store
from .._tensors import LocalBuffer, MemoryKind, RemoteTarget, Runs
from .._wire import HostId, PeerRecord, RegionRecord, TransferOp

if TYPE_CHECKING:
    from .._agent import Conn

MANY_INFLIGHT = 32  # runs in flight at once (the default prepare_runs)

# check_region(op, meta, nbytes): the live region a request may touch (transport._regions.check).
RegionCheck = Callable[[TransferOp, Mapping[str, Any], int], Region]
# A synchronous transfer whose bytes went out but whose completion has not arrived yet: awaiting
# it returns True once they are in place, False when they must be moved again by the checked
# path (refused, or the connection broke). See Backend.mover.
Pending = Callable[[], Awaitable[bool]]
# move(local_address, offset, nbytes): True (done), False (declined, nothing moved) or a Pending.
Mover = Callable[[int, int, int], "bool | Pending"]
# move(local_tensor, offset, nbytes) where either side is CUDA memory: True (done), False
# (declined: nothing left running) or a Pending. See Backend.device_mover.
DeviceMover = Callable[[torch.Tensor, int, int], "bool | Pending"]
# A prepared transfer's reusable runner (see Backend.prepare_runs): ``await run(ready)``, with
# the ready events the engine recorded when that start began, one per CUDA device it touches.
Runner = Callable[[Ready], Awaitable[None]]


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
    # The Transport's one transport._cuda_copier.CudaCopier (streams, pinned staging, IPC imports),
    # created on first use; the Transport closes it after its backends.
    cuda: Callable[[], Any] | None = None
    # Asks the Transport to watch a peer's process through its agent connection (the peer is
    # then declared lost, and forget_peer called, the moment it dies). For one-sided backends.
    watch: Callable[[PeerRecord], None] | None = None
    # This endpoint's registered regions, for a backend that serves frames on the target side
    # (serve_frame): check requests against it with RegionTable.check.
    regions: RegionTable | None = None


class Backend(abc.ABC):
    """Moves bytes between local buffers and peers' registered regions.

    **The contract.** A subclass sets three class attributes:

    * ``name``: the registry name (``register_backend(name, cls)`` checks they match), also the
      key of its descriptors in peer records;
    * ``one_sided``: True when the target's Python takes no part in a transfer (its event loop
      may be blocked); False when the target's agent serves it (``tcp``, ``nccl``);
    * ``memory_kinds``: the local memory it moves directly (``MemoryKind.CPU`` / ``CUDA``). The
      Transport stages a tensor of another kind through a bounce buffer (``transport._staging``).

    It may set ``same_host`` (default False): True when it moves bytes only through this host's
    memory (``ipc``), a link as fast as a pass over the bytes. Transfers report it
    (``Transfer.same_host``); weight sync sends such peers dense versions rather than deltas.

    Lifecycle: :meth:`unavailable_reason` is asked before an instance exists (None: it can run
    here). One instance per Transport is made with its :class:`BackendContext` when the
    Transport opens, and :meth:`close` is called once when it closes, after every transfer has
    ended. All methods run on the Transport's event loop (trio or asyncio, through anyio);
    blocking work goes to a thread or to native code.

    What the Transport guarantees before :meth:`put` / :meth:`get`: the peer's record is current
    as far as the Transport knows; key, dtype, bounds, alignment and writability were checked
    against it (``transport._regions.check``); ``local`` is contiguous and exactly
    ``remote.nbytes`` long; :meth:`unreachable_reason` returned None for this pair. A backend
    only moves bytes, and raises from the error tree: ``PeerLostError`` when the peer is gone
    (the Transport then declares it lost for every part), ``TransferTimeoutError`` /
    ``TransportInternalError`` otherwise. It never lets a foreign exception escape.

    Cancellation: :meth:`put` / :meth:`get` are cancelled when the transfer is cancelled, times
    out, or its peer is lost. They must then stop issuing work and return (or re-raise)
    promptly, and must not let any memory they were given be touched after they return: keep
    the buffer referenced by whatever still may (the native engines do this).

    Per-peer state (connections, mappings, keys) is dropped in :meth:`forget_peer`, which the
    Transport calls when a peer restarts (new incarnation), is lost or is excluded.

    **The target side.** A backend that is not one-sided serves its peers' requests in this
    endpoint's agent, through one hook: the agent hands every frame of a kind in ``frames``
    (and every ``FrameKind.BACKEND_DATA`` frame whose ``meta["backend"]`` names it) to
    :meth:`serve_frame`, and every connection whose HELLO asks for a lane in ``lanes`` to
    :meth:`adopt_lane` (native code may take it over). It follows the regions registered here
    through :meth:`region_added` / :meth:`region_removed` / :meth:`region_moved`. ``tcp`` is
    built on exactly this; nothing in the core names a backend.

    ``transport.testing.check_backend`` runs the conformance suite against a backend; a
    third-party backend registered with ``transport.register_backend`` must pass it.
    """

    name: ClassVar[str]
    one_sided: ClassVar[bool]  # True when the target's Python takes no part in a transfer
    memory_kinds: ClassVar[frozenset[MemoryKind]]
    same_host: ClassVar[bool] = False  # True when it moves bytes only through this host's memory
    # frame kinds served on the target side: numbers of transport._wire.BACKEND_KINDS, each declared by one backend
    frames: ClassVar[frozenset[int]] = frozenset()
    lanes: ClassVar[frozenset[str]] = frozenset()  # HELLO lanes it takes over (adopt_lane)

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

    def withdrawn(self) -> None:  # noqa: B027 - optional hook
        """Called when this endpoint closes, after its record left the store: a backend with a
        control word sets it to ``WITHDRAWN_SEQ`` so same-host peers forget this endpoint at once
        (``live_seq`` then returns it)."""

    def live_seq(self, peer: PeerRecord) -> int | None:
        """The seq of ``peer``'s latest record if this backend can see it cheaply (else None):
        lets an initiator notice a newer record before it moves bytes one-sidedly."""
        return None

    def mover(self, op: TransferOp, peer: PeerRecord, region: RegionRecord) -> Mover | None:
        """A synchronous path for small transfers between host memory here and ``region``, or
        None (the default: every transfer takes :meth:`put` / :meth:`get`).

        The Transport asks once per route (and again when the peer's record changes), then
        calls ``move(local_address, offset, nbytes)`` on the event loop inside ``put``/``get``,
        after every check passed, for host transfers of at most ``transfers.SYNC_MAX_BYTES``
        that wait for no transfer in flight (none overlapping their bytes where either writes).
        It must take microseconds, or at most a bounded wait of a millisecond or two. It returns:

        * True once the bytes are in place (a put: in the peer's memory; a get: here);
        * False to decline, having moved nothing that could land later: the transfer then
          takes the asynchronous path, which also reports the precise error of a failed attempt;
        * a :data:`Pending` when the request went out but its completion has not come yet: the
          Transport then runs the transfer in the background, awaiting it (cancelled like any
          transfer; its memory is referenced until it ends), and moves the bytes again by the
          asynchronous path if it returns False.

        What it holds (a mapping, a connection) stays valid while the returned callable is
        referenced.
        """
        return None

    def device_mover(self, op: TransferOp, peer: PeerRecord, region: RegionRecord,
                     local: MemoryKind) -> DeviceMover | None:
        """A synchronous path for transfers where a side is CUDA memory (``local`` memory here,
        or ``region``), or None (the default: they take :meth:`put` / :meth:`get`).

        Asked and called as :meth:`mover` is, for transfers of any size that wait for no
        transfer in flight: ``move(local_tensor, offset, nbytes)`` enqueues the copy on the
        calling thread, ordered after the work queued so far on the caller's current CUDA
        stream, and returns True when it completed within a short poll (a few hundred
        microseconds at most), False when it declined or failed with nothing left running (the
        asynchronous path then moves the bytes and reports any error precisely), or a
        :data:`Pending` that completes the copy (cancelled like any transfer: it returns only
        once the device no longer touches the memory).
        """
        return None

    @abc.abstractmethod
    async def put(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        """Writes ``local`` into the remote region; returns when the bytes are in its memory."""

    @abc.abstractmethod
    async def get(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        """Reads the remote range into ``local``."""

    async def move(self, op: TransferOp, local: LocalBuffer, remote: RemoteTarget) -> None:
        """:meth:`put` or :meth:`get`, by ``op``."""
        if op == TransferOp.PUT:
            await self.put(local, remote)
        else:
            await self.get(local, remote)

    def prepare_runs(self, op: TransferOp, peer: PeerRecord,
                     lists: Sequence[tuple[Runs, RegionRecord]]) -> Runner:
        """A reusable runner that moves these runs of one peer's regions (a prepared transfer's,
        each list with the region of ``peer``'s record it goes to, checked; every list's memory
        of a kind in ``memory_kinds``).

        Built once per prepared transfer and record of its peer; every ``await run(ready)``
        moves every run again (reading or writing the same memory) and returns when all are
        done. ``ready``: the ``torch.cuda.Event`` the engine recorded on each CUDA device's
        current stream when the transfer was started, by device index, which CUDA copies must
        wait for. A runner never records one of its own: a CUDA run whose device has none is a
        bug, raised as TransportInternalError (``transport._pieces.ready_on``). Backends with a
        native list operation override this to build their descriptor lists here, once, from
        the arrays as they are; the default moves each run with :meth:`move`, up to
        ``MANY_INFLIGHT`` at once (``transport._pieces.run``).

        Raises (from ``run``): TransportError, the first failure; the runs not started by then
        are not started, those in flight end first.
        """
        pieces = _pieces.of_runs(peer, lists)

        async def run(ready: Ready) -> None:
            await _pieces.run(pieces, lambda p: self.move(op, p.local(ready), p.remote), MANY_INFLIGHT)

        return run

    async def warm(self, op: TransferOp, peer: PeerRecord, lists: Sequence[tuple[Runs, RegionRecord]]) -> None:
        """Readies, ahead of a prepared transfer's first start, what that start would set up
        on its way (``lists`` as for :meth:`prepare_runs`), so that it costs what later starts
        do: e.g. this process's page tables for a same-host peer's memory. Moves no byte and
        changes nothing the peer can see. Called by ``PreparedTransfer.warm``; the default
        readies nothing.

        Raises:
            TransportError: a failure (the transfer itself will meet it again).
        """
        return None

    async def serve_request(self, meta: Mapping[str, Any], check_region: RegionCheck) -> Mapping[str, Any]:
        """Serves a control request a peer's instance of this backend sent to our agent
        (``FrameKind.BACKEND``), e.g. "post the receive for my send". ``check_region(op, meta,
        nbytes)`` validates key/dtype/bounds/writability and returns the local :class:`Region`.
        Returns the reply's metadata; raises TransportError to refuse."""
        raise TransportInternalError(f"backend {self.name} serves no requests")

    async def serve_frame(self, conn: Conn, kind: int, rid: int, meta: Mapping[str, Any],
                          payload_len: int) -> None:
        """Target side: serves one frame (see the class docstring), already read up to its
        payload. It must take exactly ``payload_len`` payload bytes from ``conn`` (or discard
        them) and reply with the same ``rid`` (``conn.reply`` / ``conn.refuse``): a refusal
        keeps the connection; anything it raises closes that connection only."""
        raise TransportInternalError(f"backend {self.name} serves no frames")

    def adopt_lane(self, lane: str, sock: socket.socket) -> bool:
        """Takes over ``sock``, an authenticated connection whose HELLO asked for ``lane`` (one
        of ``lanes``): True once taken (the agent lets go of it), False to have it closed."""
        return False

    def region_added(self, region: Region) -> None:  # noqa: B027 - optional hook
        """A region was registered here."""

    def region_removed(self, region: Region) -> None:  # noqa: B027 - optional hook
        """A region was withdrawn here (the backend may keep it referenced while it still
        moves its bytes)."""

    def region_moved(self, key: str) -> None:  # noqa: B027 - optional hook
        """The tensor of region ``key`` was given new storage: refuse transfers into it."""

    def forget_peer(self, peer: str) -> None:  # noqa: B027 - optional hook
        """Drops cached connections, mappings and keys of ``peer`` (it left or restarted)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases everything; called once, after every transfer has finished."""
