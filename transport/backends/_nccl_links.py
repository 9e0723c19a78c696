"""The communicators of the ``nccl`` backend: one per ordered peer pair, opened, watched, aborted.

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

Streams: every link has a CUDA stream of its own, created for it and destroyed when the link
is dropped. (torch's ``torch.cuda.Stream()`` hands out 32 pooled streams per device round-robin,
shared with everything else in the process, e.g. ProcessGroupNCCL: a receive waiting for one
peer would block every other peer's transfers, or the application's work, queued on the same
stream, and two processes could each block the other's next operation.)

Failures: communicators are non-blocking (:mod:`transport._nccl`), so no NCCL call blocks the
event loop and every wait is bounded by the transfer's deadline. A transfer that is cancelled
or times out after both ends enqueued gets a short grace to finish; otherwise its communicator
is aborted (``ncclCommAbort``: NCCL lets go of the buffers) and the target is told to abort its
side. Other transfers on an aborted communicator fail with TransferAbortedError (an operation
that an abort cut short also completes on its stream, so a completed event on a lost link is a
failure, not a success); the next transfer opens a new communicator (next generation). Peer
loss (``forget_peer``) and close abort every communicator of that peer.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import torch

from .. import _cuda, _nccl
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
from .._wire import PeerRecord
from ._base import BackendContext

log = logging.getLogger(__name__)

STORE_PREFIX = "nccl/"

ACK_SLOTS = 64  # transfers in flight per communicator (each has its ack slot)
ACK_BYTES = 8
CANCEL_GRACE_S = 0.5  # a cancelled transfer already enqueued may finish within this, else abort
CLOSE_TIMEOUT_S = 5.0
MAX_ID_LEN = 512

Request = Callable[[PeerRecord, Mapping[str, Any]], Awaitable[dict[str, Any]]]


class Op:
    """Requests the nccl backend sends to a peer's agent (``meta["op"]``)."""

    OPEN = "open"
    POST = "post"
    CLOSE = "close"
    SELF = "self"


def request_meta(ctx: BackendContext, op: str, **fields: Any) -> dict[str, Any]:
    """The metadata of a request ``op`` from this endpoint to a peer's agent."""
    return {"backend": "nccl", "op": op, "from": ctx.name, "from_incarnation": ctx.incarnation, **fields}


def comm_id(initiator: str, initiator_inc: str, target: str, target_inc: str, local_uuid: str, remote_uuid: str, gen: int) -> str:
    """Names one communicator: both peers, their incarnations, both GPUs, a generation."""
    return f"{initiator}.{initiator_inc}>{target}.{target_inc}/{local_uuid[:12]}>{remote_uuid[:12]}/{gen}"


@dataclasses.dataclass(eq=False)
class Link:
    """One communicator with its stream and ack buffers, as initiator (rank 0) or target (rank 1)."""

    cid: str
    peer: str
    incarnation: str
    comm: Communicator
    stream: Any  # torch.cuda.ExternalStream over ``stream_handle``
    stream_handle: int  # the CUstream, created for this link; destroyed when it is dropped
    ack_dev: torch.Tensor  # ACK_SLOTS int64 on the device
    ack_host: torch.Tensor | None  # pinned copies of arrived acks (initiator only)
    pair: str = ""  # "<local uuid>><remote uuid>" as the initiator names it
    record: PeerRecord | None = None  # initiator only: the target's record (to ask it to close)
    seq: int = 0  # initiator: next seq to post; target: next seq expected
    order: anyio.Semaphore = dataclasses.field(default_factory=lambda: anyio.Semaphore(1))  # issue order
    # Ack slot ``seq % ACK_SLOTS`` is held by transfer ``seq`` until it has read its ack, so
    # transfer ``seq + ACK_SLOTS`` cannot overwrite the pinned copy before that.
    slots: list[anyio.Lock] = dataclasses.field(default_factory=lambda: [anyio.Lock() for _ in range(ACK_SLOTS)])
    lost: TransportError | None = None  # set once aborted: why

    @property
    def other(self) -> int:
        return 1 - self.comm.rank if self.comm.nranks == 2 else 0


