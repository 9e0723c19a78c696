"""The communicators of one ``nccl`` backend: which exist, opening them, and dropping them.

Communicators, one per *ordered* pair and device pair: A's puts and gets to B run on the
communicator A opened towards B (A is rank 0, B rank 1); B's transfers to A on another one.
NCCL matches sends and receives in the order each rank issues them, so every communicator has
one sequencer, its initiator (see :mod:`._comm`). (One communicator shared by both directions
would deadlock as soon as both sides put at once: each rank's send would wait behind its own
later receive.)

Opening (lazily, on the first transfer): the initiator makes an ``ncclUniqueId``, publishes it in
the rendezvous store (:mod:`._ids`), starts its rank-0 init and asks the target's agent to
``open``; the target reads the id, inits rank 1, and both exchange a warm-up message (so a
communicator that cannot connect fails here, not in a transfer). The id is deleted from the
store once both ends are up. Only the initiator of a direction ever creates its id, so two peers
opening towards each other at once create two communicators, never a race on one.

A Comm that is aborted stays aborted: the table opens a new one (next generation) for the next
transfer and drops aborted ones when it next adds one. Peer loss (:meth:`Comms.forget_peer`) and
close abort every communicator of that peer.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from typing import Any

import anyio

from ..._errors import (
    BackendUnavailableError,
    PeerLostError,
    TransferAbortedError,
    TransportError,
    TransportInternalError,
)
from ..._native.nccl import Communicator, Library, NcclError
from ..._rendezvous import Store
from ..._wire import PeerRecord
from .._base import BackendContext
from ._comm import Comm
from ._ids import (
    comm_id,
    local_device,
    local_uuid,
    normalize_uuid,
    publish_unique_id,
    read_unique_id,
    store_call,
)
from ._protocol import Op, Requests, meta_str, meta_timeout, remaining

log = logging.getLogger(__name__)

_Key = tuple[str, str, int, str]  # (peer, incarnation, local device, remote uuid)


class Comms:
    """The communicators of one NcclBackend: the ones it initiated (per peer, incarnation and
    device pair), the ones it serves as target (per comm id), and its 1-rank ones (per device).

    Args:
        ctx: the backend's context (name, incarnation, store, token, default timeout).
        lib: the loaded NCCL.
        requests: the backend's requests to peers' agents (``open``; handed to initiator Comms).
    """

    def __init__(self, ctx: BackendContext, lib: Library, requests: Requests) -> None:
        self._ctx = ctx
        self._lib = lib
        self._requests = requests
        self._initiated: dict[_Key, Comm] = {}
        self._opening: dict[_Key, anyio.Lock] = {}
        self._served: dict[str, Comm] = {}  # comm id -> our rank-1 side
        self._selves: dict[int, Comm] = {}  # device -> 1-rank Comm
        self._self_lock = anyio.Lock()
        self._ids = itertools.count(1)

    def _prune(self) -> None:
        """Drops aborted Comms (they are never used again)."""
        self._initiated = {k: c for k, c in self._initiated.items() if c.lost is None}
        self._served = {k: c for k, c in self._served.items() if c.lost is None}
        self._selves = {k: c for k, c in self._selves.items() if c.lost is None}

    # -- opening (initiator) ----------------------------------------------------------------

    async def initiator(self, peer: PeerRecord, device: int, remote_label: str, what: str, path_note: str) -> Comm:
        """Our live communicator towards ``peer``'s GPU ``remote_label`` from ``device``, opened
        now if there is none (``path_note``, for the log: why send/recv is used).

        Raises:
            TransportError: it could not be opened (nothing is left behind).

        Cancellation: an open under way is abandoned and its half-open communicator aborted.
        """
        key = (peer.name, peer.incarnation, device, normalize_uuid(remote_label))
        lock = self._opening.setdefault(key, anyio.Lock())
        async with lock:
            comm = self._initiated.get(key)
            if comm is not None and comm.lost is None:
                return comm
            comm = await self._open(peer, device, remote_label, what, path_note)
            self._prune()
            self._initiated[key] = comm
            return comm

    async def _open(self, peer: PeerRecord, device: int, remote_label: str, what: str, path_note: str) -> Comm:
        ctx, store = self._ctx, self._store()
        mine, theirs = local_uuid(device), normalize_uuid(remote_label)
        cid = comm_id(ctx.name, ctx.incarnation, peer.name, peer.incarnation, mine, theirs, next(self._ids))
        try:
            uid = self._lib.unique_id()
        except NcclError as exc:
            raise TransportInternalError(f"{what}: cannot open an nccl communicator: {exc}") from exc
        store_key = await publish_unique_id(store, ctx.auth, cid, uid)
        try:
            try:
                nccl = Communicator.start(self._lib, uid, 2, 0, device, cid)
            except NcclError as exc:
                raise TransportInternalError(f"{what}: cannot open comm {cid}: {exc}") from exc
            pair = f"{mine}>{theirs}"
            comm = Comm.create(cid, peer.name, peer.incarnation, nccl, initiator=True, pair=pair, owner=ctx.name,
                               target=peer, requests=self._requests)
            meta = self._requests.meta(Op.OPEN, cid=cid, device=remote_label, pair=pair, timeout=remaining(ctx.timeout))
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(comm.connect, what)
                    await self._requests.send(peer, meta)
            except BaseException as exc:
                error = _first_error(exc)
                if isinstance(error, TransportError):
                    comm.abort(error)
                    if error is exc:
                        raise
                    raise error from None
                comm.abort(TransferAbortedError(f"{what}: opening comm {cid} was interrupted"))
                raise
            log.info("transport %s: nccl comm %s open (NCCL %s, cuda:%d; send/recv: %s)",
                     ctx.name, cid, self._lib.version_string, device, path_note)
            return comm
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await store_call(store, store.delete, store_key)
                except TransportError as exc:
                    log.debug("transport %s: could not delete %s from the store: %s", ctx.name, store_key, exc)

    def _store(self) -> Store:
        if self._ctx.store is None:
            raise TransportInternalError("the nccl backend needs the rendezvous store to exchange NCCL unique ids")
        return self._ctx.store

    # -- opening (target) ---------------------------------------------------------------------

    def served(self, cid: str) -> Comm | None:
        """Our side of communicator ``cid`` (possibly aborted), if we joined it."""
        return self._served.get(cid)

    async def serve_open(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """Joins the communicator an initiator is opening towards us (rank 1) and exchanges
        the warm-up message; replaces any earlier one of the same peer and device pair.

        Raises:
            TransportError: no (valid) unique id, no such GPU here, or the join failed.
        """
        ctx = self._ctx
        peer, inc, cid = meta_str(meta, "from"), meta_str(meta, "from_incarnation"), meta_str(meta, "cid")
        label, pair = meta_str(meta, "device"), meta_str(meta, "pair")
        timeout = meta_timeout(meta, ctx.timeout)
        uid = await read_unique_id(self._store(), ctx.auth, cid, peer)
        device = local_device(label)
        if device is None:
            gpu = label.removeprefix("cuda:")
            raise BackendUnavailableError(f"{ctx.name} sees no GPU {gpu} (comm {cid} from {peer})")
        for old in [c for c in self._served.values() if c.peer == peer and c.pair == pair]:
            old.abort(TransferAbortedError(f"{peer} opened a new comm {cid} in place of {old.cid}", partial=True))
        try:
            nccl = Communicator.start(self._lib, uid, 2, 1, device, cid)
        except NcclError as exc:
            raise TransportInternalError(f"{ctx.name}: cannot join comm {cid} from {peer}: {exc}") from exc
        comm = Comm.create(cid, peer, inc, nccl, initiator=False, pair=pair, owner=ctx.name)
        self._prune()
        self._served[cid] = comm
        try:
            with anyio.fail_after(timeout):
                await comm.connect(f"comm {cid} from {peer}")
        except TimeoutError:
            why = PeerLostError(f"{ctx.name}: comm {cid} from {peer} did not connect within {timeout:g}s")
            raise comm.abort(why) from None
        except BaseException as exc:
            if isinstance(exc, TransportError):
                comm.abort(exc)
            else:
                comm.abort(TransferAbortedError(f"opening comm {cid} was interrupted"))
            raise
        return {"comm": "ok", "nccl": list(self._lib.version)}

    def serve_close(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """Aborts our side of a communicator its initiator gave up on."""
        comm = self._served.get(meta_str(meta, "cid"))
        if comm is not None and comm.peer == meta.get("from"):
            comm.abort(TransferAbortedError(f"{comm.peer} aborted comm {comm.cid}", partial=True))
        return {"comm": "closed"}

    # -- sending to self ----------------------------------------------------------------------

    async def self_comm(self, device: int) -> Comm:
        """The 1-rank communicator on ``device`` (for transfers to this very Transport).

        Raises:
            TransportInternalError: it could not be opened within the default timeout.
        """
        ctx = self._ctx
        async with self._self_lock:
            comm = self._selves.get(device)
            if comm is not None and comm.lost is None:
                return comm
            cid = f"{ctx.name}.{ctx.incarnation}/self/cuda:{device}/{next(self._ids)}"
            try:
                nccl = Communicator.start(self._lib, self._lib.unique_id(), 1, 0, device, cid)
            except NcclError as exc:
                raise TransportInternalError(f"cannot open the 1-rank nccl comm {cid}: {exc}") from exc
            comm = Comm.create(cid, ctx.name, ctx.incarnation, nccl, initiator=False, owner=ctx.name)
            try:
                with anyio.fail_after(ctx.timeout):
                    await comm.ready("init")
            except (NcclError, TimeoutError) as exc:
                why = TransportInternalError(f"cannot open the 1-rank nccl comm {cid}: {str(exc) or 'timed out'}")
                raise comm.abort(why) from exc
            self._prune()
            self._selves[device] = comm
            return comm

    # -- lifecycle ---------------------------------------------------------------------------

    def forget_peer(self, peer: str) -> None:
        """Aborts every communicator with ``peer`` (it left or restarted; it is not told)."""
        why = PeerLostError(f"{peer} left or restarted")
        for comm in [*self._initiated.values(), *self._served.values()]:
            if comm.peer == peer:
                comm.abort(why, tell=False)
        self._prune()
        self._opening = {k: v for k, v in self._opening.items() if k[0] != peer}

    def close(self, why: TransportError) -> None:
        """Aborts every communicator (peers are not told)."""
        for comm in [*self._initiated.values(), *self._served.values(), *self._selves.values()]:
            comm.abort(why, tell=False)
        self._prune()


def _first_error(exc: BaseException) -> BaseException:
    """The first non-cancellation error inside a (nested) exception group, else ``exc``."""
    inner = getattr(exc, "exceptions", None)
    if isinstance(inner, tuple):
        for e in inner:
            found = _first_error(e)
            if not isinstance(found, anyio.get_cancelled_exc_class()):
                return found
    return exc
