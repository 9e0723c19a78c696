"""The CUDA driver calls of the native extension (``csrc/cuda_*.cpp``), typed, with their
failures in the error tree, and the async front of its CUDA copy engine (:class:`CudaEngine`).
No torch here: devices, allocations, streams, events, modules and functions are integers
(ordinals, addresses and driver handles).

The driver (``libcuda.so.1``, or ``$TRANSPORT_CUDA_LIB``) is loaded at run time, once per
process. Every call here raises :class:`BackendUnavailableError` (saying why) without a usable
driver, and :class:`CudaError` when the driver refuses it. The policy built on these calls
(caches, pools, identities, streams per device) is :mod:`transport._cuda`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import anyio
from anyio.abc import TaskStatus

from .._errors import BackendUnavailableError, CudaError
from ._extension import _C

log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")

Dim3 = tuple[int, int, int]


def _driver(fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """Runs a native CUDA call, its failures mapped into the error tree."""
    try:
        return fn(*args, **kwargs)
    except _C.CudaUnavailable as exc:
        raise BackendUnavailableError(str(exc)) from exc
    except _C.CudaError as exc:
        raise CudaError(str(exc)) from exc


def unavailable_reason() -> str | None:
    """Loads the driver (once per process); None when it is usable with at least one device,
    else why not. Later calls repeat the first outcome."""
    return _C.cuda_load() or None


def require_driver() -> None:
    """Loads the driver (once per process).

    Raises:
        BackendUnavailableError: no usable CUDA driver (the message says why).
    """
    reason = unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(reason)


def driver_version() -> int:
    """``cuDriverGetVersion``: 1000 * major + 10 * minor."""
    return _driver(_C.cuda_driver_version)


def device_count() -> int:
    return _driver(_C.cuda_device_count)


def device_uuid(device: int) -> str:
    """The device's UUID as ``nvidia-smi`` prints it ("GPU-...")."""
    return _driver(_C.cuda_device_uuid, device)


def device_name(device: int) -> str:
    return _driver(_C.cuda_device_name, device)


def allocation(ptr: int, device: int = -1) -> tuple[int, int, int, bool]:
    """(base, size, device, legacy IPC capable) of the device allocation ``ptr`` lies in;
    ``device`` (-1: unknown) is the device whose context is made current for the queries."""
    return _driver(_C.cuda_allocation, ptr, device)


def ipc_export(base: int, device: int) -> bytes:
    """The 64-byte legacy CUDA IPC handle of the allocation at ``base``."""
    return _driver(_C.cuda_ipc_export, base, device)


def ipc_open(handle: bytes, device: int) -> int:
    """Opens another process's IPC handle on ``device`` (peer access enabled lazily); returns
    the allocation's address in this process. A process opens a handle once per device."""
    return _driver(_C.cuda_ipc_open, handle, device)


def ipc_close(ptr: int, device: int) -> None:
    _driver(_C.cuda_ipc_close, ptr, device)


def stream_create(device: int) -> int:
    """A new CUstream on ``device``, non-blocking w.r.t. the legacy default stream."""
    return _driver(_C.cuda_stream_create, device)


def stream_destroy(stream: int, device: int) -> None:
    _driver(_C.cuda_stream_destroy, stream, device)


def stream_synchronize(stream: int, device: int) -> None:
    """Blocks until the work queued on ``stream`` so far has run (the GIL released)."""
    _driver(_C.cuda_stream_synchronize, stream, device)


def host_register(ptr: int, nbytes: int, read_only: bool, device: int) -> None:
    """``cuMemHostRegister`` (portable): page-locks a host range for DMA. Slow for a large range."""
    _driver(_C.cuda_host_register, ptr, nbytes, read_only, device)


def host_unregister(ptr: int, device: int) -> None:
    _driver(_C.cuda_host_unregister, ptr, device)


def kernels_image() -> bytes | None:
    """The fatbin of ``csrc/kernels`` embedded in this build, or None (built without nvcc).
    Needs no driver."""
    return _C.kernels_image()


def kernels_arches() -> str:
    """The architectures the embedded kernels were built for, comma-separated ("" without
    kernels). Needs no driver."""
    return _C.kernels_arches()


def module_load(image: bytes, device: int) -> int:
    """``cuModuleLoadData`` of a fatbin on ``device``; returns the module handle."""
    return _driver(_C.cuda_module_load, image, device)


def module_function(module: int, name: str, device: int) -> int:
    """The handle of kernel ``name`` of a loaded module."""
    return _driver(_C.cuda_module_function, module, name, device)


def launch(function: int, grid: Dim3, block: Dim3, shared_bytes: int, stream: int, params: bytes, device: int) -> None:
    """Enqueues a kernel on ``stream``; ``params`` are its arguments as the C ABI lays them out
    (see :mod:`transport._native.kernels`)."""
    _driver(_C.cuda_launch, function, grid, block, shared_bytes, stream, params, device)


# -- the copy engine ---------------------------------------------------------------------------

