"""The ``nccl`` Backend: reachability, the initiator's put/get, the target's agent requests.

A put (send/recv path): holding the issue order, the initiator asks the target's agent to
``post`` transfer number ``seq``; the agent checks key, dtype, bounds and writability (a refusal
arrives as the matching typed error and nothing is enqueued anywhere), enqueues on its stream an
``ncclRecv`` into the region and then an 8-byte ``ncclSend`` of ``seq`` back (the ack), and
replies at once. The initiator then enqueues, on its stream and after the caller's ready event,
``ncclSend`` of the tensor and ``ncclRecv`` of the ack. The ack leaves the target only after its
receive kernel completed (stream order), so when the initiator's ack has arrived the bytes are
in the target's memory: that is when the Transfer completes. An ack that does not carry ``seq``
means mismatched matching and aborts the communicator. A get: the target sends from its region,
the initiator receives; complete when that receive finished. The target aborts the communicator
on its own when a posted operation overruns the initiator's timeout (plus a grace).

Sending to self (the peer is this very Transport): a 1-rank communicator on the device, with
the send and its receive grouped (``ncclGroupStart/End``); the request still goes through this
Transport's own agent so that the region checks are the same.

Stream semantics: the transport-owned stream of a communicator waits for the caller's ready
event (``LocalBuffer.ready``: recorded on the caller's current stream when the transfer was
started, by the engine; a tensor reached without one is refused as a bug, never given one
here) before reading or writing the tensor; completion means the bytes are in place, as above.
Completion is observed by polling CUDA events (with backoff).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Mapping
from typing import Any

import anyio
import torch

from ..._errors import (
    BackendUnavailableError,
    PeerLostError,
    TransferAbortedError,
    TransportInternalError,
    WireError,
)
from ..._native import nccl as native
from ..._pieces import ready_of
from ..._tensors import MemoryKind, dtype_name
from ..._wire import PeerRecord, RegionRecord, TransferOp
from .._base import Backend, BackendContext, LocalBuffer, RegionCheck, RemoteTarget
from . import _availability
from ._comm import Comm
from ._comms import Comms
from ._endpoint import (
    EndpointInfo,
    decode_endpoint,
    encode_endpoint,
    window_path_reason,
)
from ._ids import local_device, local_uuid, normalize_uuid
from ._protocol import Op, Requests, direction_of, meta_int, meta_str, meta_timeout

log = logging.getLogger(__name__)

_TARGET_GRACE_S = 5.0  # the target aborts a posted operation this long after the initiator's timeout


@dataclasses.dataclass(eq=False)
class _Ticket:
    """A transfer to this very Transport, waiting for its own agent to enqueue it."""

    direction: TransferOp
    local: LocalBuffer
    ready: Any
    event: Any = None
    comm: Comm | None = None  # set just before the agent enqueues (from then on NCCL may use ``local``)


class NcclBackend(Backend):
    """NCCL point-to-point between GPUs, one 2-rank communicator per ordered peer pair and GPU
    pair (see the package docstring). Not one-sided: the target's agent posts each operation."""

    name = "nccl"
    one_sided = False
    memory_kinds = frozenset({MemoryKind.CUDA})

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return _availability.unavailable_reason()

    def __init__(self, ctx: BackendContext) -> None:
        # Nothing here touches CUDA: streams and communicators are made on first use.
        super().__init__(ctx)
        lib, why = native.library()
        if lib is None:
            raise TransportInternalError(f"nccl backend unavailable: {why}")
        self._lib = lib
        self._endpoint = encode_endpoint(lib)
        self._requests = Requests(ctx)
        self._comms = Comms(ctx, lib, self._requests)
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
                if desc is None:
                    self._infos[key] = f"{peer.name} does not run nccl"
                else:
                    self._infos[key] = decode_endpoint(desc, peer.name)
            except WireError as exc:
                self._infos[key] = str(exc)
        return self._infos[key]

    def _path_note(self, peer: PeerRecord) -> str:
        info = self._info(peer)
        return window_path_reason(self._lib, info) if isinstance(info, EndpointInfo) else "?"

    def _is_self(self, peer: PeerRecord) -> bool:
        return peer.name == self.ctx.name and peer.incarnation == self.ctx.incarnation

    def _same_gpu_reason(self, peer: PeerRecord, region: RegionRecord) -> str:
        return (f"{peer.name}:{region.key!r} is on the GPU this end would use ({region.device.removeprefix('cuda:')}): "
                f"NCCL places two ranks on one GPU only from NCCL 2.30 with {native.MULTI_RANK_GPU_ENV}=1 on both "
                f"ends (this process: NCCL {self._lib.version_string}); use ipc for same-GPU transfers")

    def unreachable_reason(self, peer: PeerRecord, region: RegionRecord, local: MemoryKind) -> str | None:
        info = self._info(peer)
        if isinstance(info, str):
            return info
        if not region.device.startswith("cuda:"):
            return f"{peer.name}:{region.key!r} is host memory; nccl moves GPU memory only"
        if info.version != self._lib.version:
            theirs = ".".join(map(str, info.version))
            return (f"{peer.name} runs NCCL {theirs} and this process NCCL {self._lib.version_string}: "
                    "NCCL needs the same version on both ends")
        if self._is_self(peer):
            return None
        # The local tensor is not known here; with one visible GPU it can only be that one.
        if (peer.host == self.ctx.host and not native.multi_rank_gpu(self._lib)
                and torch.cuda.device_count() == 1 and local_device(region.device) == 0):
            return self._same_gpu_reason(peer, region)
        return None

    # -- requests ---------------------------------------------------------------------------

    def _meta(self, op: Op | str, **fields: Any) -> dict[str, Any]:
        return self._requests.meta(op, **fields)

    async def request(self, peer: PeerRecord, meta: Mapping[str, Any]) -> dict[str, Any]:
        """Sends one BACKEND request to ``peer``'s agent over this backend's own connection
        (lane "nccl") and returns the reply; the agent's refusals arrive as typed errors."""
        return await self._requests.send(peer, meta)

    # -- data path: initiator ----------------------------------------------------------------

    async def put(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        """Writes ``local`` (CUDA) into the remote region; returns once the bytes are in the
        target's memory. Waits for the caller's queued work first (see the module docstring).

        Cancellation: returns only once NCCL no longer uses ``local`` (the communicator is
        aborted if the transfer does not finish within a short grace)."""
        await self._transfer(TransferOp.PUT, local, remote)

    async def get(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        """Reads the remote range into ``local`` (CUDA); returns once the bytes are there.
        Cancellation: as :meth:`put`."""
        await self._transfer(TransferOp.GET, local, remote)

    async def _transfer(self, direction: TransferOp, local: LocalBuffer, remote: RemoteTarget) -> None:
        tensor, peer = local.tensor, remote.peer
        what = (f"nccl {direction.value} of {remote.nbytes} bytes at offset {remote.offset} of "
                f"{peer.name}:{remote.region.key!r}")
        if tensor.device.type != "cuda":
            raise BackendUnavailableError(f"{what}: the local tensor is on {tensor.device}; nccl moves GPU memory only")
        ready = ready_of(local)
        if self._is_self(peer):
            await self._self_transfer(direction, local, ready, remote, what)
            return
        device = tensor.device.index
        if local_uuid(device) == normalize_uuid(remote.region.device) and not native.multi_rank_gpu(self._lib):
            raise BackendUnavailableError(f"{what}: {self._same_gpu_reason(peer, remote.region)}")
        fields = {"key": remote.region.key, "dtype": dtype_name(tensor.dtype), "offset": remote.offset,
                  "nbytes": remote.nbytes}
        for _attempt in range(2):
            comm = await self._comms.initiator(peer, device, remote.region.device, what, self._path_note(peer))
            posted = await comm.post(direction, tensor.data_ptr(), remote.nbytes, ready, fields, self.ctx.timeout, what)
            if posted is not None:
                break
            # The target no longer had that communicator (it aborted it); nothing was enqueued.
        else:
            raise PeerLostError(f"{what}: {peer.name} dropped two nccl communicators in a row")
        await comm.complete(posted, what)

    # -- sending to self ---------------------------------------------------------------------

    async def _self_transfer(self, direction: TransferOp, local: LocalBuffer, ready: Any, remote: RemoteTarget,
                             what: str) -> None:
        ticket_id = next(self._ids)
        ticket = _Ticket(direction, local, ready)
        self._tickets[ticket_id] = ticket
        try:
            meta = self._meta(Op.SELF, ticket=ticket_id, dir=direction.value, key=remote.region.key,
                              dtype=dtype_name(local.tensor.dtype), offset=remote.offset, nbytes=remote.nbytes)
            try:
                await self.request(remote.peer, meta)
            except BaseException:
                await self._abandon(ticket, what)
                raise
            assert ticket.event is not None and ticket.comm is not None
            await ticket.comm.watch(ticket.event, what)
        finally:
            del self._tickets[ticket_id]

    async def _abandon(self, ticket: _Ticket, what: str) -> None:
        """We stop waiting for our own agent: if it has started enqueueing (NCCL may use the
        tensor), let that finish briefly or abort the communicator."""
        if ticket.comm is None:
            return  # nothing enqueued, and nothing will be: the agent checks the ticket first
        with anyio.CancelScope(shield=True):
            if ticket.event is not None:
                await ticket.comm.grace_or_abort(ticket.event, what)
            else:
                ticket.comm.abort(TransferAbortedError(
                    f"{what} was cancelled while being enqueued; comm {ticket.comm.cid} aborted", partial=True))

    async def _serve_self(self, meta: Mapping[str, Any], check_region: RegionCheck) -> dict[str, Any]:
        ticket_id = meta.get("ticket")
        mine = isinstance(ticket_id, int) and meta.get("from_incarnation") == self.ctx.incarnation
        ticket = self._tickets.get(ticket_id) if mine else None  # type: ignore[arg-type]
        if ticket is None:
            raise TransportInternalError(f"{self.ctx.name}: no local nccl transfer {ticket_id!r} is waiting "
                                         "(self transfers come from this very Transport)")
        direction, nbytes = direction_of(meta), meta_int(meta, "nbytes")
        region = check_region(direction, meta, nbytes)
        target = _cuda_tensor(region, self.ctx.name)
        src = ticket.local.tensor
        if target.device != src.device:
            raise BackendUnavailableError(f"{self.ctx.name}:{region.key!r} is on {target.device} and the local "
                                          f"tensor on {src.device}: a 1-rank NCCL communicator spans one GPU; use "
                                          "ipc between GPUs of one process")
        comm = await self._comms.self_comm(src.device.index)
        what = f"nccl {direction.value} of {nbytes} bytes to self ({region.key!r})"
        if self._tickets.get(ticket_id) is not ticket:  # type: ignore[arg-type]
            # The transfer was cancelled while the communicator opened: its tensor may be gone.
            raise TransferAbortedError(f"{what} was cancelled before it was enqueued", partial=False)
        region_ptr = target.data_ptr() + meta_int(meta, "offset")
        if direction is TransferOp.PUT:
            send_ptr, recv_ptr = src.data_ptr(), region_ptr
        else:
            send_ptr, recv_ptr = region_ptr, src.data_ptr()
        ticket.comm = comm
        ticket.event = await comm.copy_self(send_ptr, recv_ptr, nbytes, ticket.ready, self.ctx.timeout, what)
        return {"comm": "ok"}

    # -- agent side (target) -----------------------------------------------------------------

    async def serve_request(self, meta: Mapping[str, Any], check_region: RegionCheck) -> Mapping[str, Any]:
        """Serves a peer's nccl request (``open``, ``post``, ``close``; ``self`` from this very
        Transport). A refusal raises the matching TransportError before anything is enqueued."""
        op = meta.get("op")
        if op == Op.POST.value:
            return await self._serve_post(meta, check_region)
        if op == Op.OPEN.value:
            return await self._comms.serve_open(meta)
        if op == Op.CLOSE.value:
            return self._comms.serve_close(meta)
        if op == Op.SELF.value:
            return await self._serve_self(meta, check_region)
        raise TransportInternalError(f"unknown nccl request {op!r}")

    async def _serve_post(self, meta: Mapping[str, Any], check_region: RegionCheck) -> dict[str, Any]:
        direction, nbytes = direction_of(meta), meta_int(meta, "nbytes")
        cid, seq = meta_str(meta, "cid"), meta_int(meta, "seq")
        if nbytes <= 0:
            raise TransportInternalError(f"bad nccl post of {nbytes} bytes")
        region = check_region(direction, meta, nbytes)
        target = _cuda_tensor(region, self.ctx.name)
        comm = self._comms.served(cid)
        if (comm is None or comm.lost is not None or comm.peer != meta.get("from")
                or comm.incarnation != meta.get("from_incarnation")):
            return {"comm": "gone"}
        if target.device.index != comm.device:
            raise TransportInternalError(f"{self.ctx.name}:{region.key!r} is on {target.device}, comm {cid} on "
                                         f"cuda:{comm.device}")
        what = (f"nccl {direction.value} of {nbytes} bytes at offset {meta['offset']} of "
                f"{self.ctx.name}:{region.key!r} for {comm.peer}")
        deadline = anyio.current_time() + meta_timeout(meta, self.ctx.timeout) + _TARGET_GRACE_S
        accepted = await comm.accept(seq, direction, target.data_ptr() + meta_int(meta, "offset"), nbytes, what)
        if accepted is None:
            return {"comm": "gone"}
        # The rest waits for NCCL (which may be connecting a channel with the initiator, who
        # enqueues only after this reply), so it runs after the reply, still holding the order.
        self.ctx.tg.start_soon(comm.finish, accepted, deadline, what, region)
        return {"comm": "ok"}

    # -- lifecycle ---------------------------------------------------------------------------

    def forget_peer(self, peer: str) -> None:
        self._comms.forget_peer(peer)
        self._infos = {k: v for k, v in self._infos.items() if k[0] != peer}
        self._requests.forget_peer(peer)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._comms.close(TransferAbortedError(f"transport {self.ctx.name} is closing", partial=True))
        self._requests.close()


def _cuda_tensor(region: Any, owner: str) -> torch.Tensor:
    tensor = region.tensor
    if tensor.device.type != "cuda":
        raise BackendUnavailableError(f"{owner}:{region.key!r} is host memory; nccl moves GPU memory only")
    return tensor