class Links:
    """The communicators of one NcclBackend: the ones it initiated (per peer, incarnation and
    device pair), the ones it serves as target (per comm id), and its 1-rank ones (per device).

    ``request(peer, meta)`` sends a request to a peer's agent (the backend's connection);
    ``path_of(peer)`` says, for the log, why transfers to ``peer`` use send/recv.
    """

    def __init__(self, ctx: BackendContext, lib: Library, request: Request, path_of: Callable[[PeerRecord], str]) -> None:
        self.ctx = ctx
        self._lib = lib
        self._request = request
        self._path_of = path_of
        self._links: dict[tuple[str, str, int, str], Link] = {}  # (peer, incarnation, device, remote uuid)
        self._opening: dict[tuple[str, str, int, str], anyio.Lock] = {}
        self._served: dict[str, Link] = {}  # comm id -> our rank-1 side
        self._selves: dict[int, Link] = {}  # device -> 1-rank link
        self._self_lock = anyio.Lock()
        self._ids = itertools.count(1)
        self._uuids: dict[int, str] = {}
        self._closed = False

    # -- GPU identities ------------------------------------------------------------------------

    def uuid(self, device: int) -> str:
        if device not in self._uuids:
            self._uuids[device] = _nccl.normalize_uuid(str(torch.cuda.get_device_properties(device).uuid))
        return self._uuids[device]

    def device_of(self, label: str) -> int | None:
        """This process's ordinal of the GPU published as ``label`` ("cuda:<uuid>"), if visible."""
        want = _nccl.normalize_uuid(label)
        for i in range(torch.cuda.device_count()):
            if self.uuid(i) == want:
                return i
        return None

    # -- opening (initiator) ----------------------------------------------------------------

    async def initiator(self, peer: PeerRecord, device: int, remote_label: str, what: str) -> Link:
        """Our live communicator towards ``peer``'s GPU ``remote_label`` from ``device``,
        opened now if there is none."""
        key = (peer.name, peer.incarnation, device, _nccl.normalize_uuid(remote_label))
        lock = self._opening.setdefault(key, anyio.Lock())
        async with lock:
            link = self._links.get(key)
            if link is not None and link.lost is None:
                return link
            link = await self._open(peer, device, remote_label, what)
            self._links[key] = link
            return link

    async def _open(self, peer: PeerRecord, device: int, remote_label: str, what: str) -> Link:
        store = self._store()
        remote_uuid = _nccl.normalize_uuid(remote_label)
        cid = comm_id(self.ctx.name, self.ctx.incarnation, peer.name, peer.incarnation, self.uuid(device), remote_uuid, next(self._ids))
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
            link.pair, link.record = f"{self.uuid(device)}>{remote_uuid}", peer
            meta = request_meta(self.ctx, Op.OPEN, cid=cid, device=remote_label, pair=link.pair, timeout=remaining(self.ctx))
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._connect, link, what)
                    await self._request(peer, meta)
            except BaseException as exc:
                error = _first_error(exc)
                if isinstance(error, TransportError):
                    self.fail(link, error)
                    if error is exc:
                        raise
                    raise error from None
                self.fail(link, TransferAbortedError(f"{what}: opening comm {cid} was interrupted"))
                raise
            log.info("transport %s: nccl comm %s open (NCCL %s, cuda:%d; send/recv: %s)",
                     self.ctx.name, cid, self._lib.version_string, device, self._path_of(peer))
            return link
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await _store_call(store, store.delete, store_key)
                except TransportError as exc:
                    log.debug("transport %s: could not delete %s from the store: %s", self.ctx.name, store_key, exc)

    async def _connect(self, link: Link, what: str) -> None:
        """Finishes this rank's init and exchanges the warm-up message (both ranks at once)."""
        try:
            await link.comm.settle(f"init for {what}")
            event = await self._warm_up(link)
        except NcclError as exc:
            raise self.fail(link, self.nccl_error(exc, f"opening comm {link.cid} for {what}", link)) from exc
        await self.wait(link, event, f"connecting comm {link.cid}")

    async def _warm_up(self, link: Link) -> Any:
        comm, stream, peer = link.comm, link.stream, link.other
        h = stream.cuda_stream
        ptr0, ptr1 = link.ack_dev[0].data_ptr(), link.ack_dev[1].data_ptr()
        result = comm.grouped("the warm-up exchange", [lambda: comm.send(ptr0, ACK_BYTES, peer, h), lambda: comm.recv(ptr1, ACK_BYTES, peer, h)])
        await settled(comm, result, f"warm-up on comm {link.cid}")
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _new_link(self, cid: str, peer: str, incarnation: str, comm: Communicator, *, initiator: bool) -> Link:
        handle = 0
        try:
            with torch.cuda.device(comm.device):  # also restores the current device the driver call sets
                handle = _cuda.stream_create(comm.device)
                stream = torch.cuda.ExternalStream(handle, device=torch.device("cuda", comm.device))
                ack_dev = torch.zeros(ACK_SLOTS, dtype=torch.int64, device=f"cuda:{comm.device}")
                # The zeros are written (and the block was last used) on the current stream,
                # which our stream does not otherwise wait for: order it after them once.
                stream.wait_stream(torch.cuda.current_stream(comm.device))
                ack_host = torch.full((ACK_SLOTS,), -1, dtype=torch.int64).pin_memory() if initiator else None
        except BaseException as exc:
            comm.abort()
            if handle:
                _destroy_stream(handle, comm.device, cid)
            if isinstance(exc, Exception) and not isinstance(exc, TransportError):
                raise TransportInternalError(f"cannot set up comm {cid} with {peer} on cuda:{comm.device}: {exc}") from exc
            raise
        return Link(cid, peer, incarnation, comm, stream, handle, ack_dev, ack_host)

    def _store(self) -> Store:
        if self.ctx.store is None:
            raise TransportInternalError("the nccl backend needs the rendezvous store to exchange NCCL unique ids")
        return self.ctx.store

    # -- opening (target) ---------------------------------------------------------------------

    def served(self, cid: str) -> Link | None:
        return self._served.get(cid)

    async def serve_open(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """Joins the communicator an initiator is opening towards us (rank 1) and exchanges
        the warm-up message; replaces any earlier one of the same peer and device pair."""
        peer, inc, cid = meta_str(meta, "from"), meta_str(meta, "from_incarnation"), meta_str(meta, "cid")
        label, pair = meta_str(meta, "device"), meta_str(meta, "pair")
        timeout = meta_timeout(meta, self.ctx.timeout)
        uid = await read_unique_id(self._store(), self.ctx.auth, cid, peer)
        device = self.device_of(label)
        if device is None:
            raise BackendUnavailableError(f"{self.ctx.name} sees no GPU {label.removeprefix('cuda:')} (comm {cid} from {peer})")
        for old in [l for l in self._served.values() if l.peer == peer and l.pair == pair]:
            self.fail(old, TransferAbortedError(f"{peer} opened a new comm {cid} in place of {old.cid}", partial=True))
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
            raise self.fail(link, PeerLostError(f"{self.ctx.name}: comm {cid} from {peer} did not connect within {timeout:g}s")) from None
        except BaseException as exc:
            self.fail(link, exc if isinstance(exc, TransportError) else TransferAbortedError(f"opening comm {cid} was interrupted"))
            raise
        return {"comm": "ok", "nccl": list(self._lib.version)}

    def serve_close(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """Aborts our side of a communicator its initiator gave up on."""
        link = self._served.get(meta_str(meta, "cid"))
        if link is not None and link.peer == meta.get("from"):
            self.fail(link, TransferAbortedError(f"{link.peer} aborted comm {link.cid}", partial=True))
        return {"comm": "closed"}

    # -- sending to self ----------------------------------------------------------------------

    async def self_link(self, device: int) -> Link:
        """The 1-rank communicator on ``device`` (for transfers to this very Transport)."""
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
                raise self.fail(link, TransportInternalError(f"cannot open the 1-rank nccl comm {cid}: {exc or 'timed out'}")) from exc
            self._selves[device] = link
            return link

    # -- waiting ----------------------------------------------------------------------------

    async def wait(self, link: Link, event: Any, what: str) -> None:
        """Polls ``event`` (with backoff) while watching the communicator for failure.

        Raises:
            PeerLostError / TransportInternalError / TransferAbortedError: the communicator
            failed or was aborted (it is aborted then), also when ``event`` completed: an
            aborted operation completes on its stream without having moved its bytes.
        """
        delay = 0.0
        while True:
            done = event.query()
            if link.lost is not None:
                raise self.lost_error(link, what)
            try:
                link.comm.state()
            except NcclError as exc:
                raise self.fail(link, self.nccl_error(exc, what, link)) from exc
            if done:
                return
            await anyio.sleep(delay)
            delay = min(max(2 * delay, 20e-6), 2e-3)

    async def grace_or_abort(self, link: Link, event: Any, what: str) -> None:
        """After a cancelled or failed wait: the operations were enqueued, so NCCL may still be
        using the buffers. Let them finish briefly, else abort the communicator (NCCL then lets
        go of them)."""
        if link.lost is not None:
            return
        with anyio.move_on_after(CANCEL_GRACE_S):
            try:
                await self.wait(link, event, what)
                return
            except TransportError:
                return  # the link failed and was aborted
        err = TransferAbortedError(f"{what} was cancelled or timed out on the device; comm {link.cid} to {link.peer} aborted", partial=True)
        log.warning("transport %s: %s", self.ctx.name, err)
        self.fail(link, err)

    # -- failure handling -------------------------------------------------------------------

    def nccl_error(self, exc: NcclError, what: str, link: Link) -> TransportError:
        cls = PeerLostError if exc.remote else TransportInternalError
        err = cls(f"{what} failed on comm {link.cid} with {link.peer}: {exc}")
        err.__cause__ = exc
        return err

    def lost_error(self, link: Link, what: str) -> TransportError:
        why = link.lost
        cls = type(why) if isinstance(why, (PeerLostError, TransferAbortedError)) else TransportInternalError
        err = cls(f"{what}: comm {link.cid} was aborted: {why}")
        if isinstance(err, TransferAbortedError):
            err.partial = True
        err.__cause__ = why
        return err

    def fail(self, link: Link, why: TransportError, *, tell: bool = True) -> TransportError:
        """Marks ``link`` lost, aborts its communicator, releases its stream and forgets it; for
        our own (initiator) links also asks the target to abort its side, unless ``tell`` is
        False (the peer is gone, or we are closing). Returns ``why``."""
        if link.lost is None:
            link.lost = why
            log.info("transport %s: aborting nccl comm %s (%s)", self.ctx.name, link.cid, why)
            link.comm.abort()
            # NCCL has let go of the stream; work still on it finishes before CUDA frees it.
            # Nothing enqueues on a lost link's stream (every enqueue checks ``lost`` or the
            # aborted communicator first, with no await in between).
            _destroy_stream(link.stream_handle, link.comm.device, link.cid)
            if tell:
                self._tell_close(link)
        for key in [k for k, v in self._links.items() if v is link]:
            del self._links[key]
        for device in [d for d, v in self._selves.items() if v is link]:
            del self._selves[device]
        if self._served.get(link.cid) is link:
            del self._served[link.cid]
        return why

    def _tell_close(self, link: Link) -> None:
        """Asks the target to abort its side of our ``link`` (best effort, in the background):
        it may have operations posted that would otherwise wait for its own deadline."""
        peer = link.record
        if self._closed or peer is None:
            return

        async def close() -> None:
            with anyio.move_on_after(min(CLOSE_TIMEOUT_S, self.ctx.timeout)):
                try:
                    await self._request(peer, request_meta(self.ctx, Op.CLOSE, cid=link.cid))
                except TransportError as exc:
                    log.debug("transport %s: could not tell %s to close comm %s: %s", self.ctx.name, peer.name, link.cid, exc)

        self.ctx.tg.start_soon(close)

    # -- lifecycle ---------------------------------------------------------------------------

    def forget_peer(self, peer: str) -> None:
        why = PeerLostError(f"{peer} left or restarted")
        for link in [*self._links.values(), *self._served.values()]:
            if link.peer == peer:
                self.fail(link, why, tell=False)
        self._opening = {k: v for k, v in self._opening.items() if k[0] != peer}

    def close(self, why: TransportError) -> None:
        self._closed = True
        for link in [*self._links.values(), *self._served.values(), *self._selves.values()]:
            self.fail(link, why, tell=False)


def _destroy_stream(handle: int, device: int, cid: str) -> None:
    try:
        with torch.cuda.device(device):
            _cuda.stream_destroy(handle, device)
    except Exception as exc:  # releasing must not fail an abort; say it happened
        log.warning("nccl: destroying the stream of comm %s failed: %s", cid, exc)


async def settled(comm: Communicator, result: NcclResult, what: str) -> None:
    """Returns once an enqueue that answered ``result`` is done (NCCL's non-blocking mode)."""
    if result == NcclResult.IN_PROGRESS:  # e.g. NCCL connecting a channel at first use
        await comm.settle(what)


def remaining(ctx: BackendContext) -> float:
    """Seconds left before the current deadline (the transfer's), else the default timeout."""
    left = anyio.current_effective_deadline() - anyio.current_time()
    return ctx.timeout if math.isinf(left) else max(0.0, left)


# -- unique ids through the rendezvous store ---------------------------------------------------


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


# -- helpers -------------------------------------------------------------------------------------


def _first_error(exc: BaseException) -> BaseException:
    """The first non-cancellation error inside a (nested) exception group, else ``exc``."""
    inner = getattr(exc, "exceptions", None)
    if isinstance(inner, tuple):
        for e in inner:
            found = _first_error(e)
            if not isinstance(found, anyio.get_cancelled_exc_class()):
                return found
    return exc


def meta_str(meta: Mapping[str, Any], key: str) -> str:
    value = meta.get(key)
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LEN:
        raise TransportInternalError(f"bad nccl request: {key}={value!r}")
    return value


def meta_int(meta: Mapping[str, Any], key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TransportInternalError(f"bad nccl request: {key}={value!r}")
    return value


def meta_timeout(meta: Mapping[str, Any], default: float) -> float:
    value = meta.get("timeout", default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        return default
    return min(float(value), 24 * 3600.0)
