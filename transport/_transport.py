"""``Transport``: one endpoint of one-sided tensor movement.

The Transport is a thin front. It checks arguments, opens and closes its parts in order, and
delegates every public method to the part that owns the state:

* :class:`~transport._regions.RegionTable`: what this endpoint has registered;
* :class:`~transport._peers.PeerDirectory`: our record, peers' records, liveness and loss;
* :class:`~transport._transfers.TransferEngine`: puts and gets in flight;
* :class:`~transport._signals.Signals`: the signal table and doorbells;
* :class:`~transport._agent.AgentServer`: this endpoint's server for peers' requests;
* the backends (:mod:`transport.backends`), which move the bytes.

Size: over half of the class is the public methods' docstrings (Args/Returns/Raises and what
cancellation does, the contract users read); each method body delegates in a few lines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
import torch

from ._agent import AgentServer
from ._auth import Authenticator
from ._channel import ChannelPool, hello
from ._cuda_copier import CudaCopier
from ._errors import ClosedError, LayoutError, RegistrationError
from ._flight import FlightRecorder
from ._host import host_id, pid_start
from ._listen import listen_addresses, parse_listen
from ._native import Copier
from ._peers import Me, Peer, PeerDirectory, check_name, peer_name
from ._regions import Region, RegionTable
from ._rendezvous import open_store
from ._routes import Routes
from ._signals import Signals
from ._tensors import MemoryKind, byte_offset, check_tensor, memory_kind
from ._timeouts import seconds
from ._transfers import PreparedTransfer, Transfer, TransferEngine
from ._transfers.runs import RunList
from ._wire import TransferOp
from .backends import Backend, BackendContext, select_backends

log = logging.getLogger(__name__)

LISTEN_ENV = "TRANSPORT_LISTEN"


class Transport:
    """One endpoint: registers local memory, and puts into / gets from peers' memory.

    Use it as an async context manager; it works under trio and asyncio::

        async with transport.Transport("gen-0", store="file:///tmp/tx") as t:
            t.register("policy.w", weights)
            ...

    Args:
        name: unique name in the rendezvous namespace (no "/").
        store: rendezvous URL: ``file://DIR`` (default ``$TRANSPORT_STORE`` or a per-user temp
            dir), ``tcp://HOST:PORT`` (torch TCPStore; add ``?host=1`` in the one process that
            hosts it) or ``memory://NAME`` (one process).
        backends: preference order, e.g. ``("ipc", "tcp")``; None means every available one in
            the default order (ipc, ucx, tcp). Naming an unavailable backend raises.
        timeout: default seconds for every operation; nothing waits longer.
        listen: where this endpoint's agent listens (``$TRANSPORT_LISTEN``): ``HOST`` or
            ``HOST:PORT``, or several, one per NIC, as a comma-separated str or a sequence of
            str (``"10.1.1.2,10.1.2.2"``); all are published, and the ``tcp`` backend stripes
            large transfers over them (one address: no striping). By default the address that
            reaches a ``tcp://`` store, else 127.0.0.1.
        copy_threads: native threads that run same-host copies.
        token: shared secret (or ``$TRANSPORT_TOKEN``): records and connections without it
            are refused (HMAC-SHA256; see the README's trust model).
        heartbeat: seconds between liveness heartbeats (published from a thread).
        lease: seconds without a heartbeat after which a peer on another host is lost (peers
            on this host are checked by pid, at every heartbeat).
        flight_dir: where the flight recorder dumps (or ``$TRANSPORT_FLIGHT_DIR``); None keeps
            the ring in memory only (``dump_flight_record`` then returns None).
        flight_capacity: operation records kept in the ring.
        lanes: parallel channels per peer for backends that support them (``ucx``: workers
            with their own progress threads; large transfers are split across them). None
            means ``$TRANSPORT_UCX_LANES`` or 2.

    Raises:
        ValueError, TypeError: bad arguments (checked here).
        BackendUnavailableError: on entry, a requested backend cannot run here.
        RegistrationError: on entry, a live process already uses ``name``.
    """

    def __init__(
        self,
        name: str,
        store: str | None = None,
        backends: Sequence[str] | None = None,
        timeout: float = 60.0,
        *,
        listen: str | Sequence[str] | None = None,
        copy_threads: int = 2,
        token: str | bytes | None = None,
        heartbeat: float = 1.0,
        lease: float = 10.0,
        flight_dir: str | os.PathLike[str] | None = None,
        flight_capacity: int = 4096,
        lanes: int | None = None,
    ) -> None:
        check_name(name)
        if not seconds(heartbeat, "heartbeat") < seconds(lease, "lease"):
            raise ValueError(f"need 0 < heartbeat < lease, got heartbeat={heartbeat!r}, lease={lease!r}")
        if isinstance(backends, str):
            backends = (backends,)
        self.name = name
        self.timeout = seconds(timeout, "timeout")
        self.incarnation = secrets.token_hex(8)
        self._store_url = store
        self._requested = tuple(backends) if backends is not None else None
        self._listen = parse_listen(listen or os.environ.get(LISTEN_ENV))
        self._copy_threads = copy_threads
        self._lanes = lanes
        self._heartbeat_s, self._lease_s = float(heartbeat), float(lease)
        self._state = "new"
        self._auth = Authenticator(token)
        self._flight = FlightRecorder(name, self.incarnation, capacity=flight_capacity, dump_dir=flight_dir)
        self._regions = RegionTable(name)
        self._backends: list[Backend] = []
        self._seq = 0
        self._cuda: CudaCopier | None = None  # ipc's CUDA copies and all staging; made on first use

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> Transport:
        if self._state != "new":
            raise RuntimeError("a Transport can be entered once")
        self._state = "opening"
        stack = contextlib.AsyncExitStack()
        try:
            await self._open(stack)
        except BaseException:
            self._state = "closed"
            await stack.aclose()
            raise
        self._stack = stack
        log.info("transport %s open (incarnation %s, backends %s, agent %s:%d, store %s)",
                 self.name, self.incarnation, self.backends, *self._agent.address, self._store.url)
        return self

    async def _open(self, stack: contextlib.AsyncExitStack) -> None:
        self._store = await anyio.to_thread.run_sync(lambda: open_store(self._store_url, timeout=self.timeout))
        stack.callback(self._store.close)
        pid = os.getpid()
        me = Me(self.name, self.incarnation, pid, pid_start(pid), host_id())
        backend_classes = select_backends(self._requested)
        # The copy engine's completion task lives in an outer task group so that transfers
        # cancelled at close can still learn that the engine has let go of their memory.
        self._copier = Copier(self._copy_threads)
        stack.callback(self._copier.close)
        outer = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(outer.cancel_scope.cancel)
        await outer.start(self._copier.run)
        self._outer = outer  # the CUDA copier's completion task runs there too (made on first use)
        # Closed once the transfers' task group has ended (every device copy has), while the
        # outer group still delivers completions to the transfers cancelled at close.
        stack.callback(self._close_cuda)
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        self._tasks = tg  # the agent, heartbeats, transfers' staged runs, services (_run_service)
        self._directory = PeerDirectory(me, self._store, self._auth, self._flight, self._heartbeat_s, self._lease_s)
        stack.callback(self._directory.close)
        ctx = BackendContext(self.name, self.incarnation, me.pid, me.host, tg, self._copier, self.timeout,
                             self._auth, self._lanes, self._store, self._cuda_copier, self._directory.watch,
                             self._regions)
        self._backends = [cls(ctx) for cls in backend_classes]
        for b in self._backends:
            self._regions.observe(b)
        stack.callback(self._close_backends)
        for b in self._backends:
            self._directory.subscribe(forget=b.forget_peer)
        self._control = ChannelPool(tg, hello(self.name, self.incarnation, "control"), self._auth)
        stack.callback(self._control.close)
        self._directory.subscribe(forget=self._control.forget_peer)
        self._transfers = TransferEngine(self.name, tg, self._directory, self._backends, self._flight,
                                         self._cuda_copier, self.timeout)
        self._signals = Signals(self.name, self._directory, self._transfers, self._control, self._flight)
        routes = Routes(self.name, self._regions, self._backends, self._signals)
        (host, port), *more = listen_addresses(self._listen, self._store.url)
        self._agent = AgentServer(self.name, self.incarnation, self._auth, routes, host, port, more=more)
        tg.start_soon(self._agent.serve, tg)
        await self._directory.claim()
        self._state = "open"
        self._publish()
        hb_store = self._store if not self._store.blocking else await anyio.to_thread.run_sync(
            lambda: open_store(self._store.url, timeout=self.timeout))
        self._directory.start(tg, hb_store)
        tg.start_soon(self._regions.watch, self._heartbeat_s, self._publish)

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Closes the endpoint: unpublishes it, aborts transfers still running (they fail with
        ClosedError) and releases memory mappings, connections and threads. Idempotent.

        Args:
            drain: first wait for the transfers in flight to end (each ends anyway by its own
                deadline), up to ``timeout``; those still running then are aborted.
            timeout: seconds to drain (default: the Transport's timeout).

        Raises:
            ValueError: a bad ``timeout`` (checked before anything closes).

        Cancellation: once closing has begun it completes (unpublishing is shielded and bounded
        by the timeout). A drain that is cancelled leaves the Transport refusing new transfers
        but not yet closed: leaving ``async with`` (or calling ``aclose()`` again) closes it.
        """
        limit = self._timeout(timeout)
        if self._state in ("closed", "new"):
            self._state = "closed"
            return
        if drain and self._state == "open":
            self._state = self._transfers.state = "draining"  # new transfers are refused meanwhile
            await self._transfers.drain(limit)
        self._state = "closed"
        self._transfers.closing()
        self._signals.wake()
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.timeout):
            await self._directory.withdraw()
        for b in self._backends:
            b.withdrawn()
        # Not inside the shield: the task groups must be exited in the scope they were entered in.
        await self._stack.aclose()
        self._regions.clear()
        # Every transfer has settled: if a failure was dumped meanwhile, the last dump shows how
        # what it caught in flight ended.
        self._flight.dump_if_changed("closing")

    def _run_service(self, service: Callable[[], Awaitable[None]]) -> anyio.CancelScope:
        """Runs ``service`` in this Transport's task group until the returned scope is cancelled
        or the Transport closes (what it raises is logged, not raised): background work of a
        layer above (a weight-sync relay) that lives as long as the Transport, not as the task
        that started it.

        Raises:
            ClosedError: the Transport is not open.
        """
        self._check_open(notice=False)
        scope = anyio.CancelScope()

        async def run() -> None:
            with scope:
                try:
                    await service()
                except Exception:  # nobody waits for a service: logged
                    log.exception("transport %s: service %r failed", self.name, service)

        self._tasks.start_soon(run)
        return scope

    def _close_backends(self) -> None:
        for b in self._backends:
            b.close()

    def _close_cuda(self) -> None:
        if self._cuda is not None:
            self._cuda.close()
            self._cuda = None

    def _cuda_copier(self) -> CudaCopier:
        if self._cuda is None:
            copier = CudaCopier()
            self._outer.start_soon(copier.run)
            self._cuda = copier
        return self._cuda

    def _check_open(self, *, notice: bool = True) -> None:
        """Raises ClosedError unless open; with ``notice`` (every call that is not a transfer),
        also republishes regions whose storage moved since the last look (see ``register``)."""
        if self._state != "open":
            if self._state in ("closed", "draining"):
                raise ClosedError(f"transport {self.name!r} is {self._state}")
            raise ClosedError(f"transport {self.name!r} is not open; use `async with Transport(...)`")
        if notice:
            self._regions.notice_moved(self._publish)

    def _timeout(self, timeout: object) -> float:
        return self.timeout if timeout is None else seconds(timeout, "timeout")

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends this endpoint speaks, in preference order."""
        return tuple(b.name for b in self._backends)

    @property
    def store_url(self) -> str:
        """The rendezvous store's URL (pass it to peers)."""
        return self._store.url

    # -- regions ------------------------------------------------------------------------------

    def _publish(self) -> None:
        self._seq += 1
        descriptors = {b.name: b.endpoint_descriptor() for b in self._backends}
        self._directory.publish(self._seq, self._agent.address, descriptors, self._regions.records(self._backends),
                                agents=self._agent.addresses)
        for b in self._backends:
            b.published(self._seq)

    def register(self, key: str, tensor: torch.Tensor, *, writable: bool = True) -> Region:
        """Exposes ``tensor`` to peers' ``put``/``get`` under ``key``.

        Args:
            key: name peers use for this region; unique within this Transport.
            tensor: a contiguous CPU or CUDA tensor (any caching-allocator tensor, slices
                included; not expandable-segments memory). The Transport keeps a reference to
                it until ``unregister``; do not free or resize its storage meanwhile. If its
                storage is replaced anyway (``set_``, ``resize_``, an optimizer replacing
                ``.data``), the Transport notices within one heartbeat interval, or at its next
                call that is not a transfer, whichever comes first: it logs a warning and
                republishes the region as moved, and peers' transfers into it fail with
                RegistrationError from then on. Bytes a one-sided peer wrote before that went
                into the old storage (kept alive until then), never into freed memory.
            writable: False refuses remote puts (gets still work).

        Returns:
            The registered :class:`Region`.

        Raises:
            ClosedError: the Transport is not open.
            RegistrationError: bad key, key in use, or a non-contiguous tensor.
            BackendUnavailableError: the tensor's device is not served (a CUDA tensor without
                a usable CUDA driver, or with no backend that serves device memory).
        """
        return self.register_many({key: tensor}, writable=writable)[key]

    def register_many(self, tensors: Mapping[str, torch.Tensor], *, prefix: str = "",
                      writable: bool = True) -> dict[str, Region]:
        """Registers many tensors at once (one record update), e.g. a ``state_dict()``.

        Args:
            tensors: key -> tensor; keys are prefixed with ``prefix``.
            prefix: prepended to every key.
            writable: as in :meth:`register`.

        Returns:
            Full key -> Region.

        Raises:
            As :meth:`register`; on error nothing is registered.
        """
        self._check_open()
        serves_device = any(MemoryKind.CUDA in b.memory_kinds for b in self._backends)
        new = self._regions.prepare(tensors, prefix, writable, serves_device, self.backends)
        self._regions.add(new)
        self._publish()
        return new

    def unregister(self, key: str) -> None:
        """Withdraws ``key``; peers' later transfers to it fail with RegistrationError.

        Raises:
            ClosedError: the Transport is not open.
            RegistrationError: ``key`` is not registered.
        """
        self._check_open()
        self._regions.remove(key)
        self._publish()

    def empty(self, key: str, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32, *,
              writable: bool = True) -> torch.Tensor:
        """Allocates a zeroed, shareable, pre-faulted host tensor and registers it under ``key``.

        Same-host peers map this memory directly (no ptrace permission needed), which is the
        fastest ``ipc`` path. The memory lives as long as the returned tensor (or views of it).
        With ``writable=False`` the kernel enforces it: the memfd is sealed, and no other
        process can write it through a mapping, the file or cross-memory attach.

        Returns:
            The new tensor.

        Raises:
            As :meth:`register`; RegistrationError if the allocation fails; ValueError /
            TypeError for a bad shape or dtype.
        """
        self._check_open()
        tensor = self._regions.allocate(key, shape, dtype, writable=writable)
        self.register(key, tensor, writable=writable)
        return tensor

    @property
    def regions(self) -> Mapping[str, Region]:
        """The regions registered here, by key (read-only view)."""
        return self._regions.as_dict()

    # -- transfers ----------------------------------------------------------------------------

    def put(self, src: torch.Tensor, peer: str | Peer, key: str | None = None, offset: int = 0, *,
            timeout: float | None = None) -> Transfer:
        """Starts writing ``src`` into ``peer``'s region ``key`` at byte ``offset``.

        The transfer starts now and runs in the background; await the returned handle to know
        it finished. A non-contiguous ``src`` is staged through a contiguous copy taken now.

        CUDA ``src``: the transfer waits for the work queued on the caller's current stream
        *now* (an event recorded by this call), reads ``src`` on a transport-owned stream, and
        completes once the copy has finished on the device.

        Args:
            src: CPU or CUDA tensor with the region's dtype (the region may be host or device
                memory; see the README's "GPU memory" for which backend serves which pair).
            peer: peer name (or a :class:`Peer`).
            key: remote region; defaults to the key ``src`` itself is registered under here.
            offset: byte offset into the remote region (a multiple of the element size).
            timeout: seconds (default: the Transport's timeout).

        Returns:
            A :class:`Transfer`; awaiting it returns once the bytes are in the peer's memory.
            ``src`` may be reused after that (not before).

        Raises (here, or when awaiting the handle; always before any byte moves):
            ValueError: a bad ``timeout`` (not a finite number > 0); TypeError: a non-integer
                ``offset``; both here, before anything is submitted.
            ClosedError, PeerNotFoundError, RegistrationError (no such key; ``src`` not
            registered and no key given; a region whose tensor moved), ReadOnlyRegionError,
            DTypeMismatchError, BoundsError, BackendUnavailableError. While moving:
            PeerLostError, TransferTimeoutError, TransferAbortedError (see :class:`Transfer`
            for cancellation).

        Ordering: a put that overlaps an earlier transfer from this Transport still in flight
        to the same region starts moving once that one has ended (the later put wins).
        """
        self._check_open(notice=False)
        src = check_tensor(src, "src")
        key = self._key_for(src, key, "src")
        kind = memory_kind(src, "src")
        staged = src if src.is_contiguous() else src.contiguous()
        return self._transfers.start(TransferOp.PUT, staged, kind, peer_name(peer), key, byte_offset(offset),
                                     self._timeout(timeout))

    def get(self, dst: torch.Tensor, peer: str | Peer, key: str | None = None, offset: int = 0, *,
            timeout: float | None = None) -> Transfer:
        """Starts reading ``dst.nbytes`` bytes at byte ``offset`` of ``peer``'s region ``key``
        into ``dst`` (one-sided: the peer's application does nothing).

        CUDA ``dst``: the transfer waits for the work queued on the caller's current stream
        now, and completes once the bytes are in ``dst`` (later work on any stream sees them).

        Args:
            dst: contiguous CPU or CUDA tensor with the region's dtype.
            peer: peer name (or a :class:`Peer`).
            key: remote region; defaults to the key ``dst`` is registered under here.
            offset: byte offset into the remote region.
            timeout: seconds (default: the Transport's timeout).

        Returns:
            A :class:`Transfer`; after awaiting it ``dst`` holds the bytes.

        Raises:
            As :meth:`put`, and LayoutError for a non-contiguous ``dst``.
        """
        self._check_open(notice=False)
        dst = check_tensor(dst, "dst")
        if not dst.is_contiguous():
            raise LayoutError("dst must be contiguous for get (the bytes land in place)")
        key = self._key_for(dst, key, "dst")
        kind = memory_kind(dst, "dst")
        return self._transfers.start(TransferOp.GET, dst, kind, peer_name(peer), key, byte_offset(offset),
                                     self._timeout(timeout))

    def prepare_put(self, peer: str | Peer, items: Sequence[tuple[torch.Tensor, str, int]]) -> PreparedTransfer:
        """Prepares a reusable put of many segments to ``peer``: each item ``(src, key, offset)``
        writes ``src`` (contiguous; a view is fine) at byte ``offset`` of the region ``key``.

        Every check runs once, here: the local ones always, the remote ones (key, dtype, bounds,
        writability) when ``peer`` is already known (after ``await t.peer(...)`` or a transfer
        to it), else at the first start; again only when the peer restarts or re-registers.
        Adjacent segments are coalesced. ``start()`` moves them all with one completion
        (natively batched on ``ipc``; pipelined elsewhere).

        Returns:
            A :class:`PreparedTransfer` (``start()``, ``nbytes``, ``segments``).

        Raises:
            TypeError, ValueError: malformed items (no items; a key or offset of the wrong type).
            LayoutError: a non-contiguous tensor. BoundsError: two items write the same bytes.
            As :meth:`put` for the remote checks, when the peer is known. ClosedError.
        """
        self._check_open(notice=False)
        name = peer_name(peer)
        return self._transfers.prepare(RunList.of_items(TransferOp.PUT, name, items))

    def prepare_get(self, peer: str | Peer, items: Sequence[tuple[torch.Tensor, str, int]]) -> PreparedTransfer:
        """As :meth:`prepare_put`, for a get: each item ``(dst, key, offset)`` reads
        ``dst.nbytes`` bytes at byte ``offset`` of region ``key`` into ``dst``."""
        self._check_open(notice=False)
        name = peer_name(peer)
        return self._transfers.prepare(RunList.of_items(TransferOp.GET, name, items))

    def prepare_put_runs(self, peer: str | Peer, src: torch.Tensor, key: str, runs: object) -> PreparedTransfer:
        """Prepares a reusable put of many runs of one tensor into one region of ``peer``.

        ``runs`` is an integer array of shape ``(N, 3)`` (numpy, or a torch tensor): per run, the
        byte offset in ``src``, the byte offset in region ``key``, and the number of bytes. The
        array stays an array down to the backends' native descriptor lists (no object per run),
        so a plan of 10^5 runs is prepared and started in tens of milliseconds. Runs are checked
        here (inside ``src``, non-negative, aligned to its items, no two writing the same remote
        bytes), sorted by remote offset and coalesced where adjacent on both sides; the remote
        checks (key, dtype, bounds of the runs' span, writability) run as for :meth:`prepare_put`.

        Args:
            peer: the target.
            src: a contiguous CPU or CUDA tensor; read at every start.
            key: the region the runs write into; its dtype must be ``src``'s.
            runs: ``(local byte offset, remote byte offset, nbytes)`` rows.

        Returns:
            A :class:`PreparedTransfer` (``start()``, ``nbytes``, ``segments`` = runs after
            coalescing).

        Raises:
            TypeError: ``runs`` is not an integer ``(N, 3)`` array; ``key`` not a str.
            ValueError: no runs. LayoutError: ``src`` is not contiguous.
            BoundsError: a run outside ``src``, negative or misaligned, or two overlapping
                remote ranges; as :meth:`put` for the remote checks, when ``peer`` is known.
            ClosedError.
        """
        self._check_open(notice=False)
        name = peer_name(peer)
        return self._transfers.prepare(RunList.of_array(TransferOp.PUT, name, src, key, runs))

    def prepare_get_runs(self, peer: str | Peer, dst: torch.Tensor, key: str, runs: object) -> PreparedTransfer:
        """As :meth:`prepare_put_runs`, for a get: each run ``(local, remote, nbytes)`` reads
        ``nbytes`` bytes at byte ``remote`` of region ``key`` into ``dst`` at byte ``local``
        (runs may overlap remotely; ``dst`` is written at every start)."""
        self._check_open(notice=False)
        name = peer_name(peer)
        return self._transfers.prepare(RunList.of_array(TransferOp.GET, name, dst, key, runs))

    def put_many(self, peer: str | Peer, items: Sequence[tuple[torch.Tensor, str, int]], *,
                 timeout: float | None = None) -> Transfer:
        """``prepare_put(peer, items).start(timeout=timeout)`` (raises as those two do)."""
        return self.prepare_put(peer, items).start(timeout=timeout)

    def get_many(self, peer: str | Peer, items: Sequence[tuple[torch.Tensor, str, int]], *,
                 timeout: float | None = None) -> Transfer:
        """``prepare_get(peer, items).start(timeout=timeout)`` (raises as those two do)."""
        return self.prepare_get(peer, items).start(timeout=timeout)

    def _key_for(self, tensor: torch.Tensor, key: str | None, what: str) -> str:
        if key is None:
            key = self._regions.key_of(tensor)
            if key is None:
                raise RegistrationError(f"{what} is not registered here; pass key= to name the remote region")
        return key

    async def fence(self, peer: str | Peer, *, timeout: float | None = None) -> None:
        """Waits until every put/get to ``peer`` started before this call has ended.

        Raises:
            TransferTimeoutError: they did not all end within the timeout.
            TransportError: the first error among them (the others still ended).
            ClosedError: the Transport is closed.

        Cancellation: safe; the transfers themselves keep running.
        """
        self._check_open()
        await self._transfers.fence(peer_name(peer), self._timeout(timeout))

    # -- signals ------------------------------------------------------------------------------

    async def signal(self, peer: str | Peer, name: str, value: int, *, timeout: float | None = None) -> None:
        """Sets the peer's signal ``name`` to ``value``, ordered after every earlier put to it.

        The peer sees the new value (``wait_signal``) only after all bytes of earlier
        transfers to it are in its memory: this first fences, then rings the doorbell.

        Raises:
            As :meth:`fence` (an earlier transfer failed: no signal is sent), PeerNotFoundError,
            PeerLostError, TransferTimeoutError.
            ValueError: ``name`` is not a str of 1 to 256 bytes of UTF-8 (nothing is sent).

        Cancellation: the signal may or may not have been delivered.
        """
        self._check_open()
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"signal value must be an int, got {type(value).__name__}")
        await self._signals.send(peer_name(peer), name, value, self._timeout(timeout))

    def signal_value(self, name: str) -> int | None:
        """The last value a peer set for signal ``name`` here, or None."""
        if self._state == "open":
            self._regions.notice_moved(self._publish)
        return self._signals.value(name)

    async def wait_signal(self, name: str, at_least: int = 1, *, timeout: float | None = None) -> int:
        """Waits, locally, until signal ``name`` is at least ``at_least``; returns its value.

        Raises:
            TransferTimeoutError: not reached within the timeout.
            ClosedError: the Transport closed meanwhile.
        """
        self._check_open()
        return await self._signals.wait(name, at_least, self._timeout(timeout), self._check_open)

    # -- peers --------------------------------------------------------------------------------

    async def peer(self, name: str, *, regions: Sequence[str] = (), timeout: float | None = None) -> Peer:
        """Waits until a live peer called ``name`` is visible, and returns what it published.

        A record left by a dead process on this host is ignored (a replacement is awaited).

        Args:
            name: the peer's name.
            regions: also wait until the peer has registered every one of these keys.
            timeout: seconds to wait (default: the Transport's timeout).

        Returns:
            A :class:`Peer` (its incarnation, backends and regions).

        Raises:
            PeerNotFoundError: no live peer of that name appeared in time.
            AuthenticationError: its record keeps failing authentication (reported within about
                0.3 s: a record signed with another token, or unsigned while we have one).
            ValueError: an unusable name (empty, "/", control characters, over 255 bytes) or timeout.
            ClosedError: the Transport is closed.

        Cancellation: safe at any point; nothing is changed.
        """
        self._check_open()
        return await self._directory.wait(name, regions, self._timeout(timeout), self._check_open)

    async def lookup(self, name: str) -> Peer | None:
        """The peer called ``name`` as published now, or None; never waits for one.

        Unlike :meth:`peer` this does not poll. None means nothing usable is published: no
        record, an unreadable one, or one left by an exited process on this host. A same-host
        peer already known here, alive, whose record seq (as a backend reads it from the peer,
        e.g. ipc's control page) is still the one known, is returned without reading the store. A peer this
        Transport declared lost or excluded is returned as published (transfers to it fail with
        ``PeerLostError`` until it restarts), so callers can report it.

        Raises:
            ClosedError: the Transport is closed.

        Cancellation: safe at any point; nothing is changed.
        """
        self._check_open()
        record = await self._directory.lookup(name)
        return None if record is None else Peer(record)

    async def peers(self) -> list[str]:
        """Names of the peers currently published in the store (this one included)."""
        self._check_open()
        return await self._directory.names()

    def exclude(self, name: str) -> None:
        """Drops ``name`` on purpose (e.g. a straggler): its in-flight transfers are aborted
        with TransferAbortedError and later ones fail with PeerLostError, until it comes back
        as a new incarnation (a restart). Other peers are untouched.

        Raises:
            PeerNotFoundError: this Transport has never seen ``name``.
        """
        self._check_open()
        self._directory.exclude(name)

    # -- flight recorder ----------------------------------------------------------------------

    def dump_flight_record(self, reason: str = "on demand") -> os.PathLike[str] | None:
        """Writes the flight recorder's ring to its directory now.

        Returns:
            The file written, or None when no ``flight_dir`` / ``$TRANSPORT_FLIGHT_DIR`` is set.
        """
        return self._flight.dump(reason)

    def flight_record(self) -> dict[str, Any]:
        """The flight recorder's ring as a JSON-ready dict (what a dump would contain)."""
        return self._flight.snapshot("on demand")

    def __repr__(self) -> str:
        return f"<Transport {self.name!r} {self._state} backends={self.backends if self._state == 'open' else '-'}>"
