"""The transfer engine: every put and get from start to settled outcome.

It owns the in-flight table. For one transfer it resolves the peer's record, checks the range
against it (:func:`transport._regions.check`), chooses a backend, moves the bytes (through a
bounce buffer when the backend does not serve the tensor's memory) and settles the outcome in
the handle and the flight recorder. A backend that sees its peer die reports it here, and the
engine tells the peer directory, which tells everyone.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import torch
from anyio.abc import TaskGroup

from . import _cuda
from ._batch import Bound, PreparedTransfer, Runs, Segment
from ._errors import (
    BackendUnavailableError,
    BoundsError,
    ClosedError,
    DTypeMismatchError,
    PeerLostError,
    RegistrationError,
    TransferAbortedError,
    TransferTimeoutError,
    TransportError,
    TransportInternalError,
)
from ._flight import FlightRecorder, OpState
from ._peers import PeerDirectory
from ._regions import check
from ._staging import bounce, staging_kind
from ._tensors import MemoryKind, dtype_from_name, dtype_name, nbytes_of
from ._timeouts import seconds
from ._transfer import Transfer
from ._wire import PeerRecord, RegionRecord, TransferOp
from .backends import Backend, LocalBuffer, RemoteTarget
from .backends._base import Mover, Pending
from .backends._control import WITHDRAWN_SEQ

log = logging.getLogger(__name__)

# Host transfers up to this size are moved synchronously inside put()/get() when the backend
# has a synchronous path (``Backend.mover``; each may decline by size) and the route is known:
# for ipc a memcpy into the peer's mapped memory, or one process_vm_writev. Larger ones go to
# the native threads. The hand-off to them and back costs ~300 us here (two thread wake-ups on
# a VM): with a cap of 1 MiB, ipc put 2 MiB at 5.4 GB/s, 1 MiB at 22; with 8 MiB, 2-8 MiB at 28.
# The event loop is held for the copy: at most ~0.5 ms (8 MiB at memory speed).
SYNC_MAX_BYTES = 8 << 20
_SYNC_ROUTES_MAX = 4096  # cached (peer, key, op) routes; the cache is reset past this


@dataclass(frozen=True)
class _BatchPlan:
    """How one prepared transfer moves to one record of its peer (see ``TransferEngine._plan``)."""

    backends: str  # the backends' names, "a,b" for two
    # each backend's reusable runner, and whether it takes the start's CUDA ready events
    runs: list[tuple[Callable[..., Awaitable[None]], bool]]
    per_start: list[tuple[Backend, Segment, RegionRecord]]  # moved one by one at every start
    one_sided: bool  # every backend of it moves bytes without the peer's process


class _SyncRoute:
    """What a synchronous transfer to one region needs, valid for one record of its peer: the
    region's facts for the per-transfer check (the rest of :func:`transport._regions.check`,
    existence, writability and whether it moved, was settled when the route was made)."""

    __slots__ = ("backend", "dtype", "itemsize", "limit", "move", "record")

    def __init__(self, record: PeerRecord, region: RegionRecord | None, backend: Backend | None,
                 move: Mover | None) -> None:
        self.record = record
        self.backend = backend
        self.move = move
        self.dtype: torch.dtype | None = None
        self.itemsize = self.limit = 0
        if region is not None and move is not None:
            self.dtype = dtype_from_name(region.dtype)
            self.itemsize = self.dtype.itemsize
            self.limit = region.nbytes

_Checked = TypeVar("_Checked")


class TransferEngine:
    """Starts, runs and settles transfers for one Transport.

    Args:
        name: the Transport's name (for messages).
        tg: the task group transfers run in.
        directory: peer records and liveness.
        backends: the backends in preference order.
        flight: the flight recorder.
        cuda: the Transport's CUDA copier, made on first use (pinned staging).
    """

    def __init__(self, name: str, tg: TaskGroup, directory: PeerDirectory, backends: Sequence[Backend],
                 flight: FlightRecorder, cuda: Callable[[], _cuda.CudaCopier], timeout: float) -> None:
        self.name = name
        self.timeout = timeout  # a prepared transfer's default
        self.state = "open"  # "draining" / "closed": prepared transfers refuse to start (ClosedError)
        # Each prepared transfer's plan for one record of its peer (its backends' native lists),
        # owned here: made at its first start on that record, dropped with the transfer.
        self._plans: weakref.WeakKeyDictionary[PreparedTransfer, tuple[tuple[object, ...], _BatchPlan]] = (
            weakref.WeakKeyDictionary())
        self._tg = tg
        self._directory = directory
        self._backends = tuple(backends)
        self._flight = flight
        self._cuda = cuda
        self._inflight: dict[str, set[Transfer]] = {}
        self._ranges: dict[tuple[str, str], _Ranges] = {}  # (peer, key) -> transfers in flight to it
        self._fallbacks_logged: set[tuple[str, str]] = set()
        self._sync: dict[tuple[str, str, TransferOp], _SyncRoute] = {}
        self._closing = False  # the Transport is closing: what ends now ends with ClosedError
        directory.subscribe(lost=self.abort_peer, forget=self._forget_routes, current=self._current,
                            withdrawn=self._withdrawn)

    # -- starting -------------------------------------------------------------------------

    def start(self, op: TransferOp, tensor: torch.Tensor, kind: MemoryKind, peer: str, key: str, offset: int,
              timeout: float) -> Transfer:
        """Starts one transfer in the background and returns its handle (see ``Transport.put``).

        A transfer that overlaps the bytes of an earlier one still in flight to the same region
        (where either writes) starts moving only once that one has ended: from one Transport,
        the later put wins. Non-overlapping transfers run concurrently.

        A small host transfer on a known route with nothing in flight to its region completes
        here, synchronously (see :meth:`_now`); the handle returned is then already done.
        """
        if kind is MemoryKind.CPU and (peer, key) not in self._ranges:
            done = self._now(op, tensor, peer, key, offset, timeout)
            if done is not None:
                return done
        # CUDA: the transfer must see the work the caller queued so far, and only that.
        local = LocalBuffer(tensor, kind, ready=_cuda.ready_event(tensor) if kind == MemoryKind.CUDA else None)
        return self._launch(op, local, peer, key, offset, timeout)

    def _launch(self, op: TransferOp, local: LocalBuffer, peer: str, key: str, offset: int, timeout: float,
                pending: tuple[PeerRecord, Backend, Pending] | None = None) -> Transfer:
        """Runs one transfer in the background: checked and moved (``_execute``), or, with
        ``pending``, the completion of a synchronous attempt that went out (``_execute_pending``)."""
        xfer = Transfer(op, peer, key, nbytes_of(local.tensor), offset)
        if pending is not None:  # its request is out: the bytes may land whatever happens next
            xfer._moving, xfer._incarnation = True, pending[0].incarnation
        after = self._ranges.setdefault((peer, key), _Ranges()).add(xfer, offset, offset + xfer.nbytes)
        xfer._rec = self._flight.start(op.value, peer, key, xfer.nbytes)
        self._inflight.setdefault(peer, set()).add(xfer)
        work = (functools.partial(self._execute, xfer, local, after) if pending is None
                else functools.partial(self._execute_pending, xfer, local, *pending))
        self._tg.start_soon(self._run, xfer, work, timeout)
        return xfer

    def start_prepared(self, prepared: PreparedTransfer, timeout: float | None) -> Transfer:
        """See ``PreparedTransfer.start``. One host segment takes the path a put of it would
        (completed here when it can be, see :meth:`start`): a prepared transfer is never slower
        than the plain transfer of the same bytes.

        Raises:
            ClosedError: the Transport is draining or closed. ValueError: a bad timeout.
        """
        if self.state != "open":
            raise ClosedError(f"transport {self.name!r} is {self.state}")
        limit = self.timeout if timeout is None else seconds(timeout, "timeout")
        segs = prepared.single()
        if segs is not None and segs.kind is MemoryKind.CPU:
            return self.start(prepared.op, segs.tensor, segs.kind, prepared.peer, segs.key, segs.offset, limit)
        return self.start_batch(prepared, limit)

    def start_batch(self, prepared: PreparedTransfer, timeout: float) -> Transfer:
        """Starts every segment of ``prepared`` as one transfer (see ``PreparedTransfer.start``).
        For ordering it counts as one transfer over the span it covers in each region."""
        spans = prepared.spans()  # empty when every item is empty
        keys = sorted(spans) or [prepared.first_key]
        label = keys[0] if len(keys) == 1 else f"{keys[0]} (+{len(keys) - 1} regions)"
        first = spans[keys[0]][0] if spans else 0
        xfer = Transfer(prepared.op, prepared.peer, label, prepared.nbytes, first)
        xfer.segments = prepared.segments
        after: list[Transfer] = []
        for key, (lo, hi) in spans.items():
            after += self._ranges.setdefault((prepared.peer, key), _Ranges()).add(xfer, lo, hi)
        xfer._rec = self._flight.start(prepared.op.value, prepared.peer, label, xfer.nbytes)
        self._inflight.setdefault(prepared.peer, set()).add(xfer)
        # CUDA segments see the work queued on their device's current stream now, at start().
        ready = {d: _cuda.ready_event(t) for d, t in prepared.cuda_anchors.items()}
        self._tg.start_soon(self._run, xfer, functools.partial(self._execute_batch, xfer, prepared, after, ready),
                            timeout, tuple(spans))
        return xfer

    def _now(self, op: TransferOp, tensor: torch.Tensor, peer: str, key: str, offset: int,
             timeout: float) -> Transfer | None:
        """Moves a small host transfer right here, when everything it needs is at hand: the
        peer's record (adopted, current by the backend's cheap view of it, not lost, its process
        alive), the checks pass, and the backend's synchronous path (``Backend.mover``) takes it.
        Returns the completed handle; a running one when the backend's request went out but its
        completion is still to come; or None: then the transfer takes the asynchronous path,
        which also reports any error precisely. Nothing is moved before every check passed."""
        nbytes = nbytes_of(tensor)
        if nbytes > SYNC_MAX_BYTES:
            return None
        record = self._directory.known(peer)
        if record is None:
            return None
        route = self._sync.get((peer, key, op))
        if route is None or route.record is not record:
            route = self._sync_route(op, record, key)
        move, backend = route.move, route.backend
        if move is None or backend is None:
            return None
        # As check() would (type(offset) is int: put/get made it one); a refusal is reported
        # by the asynchronous path.
        if tensor.dtype is not route.dtype or offset < 0 or offset + nbytes > route.limit or offset % route.itemsize:
            return None
        seq = backend.live_seq(record)
        if (seq is not None and seq != record.seq) or self._directory.is_lost(record) or self._directory.stale(record):
            return None
        started, t0 = time.time(), time.monotonic()
        moved = move(tensor.data_ptr(), offset, nbytes) if nbytes else True
        if moved is False:
            return None
        if moved is not True:  # went out; its completion comes later
            return self._launch(op, LocalBuffer(tensor, MemoryKind.CPU), peer, key, offset, timeout,
                                (record, backend, moved))
        self._flight.completed(op.value, peer, key, nbytes, backend.name, started)
        return Transfer._completed(op, peer, key, nbytes, offset, backend.name, backend.one_sided, t0)

    def _sync_route(self, op: TransferOp, record: PeerRecord, key: str) -> _SyncRoute:
        region = record.regions.get(key)
        backend = move = None
        if region is not None and not region.moved and (op == TransferOp.GET or region.writable):
            try:
                backend = self.choose(record, region, MemoryKind.CPU)
            except BackendUnavailableError:
                pass
            else:
                move = backend.mover(op, record, region)
        if len(self._sync) >= _SYNC_ROUTES_MAX:
            self._sync.clear()
        route = self._sync[(record.name, key, op)] = _SyncRoute(record, region, backend, move)
        return route

    def _current(self, record: PeerRecord) -> bool:
        """Whether a backend sees, cheaply, that ``record`` is still its peer's latest."""
        return any(b.live_seq(record) == record.seq for b in self._backends)

    def _withdrawn(self, record: PeerRecord) -> bool:
        """Whether a backend sees, cheaply, that ``record``'s Transport has closed."""
        return any(b.live_seq(record) == WITHDRAWN_SEQ for b in self._backends)

    def _forget_routes(self, peer: str) -> None:
        """Drops the synchronous routes to ``peer`` (it restarted or was lost): what they hold,
        e.g. a mapping of its memory, goes with them."""
        for k in [k for k in self._sync if k[0] == peer]:
            del self._sync[k]
        self._fallbacks_logged = {k for k in self._fallbacks_logged if k[0] != peer}

    async def fence(self, peer: str, timeout: float) -> None:
        """Waits until every transfer to ``peer`` started before this call has ended.

        Raises:
            TransferTimeoutError: they did not all end within ``timeout``.
            TransportError: the first error among them (the others still ended).
        """
        pending = list(self._inflight.get(peer, ()))
        unfinished = await _ended_within(pending, timeout)
        if unfinished:
            raise TransferTimeoutError(
                f"fence({peer}): {len(unfinished)} of {len(pending)} transfers still running after {timeout:g}s"
            )
        for x in pending:
            err = x.exception()
            if err is not None:
                raise err

    async def drain(self, timeout: float) -> int:
        """Waits up to ``timeout`` for every transfer in flight to end; returns how many are
        still running then. Cancellation: stops waiting; nothing is aborted here."""
        left = len(await _ended_within([x for xs in self._inflight.values() for x in xs], timeout))
        if left:
            log.warning("transport %s: %d transfers still running after draining for %gs; aborting them",
                        self.name, left, timeout)
        return left

    def closing(self) -> None:
        """The Transport is closing: transfers that end from now on, whatever broke under them
        (a connection or an engine we close), end with ClosedError, and no peer is declared lost
        for it."""
        self._closing = True
        self.state = "closed"

    def abort_peer(self, name: str, incarnation: str, why: BaseException, excluded: bool) -> None:
        """Aborts the transfers in flight to one incarnation of ``name`` (it was lost or excluded)."""
        for xfer in list(self._inflight.get(name, ())):
            if xfer._incarnation in (None, incarnation) and not xfer.done():
                what = f"{xfer.op.value} of {xfer.nbytes} bytes to {name}:{xfer.key!r}"
                if excluded:
                    xfer._abort_error = TransferAbortedError(f"{what} aborted: {name} was excluded",
                                                             partial=xfer._moving)
                else:
                    xfer._abort_error = PeerLostError(f"{what} aborted: {why}")
                    xfer._abort_error.__cause__ = why
                if xfer._scope is not None:
                    xfer._scope.cancel()
                else:
                    xfer.cancel()

    # -- choosing -------------------------------------------------------------------------

    def _check_remote(self, record: PeerRecord, xfer: Transfer, dtype: torch.dtype) -> RegionRecord:
        region = record.regions.get(xfer.key)
        check(xfer.op, record.name, xfer.key, region, dtype_name(dtype), xfer.offset, xfer.nbytes,
              known=record.regions.keys())
        assert region is not None
        return region

    def choose(self, record: PeerRecord, region: RegionRecord, kind: MemoryKind) -> Backend:
        """The first backend that can move bytes between ``kind`` memory here and ``region``.
        A host-memory backend serves local CUDA tensors through pinned staging, a device-memory
        backend (nccl) local host tensors through a device buffer.

        Raises:
            BackendUnavailableError: none can, with every backend's reason.
        """
        reasons = []
        for b in self._backends:
            # The memory it would touch here: the tensor itself, or a staging copy of it.
            touch = kind if kind in b.memory_kinds else staging_kind(kind)
            if b.name not in record.backends:
                reasons.append(f"{b.name}: {record.name} does not speak it")
            elif touch not in b.memory_kinds:
                reasons.append(f"{b.name}: does not serve {kind.value} memory")
            elif touch != kind and touch == MemoryKind.CUDA and (why := _cuda.unavailable_reason()) is not None:
                reasons.append(f"{b.name}: serves {kind.value} memory through a GPU buffer, but {why}")
            elif (why := b.unreachable_reason(record, region, touch)) is not None:
                reasons.append(f"{b.name}: {why}")
            else:
                if reasons and (record.name, b.name) not in self._fallbacks_logged:
                    self._fallbacks_logged.add((record.name, b.name))
                    log.warning("transport %s: using %s for %s because %s", self.name, b.name, record.name,
                                "; ".join(reasons))
                return b
        ours = ", ".join(b.name for b in self._backends) or "nothing"
        theirs = ", ".join(record.backends) or "nothing"
        raise BackendUnavailableError(
            f"no backend can reach {record.name}:{region.key!r} from {kind.value} memory "
            f"(we speak {ours}; it speaks {theirs}): " + "; ".join(reasons)
        )

    # -- moving ---------------------------------------------------------------------------

    async def _checked(self, xfer: Transfer, after: Sequence[Transfer],
                       check: Callable[[PeerRecord], _Checked]) -> tuple[PeerRecord, _Checked]:
        """Waits for the overlapping transfers started before ``xfer`` to end (they land
        first), then returns the peer's record and what ``check(record)`` made of it. The record
        is refreshed first when a backend sees that the peer republished, and once more when the
        check refuses, since our copy may predate a (re-)registration.

        Raises:
            What ``check`` raises against the current record; as ``PeerDirectory.resolve``.
        """
        for earlier in after:
            await earlier._ended()
        record = await self._directory.resolve(xfer.peer)
        if any((seq := b.live_seq(record)) is not None and seq != record.seq for b in self._backends):
            record = await self._directory.resolve(xfer.peer, refresh=True)
        try:
            return record, check(record)
        except (RegistrationError, DTypeMismatchError, BoundsError):
            record = await self._directory.resolve(xfer.peer, refresh=True)
            return record, check(record)

    def _begin(self, xfer: Transfer, record: PeerRecord, backend: str) -> None:
        if self._directory.stale(record):
            raise PeerLostError(f"{record.name} (pid {record.pid}) has exited")
        xfer._moving = True
        xfer._incarnation = record.incarnation
        self._flight.transition(xfer._rec, OpState.MOVING, backend=backend)

    async def _execute(self, xfer: Transfer, local: LocalBuffer, after: Sequence[Transfer]) -> None:
        record, region = await self._checked(xfer, after,
                                             lambda r: self._check_remote(r, xfer, local.tensor.dtype))
        backend = self.choose(record, region, local.kind)
        xfer.backend, xfer.one_sided = backend.name, backend.one_sided
        self._begin(xfer, record, backend.name)
        if xfer.nbytes == 0:
            return
        await self._move(backend, xfer.op, local, RemoteTarget(record, region, xfer.offset, xfer.nbytes))

    async def _execute_pending(self, xfer: Transfer, local: LocalBuffer, record: PeerRecord, backend: Backend,
                               pending: Pending) -> None:
        """Completes a synchronous attempt whose request went out (see :meth:`_now`); when it
        comes back refused or broken, moves the bytes again by the checked path."""
        xfer.backend, xfer.one_sided = backend.name, backend.one_sided
        self._begin(xfer, record, backend.name)
        if not await pending():
            await self._execute(xfer, local, ())

    async def _execute_batch(self, xfer: Transfer, prepared: PreparedTransfer, after: Sequence[Transfer],
                             ready: Mapping[int, Any]) -> None:
        """``ready``: the events recorded at start() on each CUDA device's current stream."""
        record, plan = await self._checked(xfer, after, lambda r: self._plan_for(prepared, r))
        xfer.backend, xfer.one_sided = plan.backends, plan.one_sided
        self._begin(xfer, record, plan.backends)
        for run, takes_ready in plan.runs:
            await (run(ready) if takes_ready else run())
        for backend, seg, region in plan.per_start:
            event = ready[seg.tensor.device.index] if seg.kind == MemoryKind.CUDA else None
            await self._move(backend, xfer.op, LocalBuffer(seg.tensor, seg.kind, ready=event),
                             RemoteTarget(record, region, seg.offset, seg.nbytes))

    def _plan_for(self, prepared: PreparedTransfer, record: PeerRecord) -> _BatchPlan:
        """``prepared``'s plan for ``record``, kept while the peer's incarnation and record and
        the local memory stay the same (built at the first start on them).

        Raises:
            As ``PreparedTransfer.bind``; BackendUnavailableError.
        """
        bound = prepared.bind(record)
        ident = (record.incarnation, record.seq, *prepared.memory())
        cached = self._plans.get(prepared)
        if cached is not None and cached[0] == ident:
            return cached[1]
        if prepared.runs is not None:
            plan = self._plan_runs(prepared.op, record, bound[0].region, prepared.runs)
        else:
            plan = self._plan(prepared.op, record, bound)
        self._plans[prepared] = (ident, plan)
        return plan

    def _plan_runs(self, op: TransferOp, record: PeerRecord, region: RegionRecord, runs: Runs) -> _BatchPlan:
        """A prepared array of runs: one backend's runner over the array as it is
        (``Backend.prepare_runs``); memory the backend cannot serve directly goes run by run
        through staging at every start."""
        backend = self.choose(record, region, runs.kind)
        if runs.kind in backend.memory_kinds and (runs.kind == MemoryKind.CPU or backend.prepares_device):
            runner = backend.prepare_runs(op, LocalBuffer(runs.tensor, runs.kind),
                                          RemoteTarget(record, region, 0, region.nbytes), runs.array)
            return _BatchPlan(backend.name, [(runner, backend.prepares_device)], [], backend.one_sided)
        flat = runs.tensor.view(-1).view(torch.uint8)
        per_start = [(backend, Segment(flat[a : a + n], runs.kind, runs.key, b, n), region)
                     for a, b, n in runs.array.tolist()]
        return _BatchPlan(backend.name, [], per_start, backend.one_sided)

    def _plan(self, op: TransferOp, record: PeerRecord, bound: Sequence[Bound]) -> _BatchPlan:
        """How a prepared transfer's checked segments move: a backend per (region, memory
        kind), and each backend's reusable runner (``Backend.prepare_many``) for the segments
        it serves directly (CUDA ones only where it ``prepares_device``); other CUDA segments
        (their ready event is taken at each start) and staged ones go one by one.

        Raises:
            BackendUnavailableError: no backend reaches one of the regions.
        """
        groups: dict[str, tuple[Backend, list[tuple[LocalBuffer, RemoteTarget]]]] = {}
        chosen: dict[tuple[str, MemoryKind], Backend] = {}
        per_start: list[tuple[Backend, Segment, RegionRecord]] = []
        for b in bound:
            seg = b.segment
            backend = chosen.get((seg.key, seg.kind))
            if backend is None:
                backend = chosen[(seg.key, seg.kind)] = self.choose(record, b.region, seg.kind)
            group = groups.setdefault(backend.name, (backend, []))
            if seg.kind in backend.memory_kinds and (seg.kind == MemoryKind.CPU or backend.prepares_device):
                group[1].append((LocalBuffer(seg.tensor, seg.kind), RemoteTarget(record, b.region, seg.offset,
                                                                                  seg.nbytes)))
            else:
                per_start.append((backend, seg, b.region))
        runs = [(backend.prepare_many(op, pairs), backend.prepares_device)
                for backend, pairs in groups.values() if pairs]
        return _BatchPlan(",".join(groups), runs, per_start, all(b.one_sided for b, _ in groups.values()))

    async def _move(self, backend: Backend, op: TransferOp, local: LocalBuffer, remote: RemoteTarget) -> None:
        """Moves one range with ``backend``, through a bounce buffer when it does not serve the
        local tensor's memory."""
        if local.kind in backend.memory_kinds:
            await backend.move(op, local, remote)
            return
        async with bounce(local, remote.nbytes, self._cuda) as b:
            for pos, size in b.pieces:
                part = RemoteTarget(remote.peer, remote.region, remote.offset + pos, size)
                if op == TransferOp.PUT:
                    await b.load(pos, size)
                    await backend.move(op, b.buffer(size), part)
                else:
                    await backend.move(op, b.buffer(size), part)
                    await b.store(pos, size)

    async def _run(self, xfer: Transfer, work: Callable[[], Awaitable[None]], timeout: float,
                   keys: Sequence[str] = ()) -> None:
        try:
            with anyio.CancelScope(deadline=anyio.current_time() + timeout) as scope:
                xfer._scope = scope
                if xfer._cancel_requested:
                    scope.cancel()
                    if not xfer._moving:  # (one already moving must still clean up, in work())
                        await anyio.lowlevel.checkpoint()  # deliver it before anything moves
                error: TransportError | None = None
                try:
                    await work()
                except TransportError as exc:
                    # An abort by the Transport (exclusion, loss) also breaks the backend's
                    # connection; the abort, not the broken connection, is what happened.
                    error = self._honest(xfer, xfer._abort_error or exc)
                except Exception as exc:
                    log.exception("transport %s: unexpected failure in %r", self.name, xfer)
                    error = TransportInternalError(f"{xfer!r} failed unexpectedly: {type(exc).__name__}: {exc}")
                    error.__cause__ = exc
                xfer._finish(error)
            if not xfer.done():  # our scope absorbed a cancellation: user cancel, deadline, peer loss
                what = f"{xfer.op.value} of {xfer.nbytes} bytes to {xfer.peer}:{xfer.key!r}"
                partial = xfer._moving
                if self._closing and not isinstance(xfer._abort_error, ClosedError):
                    xfer._finish(ClosedError(f"transport {self.name!r} closed while {xfer!r} was running"))
                elif xfer._abort_error is not None:
                    xfer._finish(xfer._abort_error)
                elif xfer._cancel_requested:
                    suffix = " after it started" if partial else ""
                    xfer._finish(TransferAbortedError(f"{what} was cancelled{suffix}", partial=partial))
                else:
                    late = f"{what} did not complete within {timeout:g}s (via {xfer.backend})"
                    if partial:
                        late += "; some bytes may have landed"
                    xfer._finish(TransferTimeoutError(late, partial=partial))
        finally:
            if not xfer.done():
                xfer._finish(ClosedError(f"transport {self.name!r} closed while {xfer!r} was running"))
            if (inflight := self._inflight.get(xfer.peer)) is not None:
                inflight.discard(xfer)
                if not inflight:
                    del self._inflight[xfer.peer]
            for key in keys or (xfer.key,):
                ranges = self._ranges.get((xfer.peer, key))
                if ranges is not None and ranges.remove(xfer):
                    del self._ranges[(xfer.peer, key)]
            self._settle(xfer)

    def _honest(self, xfer: Transfer, error: TransportError) -> TransportError:
        """What a transfer that failed with ``error`` reports: ClosedError while we close (not
        the broken connection that closing caused), and ``partial=True`` on a timeout or an
        abort once bytes started to move (a frame half sent may still land)."""
        if self._closing and not isinstance(error, ClosedError):
            closed = ClosedError(f"transport {self.name!r} closed while {xfer!r} was running")
            closed.__cause__ = error
            return closed
        if xfer._moving and isinstance(error, (TransferTimeoutError, TransferAbortedError)) and not error.partial:
            honest = type(error)(f"{error}; some bytes may have landed", partial=True)
            honest.__cause__ = error
            return honest
        return error

    def _settle(self, xfer: Transfer) -> None:
        err = xfer.exception()
        if err is None:
            state = OpState.DONE
        elif isinstance(err, (TransferAbortedError, TransferTimeoutError, ClosedError)):
            state = OpState.ABORTED
        else:
            state = OpState.FAILED
        self._flight.transition(xfer._rec, state, backend=xfer.backend, error=err)
        if isinstance(err, PeerLostError) and xfer._incarnation is not None:
            # A backend saw the peer die (e.g. ESRCH, connection reset): act on it for everyone.
            self._directory.declare_lost(xfer.peer, xfer._incarnation, err)
        elif isinstance(err, TransferTimeoutError):
            self._flight.dump(f"timeout: {err}", force=False)