# A cancelled wait still waits this long (shielded) for its job's copies to end: they cannot be
# recalled, and the memory they touch must not be freed or reused under them. A device copy ends
# in milliseconds; one queued behind the application's work waits for that work too.
_ABORT_GRACE_S = 60.0

StreamRef = tuple[int, int]  # (device, CUstream handle) of another party's stream


@dataclass(frozen=True)
class JobResult:
    """How a job of the CUDA copy engine ended: ``code`` is the driver's error (0 if none),
    ``message`` says which call failed."""

    ok: bool
    code: int
    message: str


_OK = JobResult(True, 0, "")


def _result(native: tuple[int, int, int, str]) -> JobResult:
    _id, status, code, message = native
    return _OK if status == 0 else JobResult(False, code, message)


class _Slot:
    __slots__ = ("event", "result")

    def __init__(self) -> None:
        self.event: anyio.Event | None = None  # made by the waiter, if it has to wait
        self.result: JobResult | None = None


class CudaEngine:
    """Async front of the native CUDA copy engine (``csrc/cuda_engine.h``).

    :meth:`submit` enqueues a job's copies on a stream right on the calling thread and polls its
    end for a short budget; a job that has not ended by then is reaped by the engine's native
    thread, announced on an eventfd and delivered by :meth:`run` (a task in the event loop) to
    :meth:`wait`. No worker thread is handed a copy.

    Start :meth:`run` in a task group before the first :meth:`wait`; call :meth:`close` after
    the jobs' waiters have ended (a job still in flight then is no longer reported).

    Raises:
        TransportInternalError: the native extension does not load.
    """

    def __init__(self) -> None:
        self._engine = _C.CudaEngine()
        self._ids = itertools.count(1)
        self._slots: dict[int, _Slot] = {}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Delivers the reaped jobs' results to their :meth:`wait`, until cancelled."""
        fd = self._engine.event_fd
        task_status.started()
        while True:
            await anyio.wait_readable(fd)
            for native in self._engine.drain():
                slot = self._slots.get(native[0])
                if slot is None:  # its waiter gave up (see wait)
                    continue
                slot.result = _result(native)
                if slot.event is not None:
                    slot.event.set()

    def order(self, device: int, stream: int, after: Sequence[StreamRef] = (), events: Sequence[int] = ()) -> None:
        """Makes ``stream`` (of ``device``) wait for the work queued so far on each ``after``
        stream and for each event (a ``CUevent`` handle) in ``events``; enqueues only.

        Raises:
            BackendUnavailableError: no driver. CudaError: the driver refused.
        """
        _driver(self._engine.order, device, stream, list(after), list(events))

    def submit(self, device: int, stream: int, packed: bytes, *, after: Sequence[StreamRef] = (),
               events: Sequence[int] = (), spin_s: float = 0.0) -> tuple[int, JobResult | None]:
        """Enqueues a job on ``stream`` of ``device``: waits as :meth:`order`, every packed
        ``(dst, src, nbytes)`` copy (:func:`transport._native.pack_segments`; none: the job ends
        after the work already queued there, e.g. a kernel), then its event; and polls its end
        for up to ``spin_s`` seconds on this thread (the GIL released). Callable from any thread.

        Returns:
            ``(job, result)``: ``result`` when the job ended within ``spin_s``, else None, and
            then :meth:`wait` for ``job`` must follow (its copies run; their memory must stay).

        Raises:
            BackendUnavailableError: no driver. CudaError: nothing was enqueued (the driver
            refused a wait or the event, or the engine is shut down). A copy refused after
            others were enqueued ends the job failed instead.
        """
        job = next(self._ids)
        slot = self._slots[job] = _Slot()  # before the reaper can report it (another thread may call)
        try:
            native = _driver(self._engine.submit, job, device, stream, list(after), list(events), packed,
                             int(spin_s * 1e9))
        except BaseException:
            del self._slots[job]
            raise
        if native is None:
            return job, None
        del self._slots[job]
        slot.result = _result(native)
        return job, slot.result

    async def wait(self, job: int) -> JobResult:
        """The result of ``job`` (submitted and not ended within its spin), once the engine saw
        it end.

        Cancellation: the copies cannot be recalled, so this still waits, shielded, until they
        ended (at most ``_ABORT_GRACE_S``; past that it logs an error), then re-raises.
        """
        slot = self._slots[job]
        try:
            if slot.result is None:
                slot.event = anyio.Event()
                await slot.event.wait()
        except anyio.get_cancelled_exc_class():
            if slot.result is None and slot.event is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(_ABORT_GRACE_S):
                    await slot.event.wait()
            if slot.result is None:
                log.error("cuda: copy job %d still runs on the device %gs after its transfer was cancelled; "
                          "its memory may be written after release", job, _ABORT_GRACE_S)
            raise
        finally:
            del self._slots[job]
        assert slot.result is not None  # set before the event
        return slot.result

    def inflight(self) -> int:
        """Jobs whose end has not been seen yet."""
        return self._engine.inflight()

    def close(self) -> None:
        """Stops the reaper and frees the engine's events (idempotent)."""
        self._engine.shutdown()
