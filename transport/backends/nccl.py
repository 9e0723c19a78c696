"""``nccl``: GPU memory to GPU memory over NCCL point-to-point, one communicator per peer pair.

NCCL is what GPU clusters already tune for NVLink and InfiniBand (GPUDirect RDMA). This backend
uses its point-to-point operations without its collective coupling: every communicator holds
exactly two ranks, the two ends of one peer pair, so a dead or slow peer can only ever stall
the communicator it shares with its one partner.

Communicators, one per *ordered* pair and device pair: A's puts and gets to B run on the
communicator A opened towards B (A is rank 0, B rank 1); B's transfers to A on another one.
NCCL matches sends and receives in the order each rank issues them, so every communicator has
one sequencer, its initiator: the initiator posts operations under a per-communicator lock and
the target's agent serves that initiator's requests in arrival order, so both ranks issue the
same sequence. (One communicator shared by both directions would deadlock as soon as both
sides put at once: each rank's send would wait behind its own later receive.)

Opening (lazily, on the first transfer): the initiator makes an ``ncclUniqueId``, publishes it in
the rendezvous store under ``nccl/<comm id>`` (signed with the shared token when one is set; the
comm id names both peers, their incarnations, both GPUs and a generation), starts its rank-0
init and asks the target's agent to ``open``; the target reads the id, inits rank 1, and both
exchange a warm-up message (so a link that cannot connect fails here, not in a transfer). The
id is deleted from the store once both ends are up. Only the initiator of a direction ever
creates its id, so two peers opening towards each other at once create two communicators,
never a race on one.

A put (send/recv path): holding the lock, the initiator asks the target's agent to ``post``
transfer number ``seq``; the agent checks key, dtype, bounds and writability (a refusal arrives
as the matching typed error and nothing is enqueued anywhere), enqueues on its stream an
``ncclRecv`` into the region and then an 8-byte ``ncclSend`` of ``seq`` back (the ack), and
replies at once. The initiator then enqueues, on its stream and after the caller's ready event,
``ncclSend`` of the tensor and ``ncclRecv`` of the ack, and releases the lock. The ack leaves
the target only after its receive kernel completed (stream order), so when the initiator's ack
has arrived the bytes are in the target's memory: that is when the Transfer completes. An ack
that does not carry ``seq`` means mismatched matching and aborts the communicator. A get: the
target sends from its region, the initiator receives; complete when that receive finished.

Sending to self (the peer is this very Transport): a 1-rank communicator on the device, with
the send and its receive grouped (``ncclGroupStart/End``); the request still goes through this
Transport's own agent so that the region checks are the same.

Stream semantics: the transport-owned stream of a communicator waits for the caller's ready
event (``LocalBuffer.ready``: recorded on the caller's current stream when the transfer was
started; recorded here if absent) before reading or writing the tensor; completion means the
bytes are in place, as above. Completion is observed by polling CUDA events (with backoff).

Failures: communicators are non-blocking (:mod:`transport._nccl`), so no NCCL call blocks the
event loop and every wait is bounded by the transfer's deadline. A transfer that is cancelled
or times out after both ends enqueued gets a short grace to finish; otherwise its communicator
is aborted (``ncclCommAbort``: NCCL lets go of the buffers) and the target is told to abort its
side; the target also aborts on its own when a posted operation overruns the initiator's
timeout. Other transfers on an aborted communicator fail with TransferAbortedError; the next
transfer opens a new communicator (next generation). Peer loss (``forget_peer``) and close
abort every communicator of that peer.

One-sided windows (NCCL >= 2.29: ``ncclCommWindowRegister`` + ``ncclPutSignal``): the library
bindings exist (:mod:`transport._nccl`) and each endpoint advertises whether its NCCL has them,
but transfers use the send/recv path: see ``_window_path_reason``.

Two ranks on one GPU: NCCL refuses them unless NCCL >= 2.30 runs with
``NCCL_MULTI_RANK_GPU_ENABLE=1`` on both ends; such pairs are reported unreachable (use ``ipc``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
from collections.abc import Mapping
from typing import Any

import anyio
import torch

from .. import _nccl
from .._agent import ChannelPool
from .._auth import Authenticator
from .._errors import (
    AuthenticationError,
    BackendUnavailableError,
    PeerLostError,
    TransferAbortedError,
    TransportError,
    TransportInternalError,
)
from .._nccl import Communicator, Library, NcclError, NcclResult
from .._rendezvous import Store
from .._tensors import MemoryKind, dtype_name
from .._wire import FrameKind, PeerRecord, RegionRecord, WireError
from ._base import Backend, BackendContext, LocalBuffer, RegionCheck, RemoteTarget

log = logging.getLogger(__name__)

STORE_PREFIX = "nccl/"
ENDPOINT_FORMAT = "transport.nccl"
ENDPOINT_VERSION = 1

_ACK_SLOTS = 64  # transfers in flight per communicator (each has its ack slot)
_ACK_BYTES = 8
_CANCEL_GRACE_S = 0.5  # a cancelled transfer already enqueued may finish within this, else abort
_TARGET_GRACE_S = 5.0  # the target aborts a posted operation this long after the initiator's timeout
_CLOSE_TIMEOUT_S = 5.0
_MAX_ID_LEN = 512


class _Op:
    """Requests this backend sends to a peer's agent (``meta["op"]``)."""

    OPEN = "open"
    POST = "post"
    CLOSE = "close"
    SELF = "self"