async def _ended_within(transfers: Sequence[Transfer], timeout: float) -> list[Transfer]:
    """Waits up to ``timeout`` for ``transfers`` to end (observing only); returns those still
    running then."""
    with anyio.move_on_after(timeout):
        for x in transfers:
            await x._ended()
    return [x for x in transfers if not x.done()]


class _Ranges:
    """The transfers in flight to one region, in start order, for the ordering rule.

    Adding is O(1) in the common case of transfers that do not overlap the span of those in
    flight (e.g. a state dict pushed bucket by bucket); otherwise it scans them.
    """

    __slots__ = ("_hi", "_lo", "_xfers")

    def __init__(self) -> None:
        self._xfers: list[tuple[Transfer, int, int]] = []
        self._lo = self._hi = 0  # a span covering every range in flight (may be wider)

    def add(self, xfer: Transfer, start: int, end: int) -> list[Transfer]:
        """Adds ``xfer``, which covers bytes ``start``..``end`` here; returns the earlier
        transfers it must wait for (they overlap it, and one of the two writes)."""
        after: list[Transfer] = []
        if not self._xfers:
            self._lo, self._hi = start, end
        elif end <= self._lo or start >= self._hi or start == end:
            self._lo, self._hi = min(self._lo, start), max(self._hi, end)
        else:
            writes = xfer.op == TransferOp.PUT
            after = [x for x, lo, hi in self._xfers if (writes or x.op == TransferOp.PUT) and lo < end and start < hi]
            self._lo, self._hi = min(self._lo, start), max(self._hi, end)
        self._xfers.append((xfer, start, end))
        return after

    def remove(self, xfer: Transfer) -> bool:
        """Removes ``xfer``; True when nothing is left in flight."""
        for i, entry in enumerate(self._xfers):
            if entry[0] is xfer:
                del self._xfers[i]
                break
        return not self._xfers
