"""The transfer engine: every put and get from start to settled outcome.

It owns the in-flight table and each transfer's lifecycle. For one transfer it resolves the
peer's record, checks the range against it (:func:`transport._regions.check`), has the router
(:mod:`.routing`) choose a backend or build a prepared plan, waits for the overlapping
transfers before it (:mod:`.ordering`), moves the bytes (through a bounce buffer when
the backend does not serve the tensor's memory) and settles the outcome in the handle and the
flight recorder. A backend that sees its peer die reports it here, and the engine tells the
peer directory, which tells everyone.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import torch
from anyio.abc import TaskGroup

from .. import _cuda, _pieces
from .._cuda_copier import CudaCopier
from .._errors import (
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
from .._flight import FlightRecorder, OpState, current_op
from .._peers import PeerDirectory
from .._pieces import Ready
from .._regions import check
from .._staging import STAGED_INFLIGHT, bounce
from .._tensors import MemoryKind, Runs, dtype_name, nbytes_of
from .._timeouts import seconds
from .._wire import PeerRecord, RegionRecord, TransferOp
from ..backends import Backend, LocalBuffer, RemoteTarget
from ..backends._base import Pending
from .handle import Transfer
from .ordering import Ranges, ended_within
from .prepared import PreparedTransfer
from .routing import BatchPlan, Router
from .runs import RunList

log = logging.getLogger(__name__)

# Host transfers up to this size are moved synchronously inside put()/get() when the backend
# has a synchronous path (``Backend.mover``; each may decline by size) and the route is known:
# for ipc a memcpy into the peer's mapped memory, or one process_vm_writev. Larger ones go to
# the native threads. The hand-off to them and back costs ~300 us here (two thread wake-ups on
# a VM): with a cap of 1 MiB, ipc put 2 MiB at 5.4 GB/s, 1 MiB at 22; with 8 MiB, 2-8 MiB at 28.
# The event loop is held for the copy: at most ~0.5 ms (8 MiB at memory speed).
SYNC_MAX_BYTES = 8 << 20


_Checked = TypeVar("_Checked")


def _record_ready(tensors: Iterable[torch.Tensor]) -> dict[int, Any]:
    """A transfer's CUDA ready events, recorded now, inside the call that starts it: one per
    CUDA device among ``tensors``, on that device's current stream, so that the transfer sees
    the work its caller queued so far, and only that (host tensors: none). The one place
    they are recorded: everything below (staging, backends, their runners) waits for the events
    it is given and records none of its own."""
    ready: dict[int, Any] = {}
    for t in tensors:
        if t.is_cuda and t.get_device() not in ready:
            ready[t.get_device()] = _cuda.ready_event(t)
    return ready


def _ready_buffer(tensor: torch.Tensor, kind: MemoryKind) -> LocalBuffer:
    """The local side of a single transfer of ``tensor``, with its ready event (see
    :func:`_record_ready`) when it is CUDA memory."""
    return LocalBuffer(tensor, kind, ready=next(iter(_record_ready((tensor,)).values()), None))


@dataclass
class _Plan:
    """What the engine keeps for one prepared run list: its runs checked against one record of
    the peer (``checked``: its incarnation and revision; ``bound``: each run with its region),
    and the plan built on them for one placement of the local memory."""

    checked: tuple[str, int]
    bound: list[tuple[Runs, RegionRecord]]
    plan: BatchPlan | None = None
    memory: tuple[int, ...] = ()


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
                 flight: FlightRecorder, cuda: Callable[[], CudaCopier], timeout: float) -> None:
        self.name = name
        self.timeout = timeout  # a prepared transfer's default
        self.state = "open"  # "draining" / "closed": prepared transfers refuse to start (ClosedError)
        self._tg = tg
        self._directory = directory
        self._flight = flight
        self._cuda = cuda
        self._inflight: dict[str, set[Transfer]] = {}
        self._ranges: dict[tuple[str, str], Ranges] = {}  # (peer, key) -> transfers in flight to it
        self._router = Router(name, backends)  # backend choice, synchronous routes
        # Each prepared run list's runs checked against one record of its peer (at prepare when the
        # record is known, else at the first start or warm) and its plan for that record and one
        # placement of its local memory (its backends' runners over their native lists): dropped
        # with the run list, i.e. with its PreparedTransfer.
        self._plans: weakref.WeakKeyDictionary[RunList, _Plan] = weakref.WeakKeyDictionary()
        self._closing = False  # the Transport is closing: what ends now ends with ClosedError
        directory.subscribe(lost=self.abort_peer, forget=self._router.forget, current=self._router.current,
                            withdrawn=self._router.withdrawn)

    # -- starting -------------------------------------------------------------------------

    def start(self, op: TransferOp, tensor: torch.Tensor, kind: MemoryKind, peer: str, key: str, offset: int,
              timeout: float) -> Transfer:
        """Starts one transfer in the background and returns its handle (see ``Transport.put``).

        A transfer that overlaps the bytes of an earlier one still in flight to the same region
        (where either writes) starts moving only once that one has ended: from one Transport,
        the later put wins. Non-overlapping transfers run concurrently.

        A transfer on a known route with nothing in flight to the bytes it covers starts moving
        here, synchronously (see :meth:`_now`): a small host copy, or a device copy enqueued
        on the CUDA stream; one that ends within the call returns an already done handle.
        """
        ranges = self._ranges.get((peer, key))
        if ranges is None or ranges.clear_of(op, offset, offset + nbytes_of(tensor)):
            done = self._now(op, tensor, kind, peer, key, offset, timeout)
            if done is not None:
                return done
        return self._launch(op, _ready_buffer(tensor, kind), peer, key, offset, timeout)

    def _launch(self, op: TransferOp, local: LocalBuffer, peer: str, key: str, offset: int, timeout: float,
                pending: tuple[PeerRecord, Backend, Pending] | None = None) -> Transfer:
        """Runs one transfer in the background: checked and moved (``_execute``), or, with
        ``pending``, the completion of a synchronous attempt that went out (``_execute_pending``)."""
        nbytes = nbytes_of(local.tensor)
        xfer = Transfer(op, peer, key, nbytes, offset, rec=self._flight.start(op.value, peer, key, nbytes))
        if pending is not None:  # its request is out: the bytes may land whatever happens next
            xfer._began(pending[0].incarnation)
        after = self._ranges.setdefault((peer, key), Ranges()).add(xfer, offset, offset + xfer.nbytes)
        self._inflight.setdefault(peer, set()).add(xfer)
        work = (functools.partial(self._execute, xfer, local, after) if pending is None
                else functools.partial(self._execute_pending, xfer, local, *pending))
        self._tg.start_soon(self._run, xfer, work, timeout)
        return xfer

    def prepare(self, runs: RunList) -> PreparedTransfer:
        """A prepared transfer of ``runs`` (checked locally already), checked against the peer's
        record now when it is known (else at the first start); that check is kept for the first
        start on the same record.

        Raises:
            As :meth:`RunList.check`.
        """
        known = self._directory.known(runs.peer)
        if known is not None:  # all remote checks now, while the peer's record is at hand
            self._plans[runs] = _Plan((known.incarnation, known.seq), runs.check(known))
        return PreparedTransfer(runs, self)

    def _checked_against(self, runs: RunList, record: PeerRecord) -> _Plan:
        """What is kept for ``runs``, its runs checked against ``record`` (once per incarnation
        and revision of it).

        Raises:
            As :meth:`RunList.check`.
        """
        checked = (record.incarnation, record.seq)
        cached = self._plans.get(runs)
        if cached is None or cached.checked != checked:
            cached = self._plans[runs] = _Plan(checked, runs.check(record))
        return cached

    def _plan(self, runs: RunList, record: PeerRecord) -> BatchPlan:
        """``runs``' plan for ``record``: its runs checked against the record (see
        :meth:`_checked_against`), and the plan built once per local memory placement on top
        (at the first start on them).

        Raises:
            As :meth:`RunList.check` and :meth:`Router.plan`.
        """
        cached, memory = self._checked_against(runs, record), runs.memory()
        if cached.plan is None or cached.memory != memory:
            cached.plan, cached.memory = self._router.plan(runs.op, record, cached.bound), memory
        return cached.plan

    def _subset_plan(self, prepared: RunList, subset: RunList, record: PeerRecord) -> BatchPlan:
        """The plan of one start of ``subset`` (some of ``prepared``'s runs, see
        :meth:`RunList.subset`) for ``record``: ``prepared``'s runs checked against the record
        once per incarnation and revision (the subset's lie inside them, so that check covers
        them), and the backends' runners built for the subset's runs alone.

        Raises:
            As :meth:`RunList.check` and :meth:`Router.plan`.
        """
        (_, region), = self._checked_against(prepared, record).bound
        return self._router.plan(subset.op, record, [(subset.runs[0], region)])

    def start_prepared(self, prepared: RunList, timeout: float | None, runs: object = None) -> Transfer:
        """See ``PreparedTransfer.start``. One segment takes the path a put of it would
        (completed here when it can be, see :meth:`start`): a prepared transfer is never slower
        than the plain transfer of the same bytes. With ``runs``, only those rows of
        ``prepared``'s bytes move (:meth:`RunList.subset` checks them here, before anything
        starts).

        Raises:
            ClosedError: the Transport is draining or closed. ValueError: a bad timeout.
            As :meth:`RunList.subset`, with ``runs``.
        """
        if self.state != "open":
            raise ClosedError(f"transport {self.name!r} is {self.state}")
        limit = self.timeout if timeout is None else seconds(timeout, "timeout")
        parent = None
        if runs is not None:
            parent, prepared = prepared, prepared.subset(runs)
        one = prepared.single
        if one is not None:
            view, kind, key, offset = one
            return self.start(prepared.op, view, kind, prepared.peer, key, offset, limit)
        return self.start_batch(prepared, limit, parent)

    async def warm_prepared(self, prepared: RunList, timeout: float | None) -> None:
        """See ``PreparedTransfer.warm``: builds its plan for the peer's current record and lets
        each backend ready its runs (``Backend.warm``).

        Raises:
            ClosedError: the Transport is draining or closed. ValueError: a bad timeout.
            TransferTimeoutError: not done within the timeout. As ``PreparedTransfer.start``.
        """
        if self.state != "open":
            raise ClosedError(f"transport {self.name!r} is {self.state}")
        limit = self.timeout if timeout is None else seconds(timeout, "timeout")
        if prepared.single is not None:
            return  # it takes a put's path, whose route the first start makes (and reuses)
        with anyio.move_on_after(limit) as scope:
            record, plan = await self._resolved(prepared.peer, lambda r: self._plan(prepared, r))
            for backend, lists in plan.served:
                await backend.warm(prepared.op, record, lists)
        if scope.cancelled_caught:
            raise TransferTimeoutError(f"{self.name}: warming a prepared {prepared.op.value} of {prepared.segments} "
                                       f"runs to {prepared.peer} took longer than {limit:g}s")

    def start_batch(self, prepared: RunList, timeout: float, parent: RunList | None = None) -> Transfer:
        """Starts every segment of ``prepared`` as one transfer (see ``PreparedTransfer.start``).
        For ordering it counts as one transfer over the span it covers in each region.
        ``parent``: the run list ``prepared`` is a subset of (:meth:`RunList.subset`), if any."""
        spans = prepared.spans  # empty when every item is empty
        keys = sorted(spans) or [prepared.first_key]
        label = keys[0] if len(keys) == 1 else f"{keys[0]} (+{len(keys) - 1} regions)"
        first = spans[keys[0]][0] if spans else 0
        xfer = Transfer(prepared.op, prepared.peer, label, prepared.nbytes, first, segments=prepared.segments,
                        rec=self._flight.start(prepared.op.value, prepared.peer, label, prepared.nbytes))
        after: list[Transfer] = []
        for key, (lo, hi) in spans.items():
            after += self._ranges.setdefault((prepared.peer, key), Ranges()).add(xfer, lo, hi)
        self._inflight.setdefault(prepared.peer, set()).add(xfer)
        ready = _record_ready(prepared.cuda_anchors.values())
        self._tg.start_soon(self._run, xfer, functools.partial(self._execute_batch, xfer, prepared, after, ready,
                                                               parent),
                            timeout, tuple((key, lo) for key, (lo, _hi) in spans.items()))
        return xfer

    def _now(self, op: TransferOp, tensor: torch.Tensor, kind: MemoryKind, peer: str, key: str, offset: int,
             timeout: float) -> Transfer | None:
        """Moves a transfer right here, when everything it needs is at hand: the peer's record
        (adopted, current by the backend's cheap view of it, not lost, its process alive), the
        checks pass, and the backend's synchronous path takes it: ``Backend.mover`` for a host
        copy of at most ``SYNC_MAX_BYTES``, ``Backend.device_mover`` for a device copy of any
        size (enqueued on the CUDA stream after the caller's queued work). Returns the
        completed handle; a running one when the copy went out but its completion is still to
        come; or None: then the transfer takes the asynchronous path, which also reports any
        error precisely. Nothing is moved before every check passed."""
        nbytes = nbytes_of(tensor)
        record = self._directory.known(peer)
        if record is None:
            return None
        route = self._router.sync_route(op, record, key, kind)
        move, backend = route.move, route.backend
        if move is None or backend is None or (nbytes > SYNC_MAX_BYTES and not route.device):
            return None
        # As check() would (type(offset) is int: put/get made it one); a refusal is reported
        # by the asynchronous path.
        if tensor.dtype is not route.dtype or offset < 0 or offset + nbytes > route.limit or offset % route.itemsize:
            return None
        seq = backend.live_seq(record)
        if (seq is not None and seq != record.seq) or self._directory.is_lost(record) or self._directory.stale(record):
            return None
        started, t0 = time.time(), time.monotonic()
        if not nbytes:
            moved: bool | Pending = True
        elif route.device:
            moved = move(tensor, offset, nbytes)  # type: ignore[arg-type]
        else:
            moved = move(tensor.data_ptr(), offset, nbytes)  # type: ignore[arg-type]
        if moved is False:
            return None
        if moved is not True:  # went out; its completion comes later
            # (a CUDA tensor's ready event: only for moving it again by the checked path, if the
            # device copy failed; recorded now, still in put(), so it sees what the copy saw)
            return self._launch(op, _ready_buffer(tensor, kind), peer, key, offset, timeout, (record, backend, moved))
        self._flight.completed(op.value, peer, key, nbytes, backend.name, started)
        return Transfer._completed(op, peer, key, nbytes, offset, backend.name, backend.one_sided, backend.same_host,
                                   t0)

    async def fence(self, peer: str, timeout: float) -> None:
        """Waits until every transfer to ``peer`` started before this call has ended.

        Raises:
            TransferTimeoutError: they did not all end within ``timeout``.
            TransportError: the first error among them (the others still ended).
        """
        pending = list(self._inflight.get(peer, ()))
        unfinished = await ended_within(pending, timeout)
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
        left = len(await ended_within([x for xs in self._inflight.values() for x in xs], timeout))
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
                error: TransportError
                if excluded:
                    error = TransferAbortedError(f"{what} aborted: {name} was excluded", partial=xfer._moving)
                else:
                    error = PeerLostError(f"{what} aborted: {why}")
                    error.__cause__ = why
                xfer._abort(error)

    # -- choosing -------------------------------------------------------------------------

    def _check_remote(self, record: PeerRecord, xfer: Transfer, dtype: torch.dtype) -> RegionRecord:
        region = record.regions.get(xfer.key)
        check(xfer.op, record.name, xfer.key, region, dtype_name(dtype), xfer.offset, xfer.nbytes,
              known=record.regions.keys())
        assert region is not None
        return region

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
        return await self._resolved(xfer.peer, check)

    async def _resolved(self, peer: str, check: Callable[[PeerRecord], _Checked]) -> tuple[PeerRecord, _Checked]:
        """``peer``'s record and what ``check(record)`` made of it (see :meth:`_checked`)."""
        record = await self._directory.resolve(peer)
        if self._router.republished(record):
            record = await self._directory.resolve(peer, refresh=True)
        try:
            return record, check(record)
        except (RegistrationError, DTypeMismatchError, BoundsError):
            record = await self._directory.resolve(peer, refresh=True)
            return record, check(record)

    def _begin(self, xfer: Transfer, record: PeerRecord, backend: str) -> None:
        if self._directory.stale(record):
            raise PeerLostError(f"{record.name} (pid {record.pid}) has exited")
        xfer._began(record.incarnation)
        self._flight.transition(xfer._rec, OpState.MOVING, backend=backend)

    async def _execute(self, xfer: Transfer, local: LocalBuffer, after: Sequence[Transfer]) -> None:
        record, region = await self._checked(xfer, after,
                                             lambda r: self._check_remote(r, xfer, local.tensor.dtype))
        backend = self._router.choose(record, region, local.kind)
        xfer._routed(backend.name, backend.one_sided, backend.same_host)
        self._begin(xfer, record, backend.name)
        if xfer.nbytes == 0:
            return
        await self._move(backend, xfer.op, local, RemoteTarget(record, region, xfer.offset, xfer.nbytes))

    async def _execute_pending(self, xfer: Transfer, local: LocalBuffer, record: PeerRecord, backend: Backend,
                               pending: Pending) -> None:
        """Completes a synchronous attempt whose request went out (see :meth:`_now`); when it
        comes back refused or broken, moves the bytes again by the checked path."""
        xfer._routed(backend.name, backend.one_sided, backend.same_host)
        try:
            self._begin(xfer, record, backend.name)
        except BaseException:
            with anyio.CancelScope() as scope:  # the backend lets go of what the request holds
                scope.cancel()
                await pending()
            raise
        if not await pending():
            await self._execute(xfer, local, ())

    async def _execute_batch(self, xfer: Transfer, prepared: RunList, after: Sequence[Transfer],
                             ready: Ready, parent: RunList | None) -> None:
        """``ready``: the events recorded at start() on each CUDA device's current stream. Runs
        of memory their backend does not serve go through bounce buffers, ``STAGED_INFLIGHT``
        at once. ``parent``: see :meth:`start_batch`."""
        record, plan = await self._checked(xfer, after, lambda r: self._plan(prepared, r) if parent is None
                                           else self._subset_plan(parent, prepared, r))
        xfer._routed(plan.backends, plan.one_sided, plan.same_host)
        self._begin(xfer, record, plan.backends)
        for run in plan.runners:
            await run(ready)
        await _pieces.run(plan.staged, lambda s: self._move(s[0], xfer.op, s[1].local(ready), s[1].remote),
                          STAGED_INFLIGHT)

    async def _move(self, backend: Backend, op: TransferOp, local: LocalBuffer, remote: RemoteTarget) -> None:
        """Moves one range with ``backend``, through a bounce buffer when it does not serve the
        local tensor's memory."""
        if local.kind in backend.memory_kinds:
            await backend.move(op, local, remote)
            return
        async with bounce(local, remote.nbytes, self._cuda) as b:
            await b.each(op, lambda buf, pos, size: backend.move(
                op, buf, RemoteTarget(remote.peer, remote.region, remote.offset + pos, size)))

    async def _run(self, xfer: Transfer, work: Callable[[], Awaitable[None]], timeout: float,
                   spans: Sequence[tuple[str, int]] = ()) -> None:
        """Runs ``work`` for ``xfer`` under its deadline and settles it; ``spans``: the (key,
        first byte) it was added to the ordering index under (default: its own key and offset)."""
        current_op.set(xfer._rec)  # (this task's context only) backends note on it what carried it
        try:
            with anyio.CancelScope(deadline=anyio.current_time() + timeout) as scope:
                xfer._running_in(scope)
                if scope.cancel_called and not xfer._moving:  # cancelled already; (one moving
                    await anyio.lowlevel.checkpoint()  # must still clean up, in work()) deliver it now
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
            for key, start in spans or ((xfer.key, xfer.offset),):
                ranges = self._ranges.get((xfer.peer, key))
                if ranges is not None and ranges.remove(xfer, start):
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