class _Dir:
    """Which way the bytes go (``meta["dir"]``), seen from the initiator."""

    PUT = "put"  # initiator -> target region
    GET = "get"  # target region -> initiator


# -- endpoint descriptor -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EndpointInfo:
    """What a peer's nccl endpoint publishes."""

    version: tuple[int, int, int]
    windows: bool  # its NCCL has ncclCommWindowRegister / ncclPutSignal / ncclWaitSignal


def encode_endpoint(lib: Library) -> bytes:
    doc = {"format": ENDPOINT_FORMAT, "v": ENDPOINT_VERSION, "nccl": list(lib.version), "windows": lib.has_windows}
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_endpoint(data: bytes, peer: str) -> EndpointInfo:
    """Raises WireError for anything but a valid descriptor."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise TypeError("not a JSON object")
        if doc.get("format") != ENDPOINT_FORMAT or doc.get("v") != ENDPOINT_VERSION:
            raise ValueError("not an nccl endpoint descriptor of a known version")
        v = doc["nccl"]
        if not (isinstance(v, list) and len(v) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
            raise ValueError(f"bad NCCL version {v!r}")
        if not isinstance(doc["windows"], bool):
            raise TypeError("bad windows flag")
        return EndpointInfo((v[0], v[1], v[2]), doc["windows"])
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
        raise WireError(f"{peer}: unreadable nccl endpoint descriptor: {exc}") from None


def comm_id(initiator: str, initiator_inc: str, target: str, target_inc: str, local_uuid: str, remote_uuid: str, gen: int) -> str:
    """Names one communicator: both peers, their incarnations, both GPUs, a generation."""
    return f"{initiator}.{initiator_inc}>{target}.{target_inc}/{local_uuid[:12]}>{remote_uuid[:12]}/{gen}"


def _window_path_reason(lib: Library, info: EndpointInfo) -> str:
    """Why a transfer to this peer uses send/recv rather than a one-sided window put."""
    if not (lib.has_windows and info.windows):
        need = ".".join(map(str, _nccl.WINDOW_VERSION))
        return f"one-sided windows need NCCL >= {need} on both ends"
    # Both ends could. Not done yet: window registration is collective (both ranks, in the same
    # order as their other operations), accepts only VMM allocations (ncclMemAlloc, or torch's
    # expandable segments), and delivery is only known after the target's ncclWaitSignal, so it
    # would still need the agent's post and the ack; to be validated on GPUs first.
    return "the window path is not enabled yet (send/recv is used)"


# -- links -------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Link:
    """One communicator with its stream and ack buffers, as initiator (rank 0) or target (rank 1)."""

    cid: str
    peer: str
    incarnation: str
    comm: Communicator
    stream: Any  # torch.cuda.Stream
    ack_dev: torch.Tensor  # _ACK_SLOTS int64 on the device
    ack_host: torch.Tensor | None  # pinned copies of arrived acks (initiator only)
    pair: str = ""  # "<local uuid>><remote uuid>" as the initiator names it
    record: PeerRecord | None = None  # initiator only: the target's record (to ask it to close)
    seq: int = 0  # initiator: next seq to post; target: next seq expected
    order: anyio.Semaphore = dataclasses.field(default_factory=lambda: anyio.Semaphore(1))  # issue order
    slots: anyio.Semaphore = dataclasses.field(default_factory=lambda: anyio.Semaphore(_ACK_SLOTS))
    lost: TransportError | None = None  # set once aborted: why

    @property
    def other(self) -> int:
        return 1 - self.comm.rank if self.comm.nranks == 2 else 0


@dataclasses.dataclass(eq=False)
class _Ticket:
    """A transfer to this very Transport, waiting for its own agent to enqueue it."""

    direction: str
    local: LocalBuffer
    ready: Any
    event: Any = None
    link: _Link | None = None


class NcclBackend(Backend):
    """NCCL point-to-point between GPUs (see the module docstring)."""

    name = "nccl"
    one_sided = False  # the target's agent posts the receive
    memory_kinds = frozenset({MemoryKind.CUDA})

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return _nccl.unavailable_reason()

    def __init__(self, ctx: BackendContext) -> None:
        # Nothing here touches CUDA: streams and communicators are made on first use.
        super().__init__(ctx)
        lib, why = _nccl.library()
        if lib is None:
            raise TransportInternalError(f"nccl backend unavailable: {why}")
        self._lib = lib
        self._endpoint = encode_endpoint(lib)
        self._pool = ChannelPool(ctx.tg, {"from": ctx.name, "from_incarnation": ctx.incarnation, "lane": "nccl"}, ctx.auth)
        self._links: dict[tuple[str, str, int, str], _Link] = {}  # (peer, incarnation, device, remote uuid)
        self._opening: dict[tuple[str, str, int, str], anyio.Lock] = {}
        self._served: dict[str, _Link] = {}  # comm id -> our rank-1 side
        self._selves: dict[int, _Link] = {}  # device -> 1-rank link
        self._self_lock = anyio.Lock()
        self._tickets: dict[int, _Ticket] = {}
        self._ids = itertools.count(1)
        self._uuids: dict[int, str] = {}
        self._infos: dict[tuple[str, str], EndpointInfo | str] = {}
        self._closed = False

    # -- publishing and reachability ----------------------------------------------------------

    def endpoint_descriptor(self) -> bytes:
        return self._endpoint

    def _info(self, peer: PeerRecord) -> EndpointInfo | str:
        key = (peer.name, peer.incarnation)
        if key not in self._infos:
            desc = peer.backends.get(self.name)
            try:
                self._infos[key] = decode_endpoint(desc, peer.name) if desc is not None else f"{peer.name} does not run nccl"
            except WireError as exc:
                self._infos[key] = str(exc)
        return self._infos[key]

    def _is_self(self, peer: PeerRecord) -> bool:
        return peer.name == self.ctx.name and peer.incarnation == self.ctx.incarnation

    def _uuid(self, device: int) -> str:
        if device not in self._uuids:
            self._uuids[device] = _nccl.normalize_uuid(str(torch.cuda.get_device_properties(device).uuid))
        return self._uuids[device]

    def _device_of(self, label: str) -> int | None:
        """This process's ordinal of the GPU published as ``label`` ("cuda:<uuid>"), if visible."""
        want = _nccl.normalize_uuid(label)
        for i in range(torch.cuda.device_count()):
            if self._uuid(i) == want:
                return i
        return None

    def _same_gpu_reason(self, peer: PeerRecord, region: RegionRecord) -> str:
        return (f"{peer.name}:{region.key!r} is on the GPU this end would use ({region.device.removeprefix('cuda:')}): "
                f"NCCL places two ranks on one GPU only from NCCL 2.30 with {_nccl.MULTI_RANK_GPU_ENV}=1 on both "
                f"ends (this process: NCCL {self._lib.version_string}); use ipc for same-GPU transfers")

    def unreachable_reason(self, peer: PeerRecord, region: RegionRecord, local: MemoryKind) -> str | None:
        info = self._info(peer)
        if isinstance(info, str):
            return info
        if not region.device.startswith("cuda:"):
            return f"{peer.name}:{region.key!r} is host memory; nccl moves GPU memory only"
        if info.version != self._lib.version:
            theirs = ".".join(map(str, info.version))
            return f"{peer.name} runs NCCL {theirs} and this process NCCL {self._lib.version_string}: NCCL needs the same version on both ends"
        if self._is_self(peer):
            return None
        # The local tensor is not known here; with one visible GPU it can only be that one.
        if (peer.host == self.ctx.host and not _nccl.multi_rank_gpu(self._lib)
                and torch.cuda.device_count() == 1 and self._device_of(region.device) == 0):
            return self._same_gpu_reason(peer, region)
        return None

    # -- requests ---------------------------------------------------------------------------

    def _meta(self, op: str, **fields: Any) -> dict[str, Any]:
        return {"backend": self.name, "op": op, "from": self.ctx.name, "from_incarnation": self.ctx.incarnation, **fields}

    async def request(self, peer: PeerRecord, meta: Mapping[str, Any]) -> dict[str, Any]:
        """Sends one BACKEND request to ``peer``'s agent over this backend's own connection
        (lane "nccl") and returns the reply; the agent's refusals arrive as typed errors."""
        chan = await self._pool.get(peer.name, peer.incarnation, peer.agent)
        return await chan.request(FrameKind.BACKEND, meta)

    def _remaining(self) -> float:
        """Seconds left before the current deadline (the transfer's), else the default timeout."""
        left = anyio.current_effective_deadline() - anyio.current_time()
        return self.ctx.timeout if math.isinf(left) else max(0.0, left)

    # -- data path: initiator ----------------------------------------------------------------

    async def put(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        """Writes ``local`` (CUDA) into the remote region; returns once the bytes are in the
        target's memory. Waits for the caller's queued work first (see the module docstring)."""
        await self._transfer(_Dir.PUT, local, remote)

    async def get(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        """Reads the remote range into ``local`` (CUDA); returns once the bytes are there."""
        await self._transfer(_Dir.GET, local, remote)

    def _ready(self, local: LocalBuffer) -> Any:
        ready = getattr(local, "ready", None)
        if ready is None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(local.tensor.device))
        return ready

    async def _transfer(self, direction: str, local: LocalBuffer, remote: RemoteTarget) -> None:
        tensor, peer = local.tensor, remote.peer
        what = f"nccl {direction} of {remote.nbytes} bytes at offset {remote.offset} of {peer.name}:{remote.region.key!r}"
        if tensor.device.type != "cuda":
            raise BackendUnavailableError(f"{what}: the local tensor is on {tensor.device}; nccl moves GPU memory only")
        ready = self._ready(local)
        if self._is_self(peer):
            await self._self_transfer(direction, local, ready, remote, what)
            return
        device = tensor.device.index
        if self._uuid(device) == _nccl.normalize_uuid(remote.region.device) and not _nccl.multi_rank_gpu(self._lib):
            raise BackendUnavailableError(f"{what}: {self._same_gpu_reason(peer, remote.region)}")
        for _attempt in range(2):
            link = await self._initiator_link(peer, device, remote.region.device, what)
            posted = await self._post(link, direction, local, ready, remote, what)
            if posted is not None:
                break
            # The target no longer had that communicator (it aborted it); nothing was enqueued.
        else:
            raise PeerLostError(f"{what}: {peer.name} dropped two nccl communicators in a row")
        seq, slot, event = posted
        try:
            await self._wait(link, event, what)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._grace_or_abort(link, event, what)
            raise
        finally:
            link.slots.release()
        if direction == _Dir.PUT:
            assert link.ack_host is not None
            got = int(link.ack_host[slot])
            if got != seq:
                err = TransportInternalError(f"{what}: the ack on comm {link.cid} carried transfer {got}, not {seq}: "
                                             "the two ranks' operations did not match; communicator aborted")
                self._fail(link, err)
                raise err

    async def _post(self, link: _Link, direction: str, local: LocalBuffer, ready: Any, remote: RemoteTarget, what: str) -> tuple[int, int, Any] | None:
        """Asks the target to enqueue its side of transfer ``link.seq`` and enqueues ours, in
        the communicator's issue order. Returns (seq, ack slot, completion event), or None when
        the target no longer has the communicator (nothing enqueued; ``link`` is dropped)."""
        await link.slots.acquire()
        keep_slot = False
        try:
            async with link.order:
                if link.lost is not None:
                    raise self._lost_error(link, what)
                seq = link.seq
                meta = self._meta(_Op.POST, cid=link.cid, seq=seq, dir=direction, key=remote.region.key,
                                  dtype=dtype_name(local.tensor.dtype), offset=remote.offset, nbytes=remote.nbytes,
                                  timeout=self._remaining())
                try:
                    reply = await self.request(remote.peer, meta)
                except PeerLostError as exc:
                    # The connection broke (or the peer restarted): the target may have enqueued.
                    self._fail(link, PeerLostError(f"{what}: the post to {remote.peer.name} failed ({exc}); comm {link.cid} aborted"))
                    raise
                except TransportError:
                    # A refusal (key, dtype, bounds, read-only, ...): the target answers with an
                    # error only before it enqueues anything.
                    raise
                except BaseException:
                    # Cancelled after the request may have reached the target: the issue order is lost.
                    self._fail(link, TransferAbortedError(f"{what}: cancelled while posting; comm {link.cid} aborted", partial=True))
                    raise
                if reply.get("comm") != "ok":
                    self._fail(link, PeerLostError(f"{remote.peer.name} no longer has comm {link.cid}"), tell=False)
                    return None
                link.seq += 1
                slot = seq % _ACK_SLOTS
                with anyio.CancelScope(shield=True):  # the target has enqueued: ours must follow
                    event = await self._enqueue_initiator(link, direction, local, ready, remote.nbytes, slot, what)
                keep_slot = True  # released by the caller once the transfer is complete
                return seq, slot, event
        finally:
            if not keep_slot:
                link.slots.release()

    async def _enqueue_initiator(self, link: _Link, direction: str, local: LocalBuffer, ready: Any, nbytes: int, slot: int, what: str) -> Any:
        stream, comm, peer = link.stream, link.comm, link.other
        handle = stream.cuda_stream
        stream.wait_event(ready)
        try:
            with anyio.fail_after(self.ctx.timeout):
                if direction == _Dir.PUT:
                    await self._settled(comm, comm.send(local.tensor.data_ptr(), nbytes, peer, handle), what)
                    await self._settled(comm, comm.recv(link.ack_dev[slot].data_ptr(), _ACK_BYTES, peer, handle), what)
                    assert link.ack_host is not None
                    with torch.cuda.stream(stream):
                        link.ack_host[slot].copy_(link.ack_dev[slot], non_blocking=True)
                else:
                    await self._settled(comm, comm.recv(local.tensor.data_ptr(), nbytes, peer, handle), what)
        except NcclError as exc:
            raise self._fail(link, self._nccl_error(exc, what, link)) from exc
        except TimeoutError:
            raise self._fail(link, PeerLostError(f"{what}: NCCL did not finish enqueueing on comm {link.cid} within {self.ctx.timeout:g}s")) from None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    async def _settled(comm: Communicator, result: NcclResult, what: str) -> None:
        if result == NcclResult.IN_PROGRESS:  # e.g. NCCL connecting a channel at first use
            await comm.settle(what)

    async def _wait(self, link: _Link, event: Any, what: str) -> None:
        """Polls ``event`` (with backoff) while watching the communicator for failure.

        Raises:
            PeerLostError / TransportInternalError / TransferAbortedError: the communicator
            failed or was aborted (it is aborted then).
        """
        delay = 0.0
        while not event.query():
            if link.lost is not None:
                raise self._lost_error(link, what)
            try:
                link.comm.state()
            except NcclError as exc:
                raise self._fail(link, self._nccl_error(exc, what, link)) from exc
            await anyio.sleep(delay)
            delay = min(max(2 * delay, 20e-6), 2e-3)

    async def _grace_or_abort(self, link: _Link, event: Any, what: str) -> None:
        """After a cancelled or failed wait: the operations were enqueued, so NCCL may still be
        using the buffers. Let them finish briefly, else abort the communicator (NCCL then lets
        go of them)."""
        if link.lost is not None:
            return
        with anyio.move_on_after(_CANCEL_GRACE_S):
            try:
                await self._wait(link, event, what)
                return
            except TransportError:
                return  # the link failed and was aborted
        err = TransferAbortedError(f"{what} was cancelled or timed out on the device; comm {link.cid} to {link.peer} aborted", partial=True)
        log.warning("transport %s: %s", self.ctx.name, err)
        self._fail(link, err)

    # -- opening communicators (initiator) --------------------------------------------------

    async def _initiator_link(self, peer: PeerRecord, device: int, remote_label: str, what: str) -> _Link:
        key = (peer.name, peer.incarnation, device, _nccl.normalize_uuid(remote_label))
        lock = self._opening.setdefault(key, anyio.Lock())
        async with lock:
            link = self._links.get(key)
            if link is not None and link.lost is None:
                return link
            link = await self._open(peer, device, remote_label, what)
            self._links[key] = link
            return link

    async def _open(self, peer: PeerRecord, device: int, remote_label: str, what: str) -> _Link:
        store = self._store()
        remote_uuid = _nccl.normalize_uuid(remote_label)
        cid = comm_id(self.ctx.name, self.ctx.incarnation, peer.name, peer.incarnation, self._uuid(device), remote_uuid, next(self._ids))
        try:
            uid = self._lib.unique_id()
        except NcclError as exc:
            raise TransportInternalError(f"{what}: cannot open an nccl communicator: {exc}") from exc
        store_key = await publish_unique_id(store, self.ctx.auth, cid, uid)
        try:
            try:
                comm = Communicator.start(self._lib, uid, 2, 0, device, cid)
            except NcclError as exc:
                raise TransportInternalError(f"{what}: cannot open comm {cid}: {exc}") from exc
            link = self._new_link(cid, peer.name, peer.incarnation, comm, initiator=True)
            link.pair, link.record = f"{self._uuid(device)}>{remote_uuid}", peer
            meta = self._meta(_Op.OPEN, cid=cid, device=remote_label, pair=link.pair, timeout=self._remaining())
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._connect, link, what)
                    await self.request(peer, meta)
            except BaseException as exc:
                error = _first_error(exc)
                if isinstance(error, TransportError):
                    self._fail(link, error)
                    if error is exc:
                        raise
                    raise error from None
                self._fail(link, TransferAbortedError(f"{what}: opening comm {cid} was interrupted"))
                raise
            info = self._info(peer)
            path = _window_path_reason(self._lib, info) if isinstance(info, EndpointInfo) else "?"
            log.info("transport %s: nccl comm %s open (NCCL %s, cuda:%d; send/recv: %s)", self.ctx.name, cid, self._lib.version_string, device, path)
            return link
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await _store_call(store, store.delete, store_key)
                except TransportError as exc:
                    log.debug("transport %s: could not delete %s from the store: %s", self.ctx.name, store_key, exc)

    async def _connect(self, link: _Link, what: str) -> None:
        """Finishes this rank's init and exchanges the warm-up message (both ranks at once)."""
        try:
            await link.comm.settle(f"init for {what}")
            event = await self._warm_up(link)
        except NcclError as exc:
            raise self._fail(link, self._nccl_error(exc, f"opening comm {link.cid} for {what}", link)) from exc
        await self._wait(link, event, f"connecting comm {link.cid}")

    async def _warm_up(self, link: _Link) -> Any:
        comm, stream, peer = link.comm, link.stream, link.other
        h = stream.cuda_stream
        ptr0, ptr1 = link.ack_dev[0].data_ptr(), link.ack_dev[1].data_ptr()
        result = comm.grouped("the warm-up exchange", [lambda: comm.send(ptr0, _ACK_BYTES, peer, h), lambda: comm.recv(ptr1, _ACK_BYTES, peer, h)])
        await self._settled(comm, result, f"warm-up on comm {link.cid}")
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _new_link(self, cid: str, peer: str, incarnation: str, comm: Communicator, *, initiator: bool) -> _Link:
        try:
            with torch.cuda.device(comm.device):
                stream = torch.cuda.Stream(comm.device)
                ack_dev = torch.zeros(_ACK_SLOTS, dtype=torch.int64, device=f"cuda:{comm.device}")
                ack_host = torch.full((_ACK_SLOTS,), -1, dtype=torch.int64).pin_memory() if initiator else None
        except BaseException:
            comm.abort()
            raise
        return _Link(cid, peer, incarnation, comm, stream, ack_dev, ack_host)

    def _store(self) -> Store:
        if self.ctx.store is None:
            raise TransportInternalError("the nccl backend needs the rendezvous store to exchange NCCL unique ids")
        return self.ctx.store

    # -- failure handling -------------------------------------------------------------------

    def _nccl_error(self, exc: NcclError, what: str, link: _Link) -> TransportError:
        cls = PeerLostError if exc.remote else TransportInternalError
        err = cls(f"{what} failed on comm {link.cid} with {link.peer}: {exc}")
        err.__cause__ = exc
        return err

    def _lost_error(self, link: _Link, what: str) -> TransportError:
        why = link.lost
        cls = type(why) if isinstance(why, (PeerLostError, TransferAbortedError)) else TransportInternalError
        err = cls(f"{what}: comm {link.cid} was aborted: {why}")
        if isinstance(err, TransferAbortedError):
            err.partial = True
        err.__cause__ = why
        return err

    def _fail(self, link: _Link, why: TransportError, *, tell: bool = True) -> TransportError:
        """Marks ``link`` lost, aborts its communicator and forgets it; for our own (initiator)
        links also asks the target to abort its side, unless ``tell`` is False (the peer is
        gone, or we are closing). Returns ``why``."""
        if link.lost is None:
            link.lost = why
            log.info("transport %s: aborting nccl comm %s (%s)", self.ctx.name, link.cid, why)
            link.comm.abort()
            if tell:
                self._tell_close(link)
        for key in [k for k, v in self._links.items() if v is link]:
            del self._links[key]
        for device in [d for d, v in self._selves.items() if v is link]:
            del self._selves[device]
        if self._served.get(link.cid) is link:
            del self._served[link.cid]
        return why

    def _tell_close(self, link: _Link) -> None:
        """Asks the target to abort its side of our ``link`` (best effort, in the background):
        it may have operations posted that would otherwise wait for its own deadline."""
        peer = link.record
        if self._closed or peer is None:
            return

        async def close() -> None:
            with anyio.move_on_after(min(_CLOSE_TIMEOUT_S, self.ctx.timeout)):
                try:
                    await self.request(peer, self._meta(_Op.CLOSE, cid=link.cid))
                except TransportError as exc:
                    log.debug("transport %s: could not tell %s to close comm %s: %s", self.ctx.name, peer.name, link.cid, exc)

        self.ctx.tg.start_soon(close)

    # -- sending to self ---------------------------------------------------------------------

    async def _self_transfer(self, direction: str, local: LocalBuffer, ready: Any, remote: RemoteTarget, what: str) -> None:
        ticket_id = next(self._ids)
        ticket = _Ticket(direction, local, ready)
        self._tickets[ticket_id] = ticket
        try:
            meta = self._meta(_Op.SELF, ticket=ticket_id, dir=direction, key=remote.region.key,
                              dtype=dtype_name(local.tensor.dtype), offset=remote.offset, nbytes=remote.nbytes)
            try:
                await self.request(remote.peer, meta)
            except BaseException:
                if ticket.event is not None and ticket.link is not None:  # enqueued before we stopped waiting
                    with anyio.CancelScope(shield=True):
                        await self._grace_or_abort(ticket.link, ticket.event, what)
                raise
            assert ticket.event is not None and ticket.link is not None
            try:
                await self._wait(ticket.link, ticket.event, what)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._grace_or_abort(ticket.link, ticket.event, what)
                raise
        finally:
            del self._tickets[ticket_id]

    async def _self_link(self, device: int) -> _Link:
        async with self._self_lock:
            link = self._selves.get(device)
            if link is not None and link.lost is None:
                return link
            cid = f"{self.ctx.name}.{self.ctx.incarnation}/self/cuda:{device}/{next(self._ids)}"
            try:
                comm = Communicator.start(self._lib, self._lib.unique_id(), 1, 0, device, cid)
            except NcclError as exc:
                raise TransportInternalError(f"cannot open the 1-rank nccl comm {cid}: {exc}") from exc
            link = self._new_link(cid, self.ctx.name, self.ctx.incarnation, comm, initiator=False)
            try:
                with anyio.fail_after(self.ctx.timeout):
                    await comm.settle("init")
            except (NcclError, TimeoutError) as exc:
                raise self._fail(link, TransportInternalError(f"cannot open the 1-rank nccl comm {cid}: {exc or 'timed out'}")) from exc
            self._selves[device] = link
            return link

    async def _serve_self(self, meta: Mapping[str, Any], check_region: RegionCheck) -> dict[str, Any]:
        ticket = self._tickets.get(meta.get("ticket")) if meta.get("from_incarnation") == self.ctx.incarnation else None  # type: ignore[arg-type]
        if ticket is None:
            raise TransportInternalError(f"{self.ctx.name}: no local nccl transfer {meta.get('ticket')!r} is waiting (self transfers come from this very Transport)")
        direction, nbytes = _direction(meta), _int(meta, "nbytes")
        region = check_region(FrameKind.PUT if direction == _Dir.PUT else FrameKind.GET, meta, nbytes)
        target = _cuda_tensor(region, self.ctx.name)
        src = ticket.local.tensor
        if target.device != src.device:
            raise BackendUnavailableError(f"{self.ctx.name}:{region.key!r} is on {target.device} and the local tensor on {src.device}: "
                                          "a 1-rank NCCL communicator spans one GPU; use ipc between GPUs of one process")
        link = await self._self_link(src.device.index)
        region_ptr = target.data_ptr() + _int(meta, "offset")
        send_ptr, recv_ptr = (src.data_ptr(), region_ptr) if direction == _Dir.PUT else (region_ptr, src.data_ptr())
        comm, stream = link.comm, link.stream
        h = stream.cuda_stream
        stream.wait_event(ticket.ready)
        what = f"nccl {direction} of {nbytes} bytes to self ({region.key!r})"
        try:
            result = comm.grouped(what, [lambda: comm.send(send_ptr, nbytes, 0, h), lambda: comm.recv(recv_ptr, nbytes, 0, h)])
            with anyio.fail_after(self.ctx.timeout):
                await self._settled(comm, result, what)
        except (NcclError, TimeoutError) as exc:
            err = self._nccl_error(exc, what, link) if isinstance(exc, NcclError) else TransportInternalError(f"{what}: enqueueing timed out")
            raise self._fail(link, err) from exc
        event = torch.cuda.Event()
        event.record(stream)
        ticket.event, ticket.link = event, link
        return {"comm": "ok"}

    # -- agent side (target) -----------------------------------------------------------------

    async def serve_request(self, meta: Mapping[str, Any], check_region: RegionCheck) -> Mapping[str, Any]:
        """Serves a peer's nccl request (``open``, ``post``, ``close``; ``self`` from this very
        Transport). A refusal raises the matching TransportError before anything is enqueued."""
        op = meta.get("op")
        if op == _Op.POST:
            return await self._serve_post(meta, check_region)
        if op == _Op.OPEN:
            return await self._serve_open(meta)
        if op == _Op.CLOSE:
            link = self._served.get(_str(meta, "cid"))
            if link is not None and link.peer == meta.get("from"):
                self._fail(link, TransferAbortedError(f"{link.peer} aborted comm {link.cid}", partial=True))
            return {"comm": "closed"}
        if op == _Op.SELF:
            return await self._serve_self(meta, check_region)
        raise TransportInternalError(f"unknown nccl request {op!r}")

    async def _serve_open(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        peer, inc, cid = _str(meta, "from"), _str(meta, "from_incarnation"), _str(meta, "cid")
        label, pair = _str(meta, "device"), _str(meta, "pair")
        timeout = _timeout(meta, self.ctx.timeout)
        uid = await read_unique_id(self._store(), self.ctx.auth, cid, peer)
        device = self._device_of(label)
        if device is None:
            raise BackendUnavailableError(f"{self.ctx.name} sees no GPU {label.removeprefix('cuda:')} (comm {cid} from {peer})")
        for old in [l for l in self._served.values() if l.peer == peer and l.pair == pair]:
            self._fail(old, TransferAbortedError(f"{peer} opened a new comm {cid} in place of {old.cid}", partial=True))
        try:
            comm = Communicator.start(self._lib, uid, 2, 1, device, cid)
        except NcclError as exc:
            raise TransportInternalError(f"{self.ctx.name}: cannot join comm {cid} from {peer}: {exc}") from exc
        link = self._new_link(cid, peer, inc, comm, initiator=False)
        link.pair = pair
        self._served[cid] = link
        try:
            with anyio.fail_after(timeout):
                await self._connect(link, f"comm {cid} from {peer}")
        except TimeoutError:
            raise self._fail(link, PeerLostError(f"{self.ctx.name}: comm {cid} from {peer} did not connect within {timeout:g}s")) from None
        except BaseException as exc:
            self._fail(link, exc if isinstance(exc, TransportError) else TransferAbortedError(f"opening comm {cid} was interrupted"))
            raise
        return {"comm": "ok", "nccl": list(self._lib.version)}

    async def _serve_post(self, meta: Mapping[str, Any], check_region: RegionCheck) -> dict[str, Any]:
        direction, nbytes = _direction(meta), _int(meta, "nbytes")
        cid, seq = _str(meta, "cid"), _int(meta, "seq")
        if nbytes <= 0:
            raise TransportInternalError(f"bad nccl post of {nbytes} bytes")
        region = check_region(FrameKind.PUT if direction == _Dir.PUT else FrameKind.GET, meta, nbytes)
        target = _cuda_tensor(region, self.ctx.name)
        link = self._served.get(cid)
        if link is None or link.lost is not None or link.peer != meta.get("from") or link.incarnation != meta.get("from_incarnation"):
            return {"comm": "gone"}
        if target.device.index != link.comm.device:
            raise TransportInternalError(f"{self.ctx.name}:{region.key!r} is on {target.device}, comm {cid} on cuda:{link.comm.device}")
        what = f"nccl {direction} of {nbytes} bytes at offset {meta['offset']} of {self.ctx.name}:{region.key!r} for {link.peer}"
        deadline = anyio.current_time() + _timeout(meta, self.ctx.timeout) + _TARGET_GRACE_S
        await link.order.acquire()  # released once our side is fully enqueued (_finish_post)
        if link.lost is not None or seq != link.seq:
            link.order.release()
            if link.lost is None:
                self._fail(link, TransportInternalError(f"comm {cid}: {link.peer} posted transfer {seq}, expected {link.seq}"))
            return {"comm": "gone"}
        link.seq += 1
        ptr = target.data_ptr() + _int(meta, "offset")
        h = link.stream.cuda_stream
        try:
            first = link.comm.recv(ptr, nbytes, link.other, h) if direction == _Dir.PUT else link.comm.send(ptr, nbytes, link.other, h)
        except NcclError as exc:
            link.order.release()
            self._fail(link, self._nccl_error(exc, what, link))
            return {"comm": "gone"}
        # The rest waits for NCCL (which may be connecting a channel with the initiator, who
        # enqueues only after this reply), so it runs after the reply, still holding the order.
        self.ctx.tg.start_soon(self._finish_post, link, direction, first, seq, region, deadline, what)
        return {"comm": "ok"}

    async def _finish_post(self, link: _Link, direction: str, first: NcclResult, seq: int, region: Any, deadline: float, what: str) -> None:
        """Completes the target's side of a post and watches it until done (``region`` is held
        so that its tensor outlives NCCL's use of it); aborts the comm on failure or overrun."""
        comm, stream = link.comm, link.stream
        try:
            with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                try:
                    await self._settled(comm, first, what)
                    if direction == _Dir.PUT:
                        slot = seq % _ACK_SLOTS
                        with torch.cuda.stream(stream):
                            link.ack_dev[slot].fill_(seq)
                        await self._settled(comm, comm.send(link.ack_dev[slot].data_ptr(), _ACK_BYTES, link.other, stream.cuda_stream), what)
                    event = torch.cuda.Event()
                    event.record(stream)
                finally:
                    link.order.release()
                await self._wait(link, event, what)
        except NcclError as exc:
            log.warning("transport %s: %s", self.ctx.name, self._fail(link, self._nccl_error(exc, what, link)))
        except TimeoutError:
            err = PeerLostError(f"{what} did not complete by the initiator's deadline on comm {link.cid}; aborted")
            log.warning("transport %s: %s", self.ctx.name, err)
            self._fail(link, err)
        except TransportError as exc:
            log.info("transport %s: %s", self.ctx.name, exc)

    # -- lifecycle ---------------------------------------------------------------------------

    def forget_peer(self, peer: str) -> None:
        why = PeerLostError(f"{peer} left or restarted")
        for link in [*self._links.values(), *self._served.values()]:
            if link.peer == peer:
                self._fail(link, why, tell=False)
        self._infos = {k: v for k, v in self._infos.items() if k[0] != peer}
        self._opening = {k: v for k, v in self._opening.items() if k[0] != peer}
        self._pool.forget(peer)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        why = TransferAbortedError(f"transport {self.ctx.name} is closing", partial=True)
        for link in [*self._links.values(), *self._served.values(), *self._selves.values()]:
            self._fail(link, why, tell=False)
        self._pool.close()


# -- helpers -------------------------------------------------------------------------------------


async def _store_call(store: Store, fn: Any, *args: Any) -> Any:
    return await anyio.to_thread.run_sync(fn, *args) if store.blocking else fn(*args)


async def publish_unique_id(store: Store, auth: Authenticator, cid: str, uid: bytes) -> str:
    """Publishes the NCCL unique id of communicator ``cid`` (signed when a token is set); returns
    the store key. Only the initiator of ``cid`` ever publishes it."""
    key = STORE_PREFIX + cid
    await _store_call(store, store.set, key, auth.sign_record(uid))
    return key


async def read_unique_id(store: Store, auth: Authenticator, cid: str, initiator: str) -> bytes:
    """The unique id ``initiator`` published for ``cid``.

    Raises:
        TransportInternalError: none is published, it is not signed with our token, or it is
            not a unique id.
    """
    data = await store.aget(STORE_PREFIX + cid)
    if data is None:
        raise TransportInternalError(f"no NCCL unique id for comm {cid} under {STORE_PREFIX + cid!r} in {store.url}")
    try:
        uid = auth.open_record(data, initiator)
    except AuthenticationError as exc:
        raise TransportInternalError(f"the NCCL unique id of comm {cid}: {exc}") from exc
    if len(uid) != _nccl.UNIQUE_ID_BYTES:
        raise TransportInternalError(f"the NCCL unique id of comm {cid} has {len(uid)} bytes, not {_nccl.UNIQUE_ID_BYTES}")
    return uid


def _first_error(exc: BaseException) -> BaseException:
    """The first non-cancellation error inside a (nested) exception group, else ``exc``."""
    inner = getattr(exc, "exceptions", None)
    if isinstance(inner, tuple):
        for e in inner:
            found = _first_error(e)
            if not isinstance(found, anyio.get_cancelled_exc_class()):
                return found
    return exc


def _str(meta: Mapping[str, Any], key: str) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or not value or len(value) > _MAX_ID_LEN:
        raise TransportInternalError(f"bad nccl request: {key}={value!r}")
    return value


def _int(meta: Mapping[str, Any], key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TransportInternalError(f"bad nccl request: {key}={value!r}")
    return value


def _timeout(meta: Mapping[str, Any], default: float) -> float:
    value = meta.get("timeout", default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        return default
    return min(float(value), 24 * 3600.0)


def _direction(meta: Mapping[str, Any]) -> str:
    value = meta.get("dir")
    if value not in (_Dir.PUT, _Dir.GET):
        raise TransportInternalError(f"bad nccl request: dir={value!r}")
    return value


def _cuda_tensor(region: Any, owner: str) -> torch.Tensor:
    tensor = region.tensor
    if tensor.device.type != "cuda":
        raise BackendUnavailableError(f"{owner}:{region.key!r} is host memory; nccl moves GPU memory only")
    return tensor
