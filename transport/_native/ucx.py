"""The UCX engine (``csrc/ucx_*.cpp``) and the libucp it runs on.

libucp is loaded at run time by the native extension (``dlopen``), so everything builds and
imports without it: the ``libucx-cu12`` wheel (``pip install 'transport[ucx]'``) by default,
else the system loader's ``libucp.so.0``; ``$TRANSPORT_UCX_LIB`` (a ``libucp.so`` path, or its
directory) chooses one. :class:`UcxEngine` is the async front of one UCP context and its lanes;
completions of every lane arrive through one eventfd, which :meth:`UcxEngine.run` waits on in
the event loop.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import anyio
from anyio.abc import TaskStatus

from .._errors import ClosedError, TransportError, TransportInternalError
from .._wire import TransferOp
from ._extension import _C
from .copy import CopyStatus
from .ucx_format import check_rkey, check_worker_address

log = logging.getLogger(__name__)

LIB_ENV = "TRANSPORT_UCX_LIB"
INSTALL_HINT = "pip install 'transport[ucx]'"

_P = ParamSpec("_P")
_R = TypeVar("_R")

# What the native UCX engine raises: RuntimeError (a UCX or system failure, or shut down),
# ValueError / IndexError (bad arguments: a bug here).
_UCX_NATIVE_ERRORS = (RuntimeError, ValueError, IndexError)

# A cancelled UCX job stops at its next chunk; its chunks in flight normally finish at once.
# Past this wait the caller moves on, and the job's memory stays referenced until the engine
# reports it (or its endpoint or the engine is closed, which ends it).
_UCX_ABORT_GRACE_S = 0.5


# -- the library -------------------------------------------------------------------------------


def _candidates() -> list[str]:
    explicit = os.environ.get(LIB_ENV)
    if explicit:  # an explicit choice is not second-guessed: no silent fallback
        return [os.path.join(explicit, "libucp.so") if os.path.isdir(explicit) else explicit]
    out = []
    try:
        spec = importlib.util.find_spec("libucx")  # the wheel; not imported (no side effects)
    except (ImportError, ValueError):
        spec = None
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(root, "lib", "libucp.so")
        if os.path.isfile(path):
            out.append(path)
    out.append("libucp.so.0")  # a system UCX, through ldconfig / LD_LIBRARY_PATH
    return out


@functools.cache
def library() -> tuple[str | None, str | None, str | None]:
    """(path, version, None) of the libucp this process uses, or (None, None, why not).

    Loaded once per process (UCX cannot be unloaded); later changes of ``$TRANSPORT_UCX_LIB``
    have no effect.
    """
    try:
        compiled = getattr(_C, "ucx_compiled", False)
    except TransportError as exc:
        return None, None, str(exc)
    if not compiled:
        return None, None, (
            "transport._C was built without UCX headers; "
            f"{INSTALL_HINT}, then reinstall transport so that csrc/ is rebuilt against them"
        )
    errors = []
    for candidate in _candidates():
        try:
            path, version = _C.ucx_load(candidate)
        except RuntimeError as exc:
            errors.append(str(exc))
            continue
        log.debug("ucx: loaded libucp %s from %s", version, path)
        return str(path), str(version), None
    why = "; ".join(errors)
    return None, None, f"libucp could not be loaded ({why}); {INSTALL_HINT}, or set ${LIB_ENV} to a libucp.so"


# -- the engine --------------------------------------------------------------------------------


# ``ucx::Op`` in csrc/ucx_lane.h: the native spelling of a transfer's direction.
_NATIVE_OP = {TransferOp.PUT: 0, TransferOp.GET: 1}


@dataclass(frozen=True)
class UcxList:
    """Many ranges of one region on one lane: ``packed`` holds (local address, remote address,
    nbytes) u64 triples (:func:`transport._native.pack_segments`)."""

    lane: int
    ep: int
    rkey: int
    packed: bytes


UcxLane = tuple[int, int, int]  # (lane, endpoint, rkey): where one part of a transfer goes


@dataclass(frozen=True)
class UcxPart:
    """One lane's share of a transfer: ``nbytes`` between local address ``local`` and remote
    address ``remote`` through endpoint ``ep`` and rkey ``rkey`` of ``lane``."""

    lane: int
    ep: int
    rkey: int
    local: int
    remote: int
    nbytes: int


@dataclass(frozen=True)
class UcxResult:
    """How a UCX transfer ended: ``ucs_status`` is UCX's first failure (0 if none), ``nbytes``
    the bytes of its completed chunks."""

    status: CopyStatus
    ucs_status: int
    nbytes: int

    def describe(self) -> str:
        """UCX's words for ``ucs_status``."""
        return status_string(self.ucs_status)


