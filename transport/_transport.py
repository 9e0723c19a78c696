"""``Transport``: one endpoint of one-sided tensor movement.

A Transport owns a task group (its background agent, the copy engine's completion task and
every transfer run there), its registered regions and its view of peers. It publishes a
versioned peer record in the rendezvous store; peers read it to learn which backends it speaks
and where its regions are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import urllib.parse
from typing import Any, Mapping, Sequence

import anyio
import torch

from . import _cuda
from ._agent import AgentServer, ChannelPool, local_address_towards
from ._errors import (
    BackendUnavailableError,
    BoundsError,
    ClosedError,
    DTypeMismatchError,
    LayoutError,
    PeerNotFoundError,
    ReadOnlyRegionError,
    RegistrationError,
    TransferTimeoutError,
    TransportError,
)
from ._auth import Authenticator
from ._flight import FlightRecorder, OpState
from ._host import host_id, pid_start, process_alive
from ._liveness import Heartbeat, Leases
from ._native import Copier, load
from ._peers import _PEER_PREFIX, PeerDirectory
from ._regions import Peer, Region
from ._rendezvous import open_store
from ._routing import TransferRunner
from ._tensors import MemoryKind, check_tensor, dtype_name, memory_kind, nbytes_of
from ._transfer import Transfer, TransferOp
from ._wire import FrameKind, PeerRecord
from .backends import PLANNED, REGISTRY, Backend, BackendContext, LocalBuffer

log = logging.getLogger(__name__)

LISTEN_ENV = "TRANSPORT_LISTEN"


class Transport(PeerDirectory, TransferRunner):
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
        listen: ``HOST`` or ``HOST:PORT`` for this endpoint's agent (``$TRANSPORT_LISTEN``);
            by default the address that reaches a ``tcp://`` store, else 127.0.0.1.
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
        ValueError: bad arguments (checked here).
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
        listen: str | None = None,
        copy_threads: int = 2,
        token: str | bytes | None = None,
        heartbeat: float = 1.0,
        lease: float = 10.0,
        flight_dir: str | os.PathLike[str] | None = None,
        flight_capacity: int = 4096,
        lanes: int | None = None,
    ) -> None:
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"name must be a non-empty string without '/', got {name!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if not (heartbeat > 0 and lease > heartbeat):
            raise ValueError(f"need 0 < heartbeat < lease, got heartbeat={heartbeat!r}, lease={lease!r}")
        if isinstance(backends, str):
            backends = (backends,)
        self.name = name
        self.timeout = float(timeout)
        self._store_url = store
        self._requested = tuple(backends) if backends is not None else None
        self._listen = listen or os.environ.get(LISTEN_ENV)
        self._copy_threads = copy_threads
        self._lanes = lanes
        self._state = "new"
        self.incarnation = secrets.token_hex(8)
        self._regions: dict[str, Region] = {}
        self._by_memory: dict[tuple[int, int, torch.dtype], str] = {}
        self._shared: list[Any] = []  # SharedBuffers allocated by empty()
        self._peers: dict[str, PeerRecord] = {}
        self._inflight: dict[str, set[Transfer]] = {}
        self._signals: dict[str, int] = {}
        self._seq = 0
        self._fallbacks_logged: set[tuple[str, str]] = set()
        self._auth = Authenticator(token)
        self._heartbeat_s = float(heartbeat)
        self._leases = Leases(float(lease))
        self._lost: dict[tuple[str, str], BaseException] = {}  # (peer, incarnation) -> why
        self._flight = FlightRecorder(name, self.incarnation, capacity=flight_capacity, dump_dir=flight_dir)
        self._cuda: _cuda.CudaEngine | None = None  # ipc's CUDA copies and all staging; made on first use

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> Transport:
        if self._state != "new":
            raise RuntimeError("a Transport can be entered once")
        self._state = "opening"
        self._signal_event = anyio.Event()
        stack = contextlib.AsyncExitStack()
        try:
            self._store = await anyio.to_thread.run_sync(lambda: open_store(self._store_url, timeout=self.timeout))
            stack.callback(self._store.close)
            self._pid, self._pid_start, self._host = os.getpid(), pid_start(os.getpid()), host_id()
            backend_classes = self._select_backends()
            # The copy engine's completion task lives in an outer task group so that transfers
            # cancelled at close can still learn that the engine has let go of their memory.
            self._copier = Copier(self._copy_threads)
            stack.callback(self._copier.close)
            outer = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(outer.cancel_scope.cancel)
            await outer.start(self._copier.run)
            self._tg = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(self._tg.cancel_scope.cancel)
            host, port = self._listen_address()
            self._agent = AgentServer(self, host, port)
            self._tg.start_soon(self._agent.serve, self._tg)
            ctx = BackendContext(self.name, self.incarnation, self._pid, self._host, self._tg, self._copier, self.timeout, self._auth, self._lanes, self._store, self._cuda_engine)
            self._backends: list[Backend] = [cls(ctx) for cls in backend_classes]
            stack.callback(self._close_backends)
            self._control = ChannelPool(self._tg, {"from": self.name, "from_incarnation": self.incarnation, "lane": "control"}, self._auth)
            stack.callback(self._control.close)
            await self._claim_name()
            self._state = "open"
            self._publish()
            hb_store = self._store if not self._store.blocking else await anyio.to_thread.run_sync(lambda: open_store(self._store.url, timeout=self.timeout))
            self._heartbeat = Heartbeat(hb_store, self.name, self.incarnation, self._heartbeat_s)
            self._heartbeat.start()
            stack.callback(self._heartbeat.stop)
            self._tg.start_soon(self._watch_peers)
        except BaseException:
            self._state = "closed"
            await stack.aclose()
            raise
        self._stack = stack
        log.info("transport %s open (incarnation %s, backends %s, agent %s:%d, store %s)",
                 self.name, self.incarnation, self.backends, *self._agent.address, self._store.url)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes the endpoint: unpublishes it, aborts transfers still running (they fail with
        ClosedError) and releases memory mappings, connections and threads. Idempotent."""
        if self._state in ("closed", "new"):
            self._state = "closed"
            return
        self._state = "closed"
        self._wake_signal_waiters()
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.timeout):
            try:
                mine = await self._store.aget(_PEER_PREFIX + self.name)
                if mine is not None and PeerRecord.decode(self._auth.open_record(mine, self.name)).incarnation == self.incarnation:
                    self._store.delete(_PEER_PREFIX + self.name)
            except TransportError as exc:
                log.warning("transport %s: could not remove its peer record: %s", self.name, exc)
        # Not inside the shield: the task groups must be exited in the scope they were entered in.
        await self._stack.aclose()
        self._regions.clear()
        self._by_memory.clear()

    def _close_backends(self) -> None:
        for b in self._backends:
            b.close()
        if self._cuda is not None:
            self._cuda.close()
            self._cuda = None

    def _check_open(self) -> None:
        if self._state != "open":
            if self._state == "closed":
                raise ClosedError(f"transport {self.name!r} is closed")
            raise ClosedError(f"transport {self.name!r} is not open; use `async with Transport(...)`")

    @property
    def auth(self) -> Authenticator:  # AgentHandler
        return self._auth

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends this endpoint speaks, in preference order."""
        return tuple(b.name for b in self._backends)

    @property
    def store_url(self) -> str:
        return self._store.url

    def _select_backends(self) -> list[type[Backend]]:
        names = self._requested if self._requested is not None else tuple(REGISTRY)
        if not names:
            raise ValueError("backends=() leaves nothing to move bytes with")
        chosen = []
        for n in names:
            if n not in REGISTRY:
                if n in PLANNED:
                    raise BackendUnavailableError(PLANNED[n])
                raise ValueError(f"unknown backend {n!r}; known: {', '.join([*REGISTRY, *PLANNED])}")
            reason = REGISTRY[n].unavailable_reason()
            if reason is not None:
                if self._requested is not None:
                    raise BackendUnavailableError(f"backend {n!r} is unavailable: {reason}")
                log.info("backend %s unavailable: %s", n, reason)
                continue
            chosen.append(REGISTRY[n])
        return chosen

    def _listen_address(self) -> tuple[str, int]:
        if self._listen:
            host, _, port = self._listen.rpartition(":") if ":" in self._listen else (self._listen, "", "0")
            return host.strip("[]"), int(port or 0)
        parsed = urllib.parse.urlparse(self._store.url)
        if parsed.scheme == "tcp" and parsed.hostname:
            return local_address_towards(parsed.hostname, parsed.port or 1), 0
        return "127.0.0.1", 0

    async def _claim_name(self) -> None:
        data = await self._store.aget(_PEER_PREFIX + self.name)
        if data is None:
            return
        try:
            old = PeerRecord.decode(self._auth.open_record(data, self.name))
        except TransportError:
            return  # unreadable or foreign leftovers: overwrite
        if old.host == self._host and process_alive(old.pid, old.pid_start) and old.pid != self._pid:
            raise RegistrationError(f"name {self.name!r} is in use by a live process (pid {old.pid}) in {self._store.url}")
        if old.host != self._host:
            log.warning("transport %s: replacing the record of %s on host %s (assumed restarted)",
                        self.name, old.name, old.host.hostname)

    # -- regions ------------------------------------------------------------------------------

    def _publish(self) -> None:
        self._seq += 1
        regions = {}
        for key, region in self._regions.items():
            descs = {}
            for b in self._backends:
                d = b.region_descriptor(region)
                if d is not None:
                    descs[b.name] = d
            regions[key] = region.record(descs)
        record = PeerRecord(
            name=self.name,
            incarnation=self.incarnation,
            seq=self._seq,
            pid=self._pid,
            pid_start=self._pid_start,
            host=self._host,
            agent=self._agent.address,
            backends={b.name: b.endpoint_descriptor() for b in self._backends},
            regions=regions,
        )
        self._store.set(_PEER_PREFIX + self.name, self._auth.sign_record(record.encode()))
        for b in self._backends:
            b.published(self._seq)

    def _new_region(self, key: str, tensor: torch.Tensor, writable: bool) -> Region:
        if not isinstance(key, str) or not key:
            raise RegistrationError(f"region key must be a non-empty string, got {key!r}")
        if key in self._regions:
            raise RegistrationError(f"{self.name}: key {key!r} is already registered; unregister it first")
        check_tensor(tensor, f"tensor for {key!r}")
        kind = memory_kind(tensor, f"tensor for {key!r}")
        if not tensor.is_contiguous():
            raise RegistrationError(f"{key!r}: only contiguous tensors can be registered (call .contiguous() first)")
        if kind == MemoryKind.CUDA:
            if (why := _cuda.unavailable_reason()) is not None:
                raise BackendUnavailableError(f"cannot register the {tensor.device} tensor {key!r}: {why}")
            if not any(MemoryKind.CUDA in b.memory_kinds for b in self._backends):
                raise BackendUnavailableError(f"cannot register the {tensor.device} tensor {key!r}: none of {self.backends} serves device memory (ipc and nccl do)")
            return Region(key, tensor, bool(writable), device=_cuda.device_label(tensor.device.index))
        shared = None
        for buf in self._shared:
            if buf.address <= tensor.data_ptr() and tensor.data_ptr() + nbytes_of(tensor) <= buf.address + buf.nbytes:
                shared = buf
        return Region(key, tensor, bool(writable), shared)

    def _add(self, region: Region) -> None:
        self._regions[region.key] = region
        self._by_memory.setdefault((region.address, region.nbytes, region.dtype), region.key)

    def register(self, key: str, tensor: torch.Tensor, *, writable: bool = True) -> Region:
        """Exposes ``tensor`` to peers' ``put``/``get`` under ``key``.

        Args:
            key: name peers use for this region; unique within this Transport.
            tensor: a contiguous CPU or CUDA tensor (any caching-allocator tensor, slices
                included; not expandable-segments memory). The Transport keeps a reference to
                it until ``unregister``; do not free or resize its storage meanwhile.
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

    def register_many(self, tensors: Mapping[str, torch.Tensor], *, prefix: str = "", writable: bool = True) -> dict[str, Region]:
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
        new = {}
        for k, t in tensors.items():
            key = prefix + k
            if key in new:
                raise RegistrationError(f"key {key!r} appears twice")
            new[key] = self._new_region(key, t, writable)
        for region in new.values():
            self._add(region)
        self._publish()
        return new

    def unregister(self, key: str) -> None:
        """Withdraws ``key``; peers' later transfers to it fail with RegistrationError.

        Raises:
            ClosedError: the Transport is not open.
            RegistrationError: ``key`` is not registered.
        """
        self._check_open()
        region = self._regions.pop(key, None)
        if region is None:
            raise RegistrationError(f"{self.name}: no region {key!r} to unregister")
        mem = (region.address, region.nbytes, region.dtype)
        if self._by_memory.get(mem) == key:
            del self._by_memory[mem]
        if region.shared is not None and all(r.shared is not region.shared for r in self._regions.values()):
            # The memory itself lives as long as the tensors over it; we only stop tracking it.
            self._shared = [b for b in self._shared if b is not region.shared]
        self._publish()

    def empty(self, key: str, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32, *, writable: bool = True) -> torch.Tensor:
        """Allocates a zeroed, shareable, pre-faulted host tensor and registers it under ``key``.

        Same-host peers map this memory directly (no ptrace permission needed), which is the
        fastest ``ipc`` path. The memory lives as long as the returned tensor (or views of it).

        Returns:
            The new tensor.

        Raises:
            As :meth:`register`; RegistrationError if the allocation fails.
        """
        self._check_open()
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        itemsize = dtype.itemsize
        numel = 1
        for s in shape:
            numel *= int(s)
        try:
            buf = load().SharedBuffer(numel * itemsize, f"transport:{self.name}:{key}")
        except RuntimeError as exc:
            raise RegistrationError(f"cannot allocate {numel * itemsize} shareable bytes for {key!r}: {exc}") from exc
        tensor = torch.from_dlpack(buf.array()).view(dtype).view(shape)
        self._shared.append(buf)
        self.register(key, tensor, writable=writable)
        return tensor

    @property
    def regions(self) -> Mapping[str, Region]:
        """The regions registered here, by key (read-only view)."""
        return dict(self._regions)

    # -- transfers ----------------------------------------------------------------------------

    def put(self, src: torch.Tensor, peer: str | Peer, key: str | None = None, offset: int = 0, *, timeout: float | None = None) -> Transfer:
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
            ClosedError, PeerNotFoundError, RegistrationError (no such key; ``src`` not
            registered and no key given), ReadOnlyRegionError, DTypeMismatchError, BoundsError,
            BackendUnavailableError. While moving: PeerLostError, TransferTimeoutError,
            TransferAbortedError (see :class:`Transfer` for cancellation).
        """
        self._check_open()
        src = check_tensor(src, "src")
        if key is None:
            key = self._by_memory.get((src.data_ptr(), nbytes_of(src), src.dtype))
            if key is None:
                raise RegistrationError("src is not registered here; pass key= to name the remote region")
        kind = memory_kind(src, "src")
        staged = src if src.is_contiguous() else src.contiguous()
        return self._start(TransferOp.PUT, staged, kind, peer, key, offset, timeout)

    def get(self, dst: torch.Tensor, peer: str | Peer, key: str | None = None, offset: int = 0, *, timeout: float | None = None) -> Transfer:
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
        self._check_open()
        dst = check_tensor(dst, "dst")
        if not dst.is_contiguous():
            raise LayoutError("dst must be contiguous for get (the bytes land in place)")
        if key is None:
            key = self._by_memory.get((dst.data_ptr(), nbytes_of(dst), dst.dtype))
            if key is None:
                raise RegistrationError("dst is not registered here; pass key= to name the remote region")
        return self._start(TransferOp.GET, dst, memory_kind(dst, "dst"), peer, key, offset, timeout)

    def _start(self, op: TransferOp, tensor: torch.Tensor, kind: MemoryKind, peer: str | Peer, key: str, offset: int, timeout: float | None) -> Transfer:
        name = peer.name if isinstance(peer, Peer) else peer
        if not isinstance(name, str) or not name:
            raise PeerNotFoundError(f"peer must be a name or a Peer, got {peer!r}")
        if not isinstance(offset, int) or isinstance(offset, bool):
            raise TypeError(f"offset must be an int, got {type(offset).__name__}")
        # CUDA: the transfer must see the work the caller queued so far, and only that.
        local = LocalBuffer(tensor, kind, ready=_cuda.ready_event(tensor) if kind == MemoryKind.CUDA else None)
        xfer = Transfer(op, name, key, nbytes_of(tensor), offset)
        xfer._rec = self._flight.start(op.value, name, key, xfer.nbytes)
        self._inflight.setdefault(name, set()).add(xfer)
        self._tg.start_soon(self._run, xfer, local, self.timeout if timeout is None else timeout)
        return xfer

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

    async def fence(self, peer: str | Peer, *, timeout: float | None = None) -> None:
        """Waits until every put/get to ``peer`` started before this call has ended.

        Raises:
            TransferTimeoutError: they did not all end within the timeout.
            TransportError: the first error among them (the others still ended).
            ClosedError: the Transport is closed.

        Cancellation: safe; the transfers themselves keep running.
        """
        self._check_open()
        name = peer.name if isinstance(peer, Peer) else peer
        pending = list(self._inflight.get(name, ()))
        timeout = self.timeout if timeout is None else timeout
        with anyio.move_on_after(timeout):
            for x in pending:
                await x._event.wait()
        unfinished = [x for x in pending if not x.done()]
        if unfinished:
            raise TransferTimeoutError(f"fence({name}): {len(unfinished)} of {len(pending)} transfers still running after {timeout:g}s")
        for x in pending:
            if x.exception() is not None:
                raise x.exception()  # type: ignore[misc]

    async def signal(self, peer: str | Peer, name: str, value: int, *, timeout: float | None = None) -> None:
        """Sets the peer's signal ``name`` to ``value``, ordered after every earlier put to it.

        The peer sees the new value (``wait_signal``) only after all bytes of earlier
        transfers to it are in its memory: this first fences, then rings the doorbell.

        Raises:
            As :meth:`fence` (an earlier transfer failed: no signal is sent), PeerNotFoundError,
            PeerLostError, TransferTimeoutError.

        Cancellation: the signal may or may not have been delivered.
        """
        self._check_open()
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"signal value must be an int, got {type(value).__name__}")
        peer_name = peer.name if isinstance(peer, Peer) else peer
        timeout = self.timeout if timeout is None else timeout
        rec = self._flight.start("signal", peer_name, name, 8)
        try:
            with anyio.fail_after(timeout):
                await self.fence(peer_name, timeout=timeout)
                record = await self._resolve(peer_name)
                chan = await self._control.get(record.name, record.incarnation, record.agent)
                self._flight.transition(rec, OpState.MOVING, backend="control")
                await chan.request(FrameKind.SIGNAL, {"name": name, "value": value})
        except TimeoutError:
            err = TransferTimeoutError(f"signal {name!r}={value} to {peer_name} not delivered within {timeout:g}s")
            self._flight.transition(rec, OpState.ABORTED, error=err)
            self._flight.dump(f"timeout: {err}", force=False)
            raise err from None
        except BaseException as exc:
            self._flight.transition(rec, OpState.FAILED if isinstance(exc, TransportError) else OpState.ABORTED, error=exc)
            raise
        self._flight.transition(rec, OpState.DONE)

    def _wake_signal_waiters(self) -> None:
        event, self._signal_event = self._signal_event, anyio.Event()
        event.set()

    def on_signal(self, name: str, value: int) -> None:  # AgentHandler
        self._signals[name] = value
        self._wake_signal_waiters()

    def signal_value(self, name: str) -> int | None:
        """The last value a peer set for signal ``name`` here, or None."""
        return self._signals.get(name)

    async def wait_signal(self, name: str, at_least: int = 1, *, timeout: float | None = None) -> int:
        """Waits, locally, until signal ``name`` is at least ``at_least``; returns its value.

        Raises:
            TransferTimeoutError: not reached within the timeout.
            ClosedError: the Transport closed meanwhile.
        """
        self._check_open()
        timeout = self.timeout if timeout is None else timeout
        with anyio.move_on_after(timeout):
            while True:
                self._check_open()
                value = self._signals.get(name)
                if value is not None and value >= at_least:
                    return value
                await self._signal_event.wait()
        raise TransferTimeoutError(
            f"{self.name}: signal {name!r} did not reach {at_least} within {timeout:g}s (now {self._signals.get(name)})"
        )

    # -- agent side (AgentHandler) ------------------------------------------------------------

    def check_region(self, op: FrameKind, meta: Mapping[str, Any], nbytes: int) -> Region:
        """The registered region a remote PUT/GET of ``nbytes`` at ``meta["offset"]`` may touch
        (key, dtype, bounds and writability checked); raises TransportError if none."""
        key, dtype, offset = meta.get("key"), meta.get("dtype"), meta.get("offset")
        region = self._regions.get(key) if isinstance(key, str) else None
        if region is None:
            raise RegistrationError(f"{self.name} has no region {key!r}")
        if dtype != dtype_name(region.dtype):
            raise DTypeMismatchError(f"{self.name}:{key!r} is {dtype_name(region.dtype)}, not {dtype}")
        if not isinstance(offset, int) or offset < 0 or nbytes < 0 or offset + nbytes > region.nbytes:
            raise BoundsError(f"{self.name}:{key!r}: {nbytes} bytes at {offset} exceed its {region.nbytes} bytes")
        if op == FrameKind.PUT and not region.writable:
            raise ReadOnlyRegionError(f"{self.name}:{key!r} is read-only")
        return region

    def check_access(self, op: FrameKind, meta: Mapping[str, Any], nbytes: int) -> memoryview:  # AgentHandler
        region = self.check_region(op, meta, nbytes)
        if region.view is None:
            raise BackendUnavailableError(f"{self.name}:{region.key!r} is device memory; the agent's byte stream cannot reach it")
        offset = meta["offset"]
        return region.view[offset : offset + nbytes]

    async def backend_request(self, meta: Mapping[str, Any]) -> Mapping[str, Any]:  # AgentHandler
        name = meta.get("backend")
        for b in self._backends:
            if b.name == name:
                return await b.serve_request(meta, self.check_region)
        raise BackendUnavailableError(f"{self.name} does not run backend {name!r} (it runs {', '.join(self.backends)})")

    def __repr__(self) -> str:
        return f"<Transport {self.name!r} {self._state} backends={self.backends if self._state == 'open' else '-'}>"
