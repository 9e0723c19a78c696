"""``ucx``: one-sided RMA into peers' registered memory on any host, through libucp.

How it works:

* libucp is loaded at run time by the native extension (``dlopen``): the ``libucx-cu12`` wheel
  (``pip install 'transport[ucx]'``) by default, else the system loader's ``libucp.so.0``; set
  ``$TRANSPORT_UCX_LIB`` to a ``libucp.so`` path (or its directory) to choose one, e.g. a
  system UCX built with InfiniBand support (the PyPI build has no verbs).
* One UCP context per Transport with its *lanes*: a worker driven by a native progress thread
  each (:class:`transport._native.ucx.UcxEngine`). Every region is mapped once (``ucp_mem_map``);
  its packed rkey travels in the peer record, the lanes' worker addresses in the endpoint
  descriptor. Each lane creates one endpoint per peer incarnation (to the peer's lane of the
  same index), and rkeys are unpacked once per peer incarnation, region and lane.
  ``put``/``get`` are ``ucp_put_nbx``/``ucp_get_nbx`` in chunks; a put completes after
  ``ucp_ep_flush_nbx``, i.e. when its bytes are in the peer's memory.
* Lanes: one worker copies serially (with shared memory the copy itself runs inside
  ``ucp_put_nbx``, one CPU's worth: about half of memcpy into 4 KiB pages), so a transfer of at
  least ``_SPLIT_MIN_BYTES`` is split across the lanes and small ones take turns.
  ``$TRANSPORT_UCX_LANES`` sets the number (default 2; 1 gives exactly one endpoint per peer).
* Prepared runs to a same-host peer that UCX would reach by ``cma`` (``$UCX_TLS`` allows it)
  are the same ``process_vm_writev`` / ``readv`` calls UCX makes, IOV_MAX runs per call instead
  of one, on the Transport's copy threads: one run per system call is below a million runs a
  second on a VM. A failure (ptrace permission) sends that prepared transfer through UCX.
* One-sided: the target's Python takes no part. With the shared-memory transports (``cma``)
  the target makes no call at all; with transports that need target progress (``tcp``) the
  target's native progress thread serves them, so a target blocked in ``time.sleep`` still
  receives.
* No UCX peer error handling (``UCP_ERR_HANDLING_MODE_NONE``): it would force slow emulated
  protocols. Peer failure is detected by the Transport's peer directory instead (the backend
  asks it to ``watch`` every peer it links to): a connection to the peer's agent that the
  peer's kernel resets when the process dies (and a refused connection when its agent is gone).
  The peer is then declared lost: its transfers in flight end with :class:`PeerLostError` and
  ``forget_peer`` force-closes its endpoints; a peer that cannot be watched (its agent is
  unreachable) still fails by the transfer's timeout, never hangs.
* UCX configuration (``UCX_TLS``, ``UCX_NET_DEVICES``, ...) comes from the user's environment,
  read as it is; the library never sets environment variables.
* Read-only regions (``writable=False``) are mapped without remote-write access
  (``UCP_MEM_MAP_PROT_REMOTE_WRITE`` left out): RDMA hardware refuses a put through their rkey.
  UCX's software transports do not check rkeys at all (verified with libucx-cu12 1.22): over
  ``cma`` and ``tcp`` a peer holding any rkey of a process can write anywhere in it. So a
  read-only region in a library buffer (``Transport.empty``) is published at a ``PROT_READ``
  alias mapping of the buffer: a put through ``cma`` fails (``EFAULT``) and the target is
  untouched, but a put through UCX's ``tcp`` transport makes the *target* process crash
  (``SIGSEGV`` in its progress thread), as would a put to any unmapped address. Only peers
  trusted with all of a process's memory may reach its UCX workers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import anyio
import numpy as np

from .._errors import (
    ClosedError,
    PeerLostError,
    TransportError,
    TransportInternalError,
    WireError,
)
from .._native import CopyKind, CopyPlan, CopyStatus, RemoteWord
from .._native.ucx import UcxEngine, UcxList, UcxPart, UcxResult, library
from .._pieces import Ready
from .._regions import Region
from .._tensors import MemoryKind, Runs
from .._wire import PeerRecord, RegionRecord, TransferOp
from ._base import Backend, BackendContext, LocalBuffer, RemoteTarget, Runner
from ._control import SEQ_OFFSET, WITHDRAWN_SEQ, PeerControlPages, control_page
from ._ucx_descriptors import EndpointInfo, decode_endpoint, decode_region, encode_endpoint, encode_region

log = logging.getLogger(__name__)

LANES_ENV = "TRANSPORT_UCX_LANES"
DEFAULT_LANES = 2
_MAX_LANES = 16

# UCX statuses that say the link failed rather than the request: the peer is gone or cut off.
_UCS_LINK_ERRORS = frozenset({-3, -6, -16, -20, -23, -24, -25, *range(-89, -39)})

# Transfers this large are split across the lanes (page-aligned parts); smaller ones use one.
_SPLIT_MIN_BYTES = 4 << 20
_SYNC_WAIT_S = 0.002  # a synchronous (small, same-host) transfer waits this long, then goes asynchronous
_SYNC_PAIR_MIN_BYTES = 256 << 10  # a synchronous transfer this large is split over two lanes copying at once
_PAGE = 4096
# live_seq over UCX (peers on other hosts) blocks the event loop for one small read: bounded,
# and after a read that did not complete the peer is not read again for a while (a stopped
# peer must not stall the transfers to every other peer).
_SEQ_READ_TIMEOUT_S = 0.1
_SEQ_READ_BACKOFF_S = 2.0


class UcxStatusError(Exception):
    """A UCX failure status, as the ``__cause__`` of the TransportError that reports it."""


# -- configuration -----------------------------------------------------------------------------


def _lanes_from_env() -> int:
    raw = os.environ.get(LANES_ENV)
    if not raw:
        return DEFAULT_LANES
    try:
        lanes = int(raw)
    except ValueError:
        lanes = 0
    if not 1 <= lanes <= _MAX_LANES:
        raise ValueError(f"${LANES_ENV} must be an integer from 1 to {_MAX_LANES}, got {raw!r}")
    return lanes


def _ucx_allows_cma(tls: str | None) -> bool:
    """Whether ``$UCX_TLS`` (as UCX reads it: a list of transports and aliases, ``^`` to
    exclude them; unset means all) lets UCX reach same-host peers by cross-memory attach."""
    if not tls or not tls.strip():
        return True
    negate = tls.strip().startswith("^")
    names = {t.strip().lower() for t in tls.strip().lstrip("^").split(",") if t.strip()}
    listed = bool(names & {"cma", "sm", "shm", "all"})
    return not listed if negate else listed


# -- the backend -------------------------------------------------------------------------------


@dataclass(eq=False)
class _Link:
    """Our endpoints (one per lane) to one peer incarnation, its unpacked rkeys, its liveness."""

    peer: str
    incarnation: str
    eps: list[int]  # lane -> endpoint
    info: EndpointInfo
    ctl_rkey: int | None = None  # the peer's control word, unpacked on lane 0
    seq_backoff_until: float = 0.0  # monotonic time before which its word is not read again
    # region key -> (descriptor, rkey per lane, remote address)
    rkeys: dict[str, tuple[bytes, list[int], int]] = field(default_factory=dict)
    lost: BaseException | None = None  # set once the peer is known to be gone


class UcxBackend(Backend):
    """UCX RMA (see the module docstring). Host memory only for now."""

    name = "ucx"
    one_sided = True
    memory_kinds = frozenset({MemoryKind.CPU})

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return library()[2]

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        path, _version, why = library()
        if path is None:
            raise TransportInternalError(f"ucx backend unavailable: {why}")
        try:
            lanes = ctx.lanes if ctx.lanes is not None else _lanes_from_env()
            if not 1 <= lanes <= _MAX_LANES:
                raise ValueError(f"lanes must be from 1 to {_MAX_LANES}, got {lanes}")
        except ValueError as exc:
            raise TransportInternalError(str(exc)) from None
        self._engine = UcxEngine(path, f"transport:{ctx.name}", lanes=lanes)
        try:
            # The control word: the seq of our latest record, which initiators read before a
            # transfer (live_seq) so that they notice (un)registrations, as ipc's control page does.
            # Same-host initiators map its page (sealed against their writes) and read it with one
            # load; others read it with a UCX get.
            self._ctl = control_page(ctx.name, "ucx-ctl")
            self._ctl_mem, ctl_rkey = self._engine.mem_map(self._ctl.address + SEQ_OFFSET, 8, remote_write=False)
            addresses = [self._engine.worker_address(i) for i in range(lanes)]
            self._endpoint = encode_endpoint(addresses, self._ctl, ctl_rkey)
        except BaseException:
            self._engine.close()
            raise
        ctx.tg.start_soon(self._engine.run)
        self._seq_word = RemoteWord()  # reads a same-host peer's control word that cannot be mapped
        self._peer_ctl = PeerControlPages(ctx.name, self._ctl_page_of)  # same-host peers' control pages
        self._next_lane = 0
        self._cma = _ucx_allows_cma(os.environ.get("UCX_TLS"))
        self._mapped: dict[int, tuple[Region, int | None, bytes | None]] = {}  # id(region) -> (region, mem, descriptor)
        self._described: set[int] = set()
        self._links: dict[str, _Link] = {}
        self._refusals: dict[tuple[str, str, str, bytes], str] = {}
        self._infos: dict[tuple[str, str], EndpointInfo | None] = {}  # (peer, incarnation) -> decoded descriptor
        self._closed = False

    # -- registration ----------------------------------------------------------------------

    def endpoint_descriptor(self) -> bytes:
        return self._endpoint

    def region_descriptor(self, region: Region) -> bytes | None:
        if region.device != "cpu":
            return None  # device memory: not mapped (this build's UCX path is host memory only)
        self._described.add(id(region))
        entry = self._mapped.get(id(region))
        if entry is None:
            try:
                mem, desc = self._map(region)
            except TransportError as exc:
                # Not fatal to the registration: peers see no ucx descriptor and use another backend.
                log.warning("transport %s: cannot map %r (%d bytes) for ucx: %s",
                            self.ctx.name, region.key, region.nbytes, exc)
                mem, desc = None, None
            entry = (region, mem, desc)  # holding the region keeps id(region) unique while mapped
            self._mapped[id(region)] = entry
        return entry[2]

    def _map(self, region: Region) -> tuple[int | None, bytes]:
        """Maps ``region`` (``ucp_mem_map``); returns its memory handle and descriptor.

        A read-only region gets an rkey without remote-write access, which RDMA hardware
        enforces. UCX's software transports ignore it (``cma`` and ``tcp`` write through any
        rkey), so a read-only region in a library buffer (``Transport.empty``) is mapped and
        published at the buffer's ``PROT_READ`` alias: a put through ``cma`` then fails
        (``EFAULT``). Where the alias cannot be mapped or registered, the region itself is.

        Raises:
            TransportError: UCX refused the registration.
        """
        address = region.address
        if region.nbytes == 0:
            return None, encode_region(address, 0, b"")
        if not region.writable and region.shared is not None:
            try:
                alias = region.shared.read_only_address + (region.address - region.shared.address)
                mem, rkey = self._engine.mem_map(alias, region.nbytes, remote_write=False, local_write=False)
                return mem, encode_region(alias, region.nbytes, rkey)
            except (RuntimeError, TransportInternalError) as exc:
                log.info("transport %s: %r is mapped for ucx without its read-only alias (%s): only RDMA "
                         "transports will refuse puts into it", self.ctx.name, region.key, exc)
        mem, rkey = self._engine.mem_map(address, region.nbytes, remote_write=region.writable)
        return mem, encode_region(address, region.nbytes, rkey)

    def published(self, seq: int) -> None:
        self._ctl.write_u64(SEQ_OFFSET, seq)  # one aligned 8-byte store: readers see the old or the new seq
        # Regions left out of the record just published were unregistered: unmap them.
        for rid in [rid for rid in self._mapped if rid not in self._described]:
            _region, mem, _desc = self._mapped.pop(rid)
            if mem is not None:
                self._engine.mem_unmap(mem)
        self._described.clear()

    # -- peers -----------------------------------------------------------------------------

    def _link(self, peer: PeerRecord) -> _Link:
        link = self._links.get(peer.name)
        if link is not None and link.incarnation != peer.incarnation:
            self.forget_peer(peer.name)  # restarted; the Transport may not have told us yet
            link = None
        if link is None:
            info = decode_endpoint(peer.backends["ucx"], peer.name)  # raises WireError: no silent None here
            addresses = info.addresses
            eps: list[int] = []
            try:
                for lane in range(self._engine.lanes):
                    eps.append(self._engine.connect(lane, addresses[lane % len(addresses)]))
            except TransportError:
                for lane, ep in enumerate(eps):
                    self._engine.disconnect(lane, ep, force=True)
                raise
            link = _Link(peer.name, peer.incarnation, eps, info)
            self._links[peer.name] = link
            if self.ctx.watch is not None:
                self.ctx.watch(peer)  # the Transport declares it lost (and forgets it here) when it dies
        return link

    def _rkey(self, link: _Link, region: RegionRecord) -> tuple[list[int], int]:
        """The region's rkey on every lane, and its remote address."""
        desc = region.descriptors["ucx"]
        cached = link.rkeys.get(region.key)
        if cached is not None and cached[0] == desc:
            return cached[1], cached[2]
        address, _nbytes, packed = decode_region(desc, f"{link.peer}:{region.key!r}")
        rkeys: list[int] = []
        try:
            for lane, ep in enumerate(link.eps):
                rkeys.append(self._engine.unpack_rkey(lane, ep, packed))
        except TransportError:
            for lane, rkey in enumerate(rkeys):
                self._engine.destroy_rkey(lane, rkey)
            raise
        if cached is not None:  # re-registered: the old keys go once no transfer uses them
            for lane, rkey in enumerate(cached[1]):
                self._engine.destroy_rkey(lane, rkey)
        link.rkeys[region.key] = (desc, rkeys, address)
        return rkeys, address

    def withdrawn(self) -> None:
        self._ctl.write_u64(SEQ_OFFSET, WITHDRAWN_SEQ)

    def live_seq(self, peer: PeerRecord) -> int | None:
        """The seq in the peer's control word: same-host peers by one load from our mapping of
        its control page (or, when it cannot be mapped, one cross-memory-attach read), others by
        a bounded 8-byte UCX get. None when it cannot be read. Called before every synchronous
        transfer, so the mapped case is kept to a dictionary lookup and a load."""
        seq = self._peer_ctl.read(peer)
        if seq is not None:
            return seq
        info = self._info(peer)
        if info is None:
            return None
        if peer.host == self.ctx.host:  # its page cannot be mapped: read the word by cma
            seq = self._seq_word.read(peer.pid, info.ctl_address)
            if seq is not None:
                return seq
        return self._read_seq_over_ucx(peer)

    def _ctl_page_of(self, peer: PeerRecord) -> tuple[int, int] | None:
        info = self._info(peer) if peer.host == self.ctx.host else None
        return (info.ctl_fd, info.ctl_inode) if info is not None else None

    def _info(self, peer: PeerRecord) -> EndpointInfo | None:
        cache_key = (peer.name, peer.incarnation)
        if cache_key not in self._infos:
            try:
                data = peer.backends.get("ucx")
                self._infos[cache_key] = decode_endpoint(data, peer.name) if data is not None else None
            except WireError as exc:
                log.warning("transport %s: %s", self.ctx.name, exc)
                self._infos[cache_key] = None
        return self._infos[cache_key]

    def _read_seq_over_ucx(self, peer: PeerRecord) -> int | None:
        try:
            link = self._link(peer)
            if link.lost is not None or anyio.current_time() < link.seq_backoff_until:
                return None
            if link.ctl_rkey is None:
                link.ctl_rkey = self._engine.unpack_rkey(0, link.eps[0], link.info.ctl_rkey)
            timeout = min(_SEQ_READ_TIMEOUT_S, self.ctx.timeout)
            seq = self._engine.read_word(0, link.eps[0], link.ctl_rkey, link.info.ctl_address, timeout)
        except (TransportError, WireError) as exc:
            log.debug("transport %s: cannot read the record seq of %s over ucx: %s", self.ctx.name, peer.name, exc)
            return None
        if seq is None:
            log.info("transport %s: %s did not answer a read of its record seq within %gs; not asking again for %gs",
                     self.ctx.name, peer.name, _SEQ_READ_TIMEOUT_S, _SEQ_READ_BACKOFF_S)
            link.seq_backoff_until = anyio.current_time() + _SEQ_READ_BACKOFF_S
        return seq

    def unreachable_reason(self, peer: PeerRecord, region: RegionRecord, local: MemoryKind) -> str | None:
        if region.device != "cpu":
            return f"{region.key!r} is device memory ({region.device}); this ucx backend maps host memory only"
        desc = region.descriptors.get("ucx")
        if "ucx" not in peer.backends or desc is None:
            return f"{peer.name} published no ucx descriptor for {region.key!r}"
        if region.nbytes == 0:
            return None
        cache_key = (peer.name, peer.incarnation, region.key, desc)
        if cache_key in self._refusals:
            return self._refusals[cache_key]
        try:
            link = self._link(peer)
            if link.lost is None:  # a lost peer is reported by the transfer, not skipped over
                self._rkey(link, region)
        except (TransportInternalError, WireError) as exc:
            self._refusals[cache_key] = f"cannot reach {peer.name}:{region.key!r} over ucx: {exc}"
            return self._refusals[cache_key]
        return None

    def _lose(self, link: _Link, cause: BaseException) -> None:
        if link.lost is not None:
            return
        link.lost = cause
        log.info("transport %s: ucx peer %s (incarnation %s) is gone: %s", self.ctx.name, link.peer,
                 link.incarnation, cause)
        # Ends its transfers in flight; afterwards UCX no longer touches their memory.
        for lane, ep in enumerate(link.eps):
            self._engine.disconnect(lane, ep, force=True)

    def _drop(self, link: _Link) -> None:
        if link.lost is None:  # a restarted or closed peer: no goodbye to wait for
            for lane, ep in enumerate(link.eps):
                self._engine.disconnect(lane, ep, force=True)

    def forget_peer(self, peer: str) -> None:
        link = self._links.pop(peer, None)
        if link is not None:
            self._drop(link)
        self._refusals = {k: v for k, v in self._refusals.items() if k[0] != peer}
        self._infos = {k: v for k, v in self._infos.items() if k[0] != peer}
        self._peer_ctl.forget(peer)

    # -- data path -------------------------------------------------------------------------

    def mover(self, op: TransferOp, peer: PeerRecord, region: RegionRecord) -> Callable[[int, int, int], bool] | None:
        """Same-host peers only (UCX reaches their memory by cma, without their help): one
        lane issues the transfer and flushes it while the caller waits, at most
        ``_SYNC_WAIT_S``; past that it is cancelled and the transfer takes the asynchronous
        path. A transfer from ``_SYNC_PAIR_MIN_BYTES`` on is split over two lanes that move a half
        each at the same time (the caller drives one, the engine's assistant thread the
        other)."""
        if peer.host != self.ctx.host or region.nbytes == 0 or self.unreachable_reason(peer, region,
                                                                                      MemoryKind.CPU) is not None:
            return None
        link = self._link(peer)
        rkeys, address = self._rkey(link, region)
        second = (1, link.eps[1], rkeys[1]) if len(link.eps) > 1 else None
        now = self._engine.now_mover(op, (0, link.eps[0], rkeys[0]), second, address, _SYNC_WAIT_S,
                                     _SYNC_PAIR_MIN_BYTES, _PAGE)

        def move(local: int, offset: int, nbytes: int) -> bool:
            return link.lost is None and now(local, offset, nbytes)

        return move

    async def move(self, op: TransferOp, local: LocalBuffer, remote: RemoteTarget) -> None:
        peer, region = remote.peer, remote.region
        what = f"ucx {op.name.lower()} of {remote.nbytes} bytes at offset {remote.offset} of {peer.name}:{region.key!r}"
        try:
            link = self._link(peer)
            if link.lost is not None:
                raise self._lost_error(what, link)
            rkeys, address = self._rkey(link, region)
        except (TransportInternalError, WireError) as exc:
            raise TransportInternalError(f"{what}: {exc}") from exc
        parts = self._split(link, rkeys, local.address, address + remote.offset, remote.nbytes)
        # `local` (the tensor) is kept referenced by the engine until UCX lets go of its memory.
        result = await self._engine.transfer(op, parts, keep=local)
        if result.status == CopyStatus.OK:
            return
        self._raise_for(result, what, link)

    def prepare_runs(self, op: TransferOp, peer: PeerRecord, lists: Sequence[tuple[Runs, RegionRecord]]) -> Runner:
        """Per region, the arrays become one native list per lane as they are (addresses added
        to two columns, split by bytes in order), packed once; each run submits the lists
        (every run one ``ucp_put_nbx`` / ``ucp_get_nbx``, one flush per list) and awaits one
        result.

        A same-host peer that UCX reaches by cross-memory attach (``cma``: one
        ``process_vm_writev`` per run) gets the same system calls with up to IOV_MAX runs each,
        on the Transport's copy threads: the arrays are packed as copy rows once. Where that
        fails (e.g. ptrace permission), the runner moves through UCX from then on, which
        raises the precise error if UCX fails too."""
        what = f"ucx {op.name.lower()} of {sum(len(r.array) for r, _ in lists)} runs to {peer.name}"
        keep = [r.local for r, _ in lists]
        try:
            link = self._link(peer)
            if self._cma and peer.host == self.ctx.host and peer.pid != self.ctx.pid:
                rows = [r.copies(op == TransferOp.PUT, self._rkey(link, region)[1]) for r, region in lists]
                kind = CopyKind.CMA_WRITE if op == TransferOp.PUT else CopyKind.CMA_READ
                plan = self.ctx.copier.plan(kind, peer.pid, np.concatenate(rows).astype(np.uint64).tobytes())
                return self._cma_runner(op, link, lists, plan, keep, what)
            native = self._ucx_lists(link, lists)
        except (TransportInternalError, WireError) as exc:
            raise TransportInternalError(f"{what}: {exc}") from exc
        return self._runner(op, link, native, keep, what)

    def _ucx_lists(self, link: _Link, lists: Sequence[tuple[Runs, RegionRecord]]) -> list[UcxList]:
        """The runs as native lists: per region, one per lane (split by bytes, in order)."""
        by_region: dict[str, tuple[RegionRecord, list[np.ndarray]]] = {}
        for r, region in lists:
            a = r.array
            by_region.setdefault(region.key, (region, []))[1].append(
                np.stack([a[:, 0] + r.local.address, a[:, 1], a[:, 2]], axis=1))
        native: list[UcxList] = []
        lanes = len(link.eps)
        for region, parts in by_region.values():
            rkeys, address = self._rkey(link, region)
            segs = np.concatenate(parts)
            segs[:, 1] += address
            segs = segs.astype(np.uint64)
            split = [segs]
            if lanes > 1 and len(segs) > 1:
                ends = np.cumsum(segs[:, 2])
                share = -(-int(ends[-1]) // lanes)
                split = np.split(segs, np.searchsorted(ends, [share * (k + 1) for k in range(lanes - 1)]) + 1)
            native += [UcxList(lane, link.eps[lane], rkeys[lane], part.tobytes())
                       for lane, part in enumerate(split) if len(part)]
        return native

    def _cma_runner(self, op: TransferOp, link: _Link, lists: Sequence[tuple[Runs, RegionRecord]],
                    plan: CopyPlan, keep: list[LocalBuffer], what: str) -> Runner:
        """Runs ``plan`` (copy rows into / out of the peer, cut and grouped once) by cross-memory
        attach; after a failure, through UCX (:meth:`_runner` over lists built then)."""
        through_ucx: list[Runner] = []

        async def run(ready: Ready) -> None:
            if link.lost is not None:
                raise self._lost_error(what, link)
            if not through_ucx:
                result = await self.ctx.copier.copy_plan(plan)
                if result.status == CopyStatus.OK:
                    return
                if result.status == CopyStatus.ABORTED:
                    raise ClosedError(f"{what} was aborted after {result.nbytes} bytes: the transport is closing")
                log.info("transport %s: %s by cross-memory attach failed (%s); moving through UCX",
                         self.ctx.name, what, os.strerror(result.err) if result.err else "aborted")
                try:
                    through_ucx.append(self._runner(op, link, self._ucx_lists(link, lists), keep, what))
                except (TransportInternalError, WireError) as exc:
                    raise TransportInternalError(f"{what}: {exc}") from exc
            await through_ucx[0](ready)

        return run

    def _runner(self, op: TransferOp, link: _Link, lists: list[UcxList], keep: list[LocalBuffer],
                what: str) -> Runner:
        """Submits ``lists`` at every call and awaits their one result (``keep``: the local
        buffers, referenced until UCX lets go of them)."""
        async def run(ready: Ready) -> None:
            if link.lost is not None:
                raise self._lost_error(what, link)
            result = await self._engine.transfer_many(op, lists, keep=keep)
            if result.status != CopyStatus.OK:
                self._raise_for(result, what, link)

        return run

    def _split(self, link: _Link, rkeys: list[int], local: int, remote: int, nbytes: int) -> list[UcxPart]:
        lanes = len(link.eps)
        if lanes == 1 or nbytes < _SPLIT_MIN_BYTES:
            lane = self._next_lane % lanes  # small transfers take turns
            self._next_lane += 1
            return [UcxPart(lane, link.eps[lane], rkeys[lane], local, remote, nbytes)]
        share = -(-nbytes // lanes)
        share += -share % _PAGE  # page-aligned parts: no page is pinned by two lanes at once
        parts = []
        for lane in range(lanes):
            start = lane * share
            if start >= nbytes:
                break
            n = min(share, nbytes - start)
            parts.append(UcxPart(lane, link.eps[lane], rkeys[lane], local + start, remote + start, n))
        return parts

    def _lost_error(self, what: str, link: _Link) -> PeerLostError:
        err = PeerLostError(f"{what} failed: {link.peer} is gone ({link.lost})")
        err.__cause__ = link.lost
        return err

    def _raise_for(self, result: UcxResult, what: str, link: _Link) -> None:
        if link.lost is not None:
            raise self._lost_error(what, link)
        if result.status == CopyStatus.ABORTED:
            raise ClosedError(f"{what} was aborted after {result.nbytes} bytes: the transport is closing")
        cause = UcxStatusError(result.describe())
        if result.ucs_status in _UCS_LINK_ERRORS:
            self._lose(link, cause)
            raise PeerLostError(f"{what} failed after {result.nbytes} bytes: {cause}") from cause
        raise TransportInternalError(f"{what} failed after {result.nbytes} bytes: {cause}") from cause

    async def put(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        await self.move(TransferOp.PUT, local, remote)

    async def get(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        await self.move(TransferOp.GET, local, remote)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._links.clear()
        # Closes endpoints, aborts what is in flight, destroys the worker (bounded).
        self._engine.close()
        self._mapped.clear()