def status_string(ucs_status: int) -> str:
    """UCX's description of a ``ucs_status_t`` (a number when no libucp is loaded)."""
    return str(_C.ucx_status_string(ucs_status))


class _UcxPending:
    __slots__ = ("event", "keep", "nbytes", "remaining", "status", "ucs_status")

    def __init__(self, parts: int, keep: object) -> None:
        self.event = anyio.Event()
        self.remaining = parts
        self.status = CopyStatus.OK
        self.ucs_status = 0
        self.nbytes = 0
        self.keep = keep  # the local memory of the transfer: alive until the engine lets go of it

    def add(self, status: CopyStatus, ucs_status: int, nbytes: int) -> None:
        self.nbytes += nbytes
        if status == CopyStatus.FAILED and self.status != CopyStatus.FAILED:
            self.status, self.ucs_status = status, ucs_status
        elif status == CopyStatus.ABORTED and self.status == CopyStatus.OK:
            self.status = status
        self.remaining -= 1
        if self.remaining == 0:
            self.event.set()

    @property
    def result(self) -> UcxResult:
        return UcxResult(self.status, self.ucs_status, self.nbytes)


class UcxEngine:
    """Async front of the native UCX engine: one UCP context and its lanes (a worker driven by
    a native progress thread each); completions of every lane arrive through one eventfd.

    Start :meth:`run` in a task group before calling :meth:`transfer`; call :meth:`close` once
    (it finishes every transfer still waiting). :meth:`connect` and :meth:`unpack_rkey` block
    the caller briefly while the lane's thread runs them.

    Args:
        library: libucp to load (a path, or a soname for the system loader); a process loads
            one libucp, the first one asked for.
        name: shows up in UCX's own diagnostics.
        lanes: workers (and progress threads); a transfer may be split across them.
        chunk_bytes: the largest single ``ucp_put_nbx``/``ucp_get_nbx``.
        window: chunks of one job in flight at once.

    Raises:
        TransportInternalError: libucp does not load or UCX cannot start.
    """

    def __init__(self, library: str, name: str, *, lanes: int = 1, chunk_bytes: int = 8 << 20,
                 window: int = 4) -> None:
        try:
            self._engine = _C.UcxEngine(library, name, lanes, chunk_bytes, window)
        except _UCX_NATIVE_ERRORS as exc:
            raise TransportInternalError(f"cannot start UCX from {library}: {exc}") from exc
        self.lanes = lanes
        self._pending: dict[int, _UcxPending] = {}  # job id -> its transfer (shared by its parts)
        self._closed = False

    def worker_address(self, lane: int) -> bytes:
        """The packed address peers create endpoints to ``lane`` from."""
        return bytes(self._engine.worker_address(lane))

    def _call(self, what: str, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if self._closed:
            raise ClosedError(f"{what}: the ucx engine is closed")
        try:
            return fn(*args, **kwargs)
        except _UCX_NATIVE_ERRORS as exc:
            if self._closed:
                raise ClosedError(f"{what}: the ucx engine is closed") from exc
            raise TransportInternalError(f"{what}: {exc}") from exc

    def _post(self, fn: Callable[_P, None], *args: _P.args, **kwargs: _P.kwargs) -> None:
        """Fire-and-forget calls (unmap, close, destroy): after close there is nothing left to
        release, and a lane shutting down releases everything itself."""
        if self._closed:
            return
        try:
            fn(*args, **kwargs)
        except _UCX_NATIVE_ERRORS as exc:
            log.debug("ucx engine: %s ignored: %s", getattr(fn, "__name__", fn), exc)

    def mem_map(self, address: int, nbytes: int, *, remote_write: bool = True,
                local_write: bool = True) -> tuple[int, bytes]:
        """Registers host memory; returns (handle, packed rkey for peers).

        ``remote_write=False`` registers it without remote-write access
        (``UCP_MEM_MAP_PROT_REMOTE_WRITE`` left out of its protection), ``local_write=False``
        also without local-write access (for a ``PROT_READ`` mapping). Only transports that
        check rkeys in hardware (RDMA) enforce this: UCX's ``cma`` and ``tcp`` transports accept
        a put through any rkey, to any address.

        Raises:
            ClosedError: the engine is closed.
            TransportInternalError: UCX refused the registration.
        """
        mem, rkey = self._call(f"ucp_mem_map of {nbytes} bytes", self._engine.mem_map, address, nbytes,
                               remote_write, local_write)
        return int(mem), bytes(rkey)

    def mem_unmap(self, mem: int) -> None:
        self._post(self._engine.mem_unmap, mem)

    def connect(self, lane: int, address: bytes) -> int:
        """An endpoint of ``lane`` to the worker at ``address`` (wire-up finishes in the
        background).

        Raises:
            ClosedError: the engine is closed.
            WireError: ``address`` is not a whole worker address (checked before UCX parses it).
            TransportInternalError: UCX refused the endpoint.
        """
        check_worker_address(address)
        return int(self._call("ucp_ep_create", self._engine.ep_create, lane, address))

    def disconnect(self, lane: int, ep: int, *, force: bool) -> None:
        """Closes an endpoint. ``force``: the peer is gone; its transfers in flight fail."""
        self._post(self._engine.ep_close, lane, ep, force)

    def unpack_rkey(self, lane: int, ep: int, packed: bytes) -> int:
        """The rkey of a peer's packed rkey, usable on endpoint ``ep`` of ``lane``.

        Raises:
            ClosedError: the engine is closed.
            WireError: ``packed`` is not a whole packed rkey (checked before UCX parses it).
            TransportInternalError: UCX refused the rkey.
        """
        check_rkey(packed)
        return int(self._call("ucp_ep_rkey_unpack", self._engine.rkey_unpack, lane, ep, packed))

    def read_word(self, lane: int, ep: int, rkey: int, remote: int, timeout: float) -> int | None:
        """Reads the 8-byte word at ``remote`` synchronously (the caller blocks, at most
        ``timeout`` seconds); None if it could not be read (timeout, closed endpoint).

        Raises:
            ClosedError: the engine is closed.
            TransportInternalError: the engine refused the read.
        """
        timeout_ms = max(1, int(timeout * 1000))
        status, value = self._call("ucp_get_nbx of 8 bytes", self._engine.read_word, lane, ep, rkey, remote, timeout_ms)
        return int(value) if status == 0 else None

    def now_mover(self, op: TransferOp, first: UcxLane, second: UcxLane | None, remote: int, timeout: float,
                  pair_min: int, align: int = 4096) -> Callable[[int, int, int], bool]:
        """A synchronous mover for one route: ``move(local, offset, nbytes)`` moves ``nbytes``
        between local address ``local`` and remote address ``remote + offset`` while the caller
        waits: the calling thread (the GIL released) drives the lane of ``first`` itself,
        issuing the transfer and, for a put, flushing it, while the lane's own thread steps
        aside. From ``pair_min`` bytes on, with ``second``, the range is split at an
        ``align``-ed point and the engine's assistant thread moves the second part on that lane
        at the same time. For peers whose memory UCX reaches without their help (same host:
        cma), where this takes microseconds and a hand-off to the lanes' threads would cost a
        wake-up; built once per route, so each call is one native call.

        ``move`` returns True once every byte is in place; False when it failed, did not
        complete within ``timeout`` seconds (then it was cancelled; some bytes may have landed)
        or the engine is closed. Either way the engine no longer uses the local memory then.
        """
        engine, native_op, timeout_us = self._engine, _NATIVE_OP[op], max(1, int(timeout * 1e6))
        lane0, ep0, rkey0 = first

        def move(local: int, offset: int, nbytes: int) -> bool:
            there = remote + offset
            try:
                if second is not None and nbytes >= pair_min:
                    half = (nbytes // 2 + align - 1) // align * align
                    status, _moved = engine.transfer_now_pair(native_op, (lane0, ep0, rkey0, local, there, half),
                                                              (*second, local + half, there + half, nbytes - half),
                                                              timeout_us)
                else:
                    status, _moved = engine.transfer_now(lane0, native_op, ep0, rkey0, local, there, nbytes,
                                                         timeout_us)
            except _UCX_NATIVE_ERRORS:  # the engine was shut down, or a lane of it
                return False
            return status == 0

        return move

    def destroy_rkey(self, lane: int, rkey: int) -> None:
        self._post(self._engine.rkey_destroy, lane, rkey)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Delivers the lanes' completions to the waiting :meth:`transfer` calls, until
        cancelled or closed."""
        fd = self._engine.event_fd
        task_status.started()
        while not self._closed:
            await anyio.wait_readable(fd)
            self._dispatch()

    def _dispatch(self) -> None:
        for job_id, status, ucs_status, nbytes in self._engine.drain():
            pending = self._pending.pop(job_id, None)
            if pending is not None:
                pending.add(CopyStatus(status), ucs_status, nbytes)

    async def transfer(self, op: TransferOp, parts: Sequence[UcxPart], keep: object) -> UcxResult:
        """Runs the parts of one transfer (on their lanes, concurrently); returns how it ended.
        A put has completed once its bytes are in the peer's memory (its endpoints were
        flushed).

        ``keep`` (the object owning the local memory) stays referenced until the engine has
        let go of that memory, even past a cancellation.

        Cancellation: the parts stop issuing chunks; this waits (shielded, bounded) for the
        chunks in flight, then the cancellation propagates. Some chunks may have landed.

        Raises:
            ClosedError: the engine is closed.
            TransportInternalError: the engine refused the parts (a bug).
        """
        native = _NATIVE_OP[op]
        return await self._run([(p.lane, functools.partial(self._engine.submit, p.lane, native, p.ep, p.rkey, p.local,
                                                           p.remote, p.nbytes)) for p in parts], keep)

    async def transfer_many(self, op: TransferOp, lists: Sequence[UcxList], keep: object) -> UcxResult:
        """As :meth:`transfer`, for lists of ranges: each list is one job on its lane (its
        ranges issued back to back, one flush), all lists concurrently, one result."""
        native = _NATIVE_OP[op]
        return await self._run([(x.lane, functools.partial(self._engine.submit_many, x.lane, native, x.ep, x.rkey,
                                                           x.packed)) for x in lists], keep)

    async def _run(self, submits: Sequence[tuple[int, Callable[[], int]]], keep: object) -> UcxResult:
        if self._closed:
            raise ClosedError("the ucx engine is closed")
        pending = _UcxPending(len(submits), keep)
        jobs: list[tuple[int, int]] = []
        try:
            for lane, submit in submits:
                job = submit()
                self._pending[job] = pending
                jobs.append((lane, job))
        except _UCX_NATIVE_ERRORS as exc:
            for _ in range(len(submits) - len(jobs)):
                pending.add(CopyStatus.ABORTED, 0, 0)
            self._abort(jobs)  # the parts already queued must let go of the memory first
            with anyio.CancelScope(shield=True), anyio.move_on_after(_UCX_ABORT_GRACE_S):
                await pending.event.wait()
            if isinstance(exc, RuntimeError):  # a lane is shut down: the transport is closing
                raise ClosedError(f"the ucx engine is closed ({exc})") from exc
            raise TransportInternalError(f"ucx engine refused a transfer: {exc}") from exc
        try:
            await pending.event.wait()
        except anyio.get_cancelled_exc_class():
            self._abort(jobs)
            with anyio.CancelScope(shield=True), anyio.move_on_after(_UCX_ABORT_GRACE_S):
                await pending.event.wait()
            raise
        return pending.result

    def _abort(self, jobs: Sequence[tuple[int, int]]) -> None:
        if self._closed:
            return
        for lane, job in jobs:
            self._post(self._engine.cancel, lane, job)  # a lane shutting down ends the job itself

    def close(self) -> None:
        """Aborts every job, closes every endpoint, destroys the workers and the context and
        joins the progress threads (bounded); then no native code touches this process's
        memory any more, and every waiting :meth:`transfer` returns (aborted). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._engine.shutdown()
        self._dispatch()
        for pending in self._pending.values():  # one entry per unreported job; a backstop
            pending.add(CopyStatus.ABORTED, 0, 0)
        self._pending.clear()
