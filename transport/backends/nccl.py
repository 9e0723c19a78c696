"""``nccl``: GPU memory to GPU memory over NCCL point-to-point, one communicator per peer pair.

NCCL is what GPU clusters already tune for NVLink and InfiniBand (GPUDirect RDMA). This backend
uses its point-to-point operations without its collective coupling: every communicator holds
exactly two ranks, the two ends of one peer pair, so a dead or slow peer can only ever stall
the communicator it shares with its one partner. How communicators are opened, ordered, watched
and aborted: :mod:`transport.backends._nccl_links`. This module is the Backend on top of them.

A put (send/recv path): holding the lock, the initiator asks the target's agent to ``post``
transfer number ``seq``; the agent checks key, dtype, bounds and writability (a refusal arrives
as the matching typed error and nothing is enqueued anywhere), enqueues on its stream an
``ncclRecv`` into the region and then an 8-byte ``ncclSend`` of ``seq`` back (the ack), and
replies at once. The initiator then enqueues, on its stream and after the caller's ready event,
``ncclSend`` of the tensor and ``ncclRecv`` of the ack, and releases the lock. The ack leaves
the target only after its receive kernel completed (stream order), so when the initiator's ack
has arrived the bytes are in the target's memory: that is when the Transfer completes. An ack
that does not carry ``seq`` means mismatched matching and aborts the communicator. A get: the
target sends from its region, the initiator receives; complete when that receive finished. The
target aborts the communicator on its own when a posted operation overruns the initiator's
timeout (plus a grace).

Sending to self (the peer is this very Transport): a 1-rank communicator on the device, with
the send and its receive grouped (``ncclGroupStart/End``); the request still goes through this
Transport's own agent so that the region checks are the same.

Stream semantics: the transport-owned stream of a communicator waits for the caller's ready
event (``LocalBuffer.ready``: recorded on the caller's current stream when the transfer was
started; recorded here if absent) before reading or writing the tensor; completion means the
bytes are in place, as above. Completion is observed by polling CUDA events (with backoff).

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
from collections.abc import Mapping
from typing import Any

import anyio
import torch

from .. import _nccl
from .._agent import ChannelPool
from .._errors import (
    BackendUnavailableError,
    PeerLostError,
    TransferAbortedError,
    TransportError,
    TransportInternalError,
)
from .._nccl import Library, NcclError, NcclResult
from .._tensors import MemoryKind, dtype_name
from .._wire import FrameKind, PeerRecord, RegionRecord, WireError
from ._base import Backend, BackendContext, LocalBuffer, RegionCheck, RemoteTarget
from ._nccl_links import (
    ACK_BYTES,
    ACK_SLOTS,
    Link,
    Links,
    Op,
    meta_int,
    meta_str,
    meta_timeout,
    remaining,
    request_meta,
    settled,
)

log = logging.getLogger(__name__)

ENDPOINT_FORMAT = "transport.nccl"
ENDPOINT_VERSION = 1

_TARGET_GRACE_S = 5.0  # the target aborts a posted operation this long after the initiator's timeout


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


@dataclasses.dataclass(eq=False)
class _Ticket:
    """A transfer to this very Transport, waiting for its own agent to enqueue it."""

    direction: str
    local: LocalBuffer
    ready: Any
    event: Any = None
    link: Link | None = None  # set just before the agent enqueues (from then on NCCL may use ``local``)


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
        self._links = Links(ctx, lib, self.request, self._path_reason)
        self._tickets: dict[int, _Ticket] = {}
        self._ids = itertools.count(1)
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

    def _path_reason(self, peer: PeerRecord) -> str:
        info = self._info(peer)
        return _window_path_reason(self._lib, info) if isinstance(info, EndpointInfo) else "?"

    def _is_self(self, peer: PeerRecord) -> bool:
        return peer.name == self.ctx.name and peer.incarnation == self.ctx.incarnation

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
                and torch.cuda.device_count() == 1 and self._links.device_of(region.device) == 0):
            return self._same_gpu_reason(peer, region)
        return None

    # -- requests ---------------------------------------------------------------------------

    def _meta(self, op: str, **fields: Any) -> dict[str, Any]:
        return request_meta(self.ctx, op, **fields)

    async def request(self, peer: PeerRecord, meta: Mapping[str, Any]) -> dict[str, Any]:
        """Sends one BACKEND request to ``peer``'s agent over this backend's own connection
        (lane "nccl") and returns the reply; the agent's refusals arrive as typed errors."""
        chan = await self._pool.get(peer.name, peer.incarnation, peer.agent)
        return await chan.request(FrameKind.BACKEND, meta)

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
        if self._links.uuid(device) == _nccl.normalize_uuid(remote.region.device) and not _nccl.multi_rank_gpu(self._lib):
            raise BackendUnavailableError(f"{what}: {self._same_gpu_reason(peer, remote.region)}")
        for _attempt in range(2):
            link = await self._links.initiator(peer, device, remote.region.device, what)
            posted = await self._post(link, direction, local, ready, remote, what)
            if posted is not None:
                break
            # The target no longer had that communicator (it aborted it); nothing was enqueued.
        else:
            raise PeerLostError(f"{what}: {peer.name} dropped two nccl communicators in a row")
        seq, slot, event = posted
        try:
            try:
                await self._links.wait(link, event, what)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._links.grace_or_abort(link, event, what)
                raise
            if direction == _Dir.PUT:
                assert link.ack_host is not None
                got = int(link.ack_host[slot])
                if got != seq:
                    err = TransportInternalError(f"{what}: the ack on comm {link.cid} carried transfer {got}, not {seq}: "
                                                 "the two ranks' operations did not match; communicator aborted")
                    self._links.fail(link, err)
                    raise err
        finally:
            link.slots[slot].release()  # only now: transfer seq + ACK_SLOTS reuses the slot

    async def _post(self, link: Link, direction: str, local: LocalBuffer, ready: Any, remote: RemoteTarget, what: str) -> tuple[int, int, Any] | None:
        """Asks the target to enqueue its side of transfer ``link.seq`` and enqueues ours, in
        the communicator's issue order. Returns (seq, ack slot, completion event) with the ack
        slot held (the caller releases it), or None when the target no longer has the
        communicator (nothing enqueued; ``link`` is dropped)."""
        async with link.order:
            if link.lost is not None:
                raise self._links.lost_error(link, what)
            seq = link.seq
            slot = seq % ACK_SLOTS
            # Held until transfer seq - ACK_SLOTS has read its ack; nothing is sent before.
            await link.slots[slot].acquire()
            keep_slot = False
            try:
                if link.lost is not None:
                    raise self._links.lost_error(link, what)
                meta = self._meta(Op.POST, cid=link.cid, seq=seq, dir=direction, key=remote.region.key,
                                  dtype=dtype_name(local.tensor.dtype), offset=remote.offset, nbytes=remote.nbytes,
                                  timeout=remaining(self.ctx))
                try:
                    reply = await self.request(remote.peer, meta)
                except PeerLostError as exc:
                    # The connection broke (or the peer restarted): the target may have enqueued.
                    self._links.fail(link, PeerLostError(f"{what}: the post to {remote.peer.name} failed ({exc}); comm {link.cid} aborted"))
                    raise
                except TransportError:
                    # A refusal (key, dtype, bounds, read-only, ...): the target answers with an
                    # error only before it enqueues anything.
                    raise
                except BaseException:
                    # Cancelled after the request may have reached the target: the issue order is lost.
                    self._links.fail(link, TransferAbortedError(f"{what}: cancelled while posting; comm {link.cid} aborted", partial=True))
                    raise
                if reply.get("comm") != "ok":
                    self._links.fail(link, PeerLostError(f"{remote.peer.name} no longer has comm {link.cid}"), tell=False)
                    return None
                link.seq += 1
                with anyio.CancelScope(shield=True):  # the target has enqueued: ours must follow
                    event = await self._enqueue_initiator(link, direction, local, ready, remote.nbytes, slot, what)
                keep_slot = True  # released by the caller once the transfer is complete
                return seq, slot, event
            finally:
                if not keep_slot:
                    link.slots[slot].release()

    async def _enqueue_initiator(self, link: Link, direction: str, local: LocalBuffer, ready: Any, nbytes: int, slot: int, what: str) -> Any:
        if link.lost is not None:  # aborted while we waited for the reply: its stream is gone
            raise self._links.lost_error(link, what)
        stream, comm, peer = link.stream, link.comm, link.other
        handle = stream.cuda_stream
        stream.wait_event(ready)
        try:
            with anyio.fail_after(self.ctx.timeout):
                if direction == _Dir.PUT:
                    await settled(comm, comm.send(local.tensor.data_ptr(), nbytes, peer, handle), what)
                    await settled(comm, comm.recv(link.ack_dev[slot].data_ptr(), ACK_BYTES, peer, handle), what)
                    assert link.ack_host is not None
                    with torch.cuda.stream(stream):
                        link.ack_host[slot].copy_(link.ack_dev[slot], non_blocking=True)
                else:
                    await settled(comm, comm.recv(local.tensor.data_ptr(), nbytes, peer, handle), what)
        except NcclError as exc:
            raise self._links.fail(link, self._links.nccl_error(exc, what, link)) from exc
        except TimeoutError:
            raise self._links.fail(link, PeerLostError(f"{what}: NCCL did not finish enqueueing on comm {link.cid} within {self.ctx.timeout:g}s")) from None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    # -- sending to self ---------------------------------------------------------------------

    async def _self_transfer(self, direction: str, local: LocalBuffer, ready: Any, remote: RemoteTarget, what: str) -> None:
        ticket_id = next(self._ids)
        ticket = _Ticket(direction, local, ready)
        self._tickets[ticket_id] = ticket
        try:
            meta = self._meta(Op.SELF, ticket=ticket_id, dir=direction, key=remote.region.key,
                              dtype=dtype_name(local.tensor.dtype), offset=remote.offset, nbytes=remote.nbytes)
            try:
                await self.request(remote.peer, meta)
            except BaseException:
                await self._abandon(ticket, what)
                raise
            assert ticket.event is not None and ticket.link is not None
            try:
                await self._links.wait(ticket.link, ticket.event, what)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._links.grace_or_abort(ticket.link, ticket.event, what)
                raise
        finally:
            del self._tickets[ticket_id]

    async def _abandon(self, ticket: _Ticket, what: str) -> None:
        """We stop waiting for our own agent: if it has started enqueueing (NCCL may use the
        tensor), let that finish briefly or abort the communicator."""
        if ticket.link is None:
            return  # nothing enqueued, and nothing will be: the agent checks the ticket first
        with anyio.CancelScope(shield=True):
            if ticket.event is not None:
                await self._links.grace_or_abort(ticket.link, ticket.event, what)
            else:
                self._links.fail(ticket.link, TransferAbortedError(f"{what} was cancelled while being enqueued; comm {ticket.link.cid} aborted", partial=True))

    async def _serve_self(self, meta: Mapping[str, Any], check_region: RegionCheck) -> dict[str, Any]:
        ticket_id = meta.get("ticket")
        mine = isinstance(ticket_id, int) and meta.get("from_incarnation") == self.ctx.incarnation
        ticket = self._tickets.get(ticket_id) if mine else None  # type: ignore[arg-type]
        if ticket is None:
            raise TransportInternalError(f"{self.ctx.name}: no local nccl transfer {ticket_id!r} is waiting (self transfers come from this very Transport)")
        direction, nbytes = _direction(meta), meta_int(meta, "nbytes")
        region = check_region(FrameKind.PUT if direction == _Dir.PUT else FrameKind.GET, meta, nbytes)
        target = _cuda_tensor(region, self.ctx.name)
        src = ticket.local.tensor
        if target.device != src.device:
            raise BackendUnavailableError(f"{self.ctx.name}:{region.key!r} is on {target.device} and the local tensor on {src.device}: "
                                          "a 1-rank NCCL communicator spans one GPU; use ipc between GPUs of one process")
        link = await self._links.self_link(src.device.index)
        what = f"nccl {direction} of {nbytes} bytes to self ({region.key!r})"
        if self._tickets.get(ticket_id) is not ticket:  # type: ignore[arg-type]
            # The transfer was cancelled while the communicator opened: its tensor may be gone.
            raise TransferAbortedError(f"{what} was cancelled before it was enqueued", partial=False)
        region_ptr = target.data_ptr() + meta_int(meta, "offset")
        send_ptr, recv_ptr = (src.data_ptr(), region_ptr) if direction == _Dir.PUT else (region_ptr, src.data_ptr())
        comm, stream = link.comm, link.stream
        h = stream.cuda_stream
        ticket.link = link
        stream.wait_event(ticket.ready)
        try:
            result = comm.grouped(what, [lambda: comm.send(send_ptr, nbytes, 0, h), lambda: comm.recv(recv_ptr, nbytes, 0, h)])
            with anyio.fail_after(self.ctx.timeout):
                await settled(comm, result, what)
        except (NcclError, TimeoutError) as exc:
            err = self._links.nccl_error(exc, what, link) if isinstance(exc, NcclError) else TransportInternalError(f"{what}: enqueueing timed out")
            raise self._links.fail(link, err) from exc
        event = torch.cuda.Event()
        event.record(stream)
        ticket.event = event
        return {"comm": "ok"}

    # -- agent side (target) -----------------------------------------------------------------

    async def serve_request(self, meta: Mapping[str, Any], check_region: RegionCheck) -> Mapping[str, Any]:
        """Serves a peer's nccl request (``open``, ``post``, ``close``; ``self`` from this very
        Transport). A refusal raises the matching TransportError before anything is enqueued."""
        op = meta.get("op")
        if op == Op.POST:
            return await self._serve_post(meta, check_region)
        if op == Op.OPEN:
            return await self._links.serve_open(meta)
        if op == Op.CLOSE:
            return self._links.serve_close(meta)
        if op == Op.SELF:
            return await self._serve_self(meta, check_region)
        raise TransportInternalError(f"unknown nccl request {op!r}")

    async def _serve_post(self, meta: Mapping[str, Any], check_region: RegionCheck) -> dict[str, Any]:
        direction, nbytes = _direction(meta), meta_int(meta, "nbytes")
        cid, seq = meta_str(meta, "cid"), meta_int(meta, "seq")
        if nbytes <= 0:
            raise TransportInternalError(f"bad nccl post of {nbytes} bytes")
        region = check_region(FrameKind.PUT if direction == _Dir.PUT else FrameKind.GET, meta, nbytes)
        target = _cuda_tensor(region, self.ctx.name)
        link = self._links.served(cid)
        if link is None or link.lost is not None or link.peer != meta.get("from") or link.incarnation != meta.get("from_incarnation"):
            return {"comm": "gone"}
        if target.device.index != link.comm.device:
            raise TransportInternalError(f"{self.ctx.name}:{region.key!r} is on {target.device}, comm {cid} on cuda:{link.comm.device}")
        what = f"nccl {direction} of {nbytes} bytes at offset {meta['offset']} of {self.ctx.name}:{region.key!r} for {link.peer}"
        deadline = anyio.current_time() + meta_timeout(meta, self.ctx.timeout) + _TARGET_GRACE_S
        await link.order.acquire()  # released once our side is fully enqueued (_finish_post)
        if link.lost is not None or seq != link.seq:
            link.order.release()
            if link.lost is None:
                self._links.fail(link, TransportInternalError(f"comm {cid}: {link.peer} posted transfer {seq}, expected {link.seq}"))
            return {"comm": "gone"}
        link.seq += 1
        ptr = target.data_ptr() + meta_int(meta, "offset")
        h = link.stream.cuda_stream
        try:
            first = link.comm.recv(ptr, nbytes, link.other, h) if direction == _Dir.PUT else link.comm.send(ptr, nbytes, link.other, h)
        except NcclError as exc:
            link.order.release()
            self._links.fail(link, self._links.nccl_error(exc, what, link))
            return {"comm": "gone"}
        # The rest waits for NCCL (which may be connecting a channel with the initiator, who
        # enqueues only after this reply), so it runs after the reply, still holding the order.
        self.ctx.tg.start_soon(self._finish_post, link, direction, first, seq, region, deadline, what)
        return {"comm": "ok"}

    async def _finish_post(self, link: Link, direction: str, first: NcclResult, seq: int, region: Any, deadline: float, what: str) -> None:
        """Completes the target's side of a post and watches it until done (``region`` is held
        so that its tensor outlives NCCL's use of it); aborts the comm on failure or overrun."""
        comm, stream = link.comm, link.stream
        try:
            with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                try:
                    if link.lost is not None:  # aborted before this task ran: its stream is gone
                        raise self._links.lost_error(link, what)
                    await settled(comm, first, what)
                    if direction == _Dir.PUT:
                        slot = seq % ACK_SLOTS
                        with torch.cuda.stream(stream):
                            link.ack_dev[slot].fill_(seq)
                        await settled(comm, comm.send(link.ack_dev[slot].data_ptr(), ACK_BYTES, link.other, stream.cuda_stream), what)
                    event = torch.cuda.Event()
                    event.record(stream)
                finally:
                    link.order.release()
                await self._links.wait(link, event, what)
        except NcclError as exc:
            log.warning("transport %s: %s", self.ctx.name, self._links.fail(link, self._links.nccl_error(exc, what, link)))
        except TimeoutError:
            err = PeerLostError(f"{what} did not complete by the initiator's deadline on comm {link.cid}; aborted")
            log.warning("transport %s: %s", self.ctx.name, err)
            self._links.fail(link, err)
        except TransportError as exc:
            log.info("transport %s: %s", self.ctx.name, exc)
        except Exception as exc:  # e.g. a CUDA error from torch: this task must not take the Transport down
            err = TransportInternalError(f"{what} failed on comm {link.cid}: {type(exc).__name__}: {exc}")
            log.warning("transport %s: %s", self.ctx.name, err)
            self._links.fail(link, err)

    # -- lifecycle ---------------------------------------------------------------------------

    def forget_peer(self, peer: str) -> None:
        self._links.forget_peer(peer)
        self._infos = {k: v for k, v in self._infos.items() if k[0] != peer}
        self._pool.forget(peer)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._links.close(TransferAbortedError(f"transport {self.ctx.name} is closing", partial=True))
        self._pool.close()


# -- helpers -------------------------------------------------------------------------------------


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
