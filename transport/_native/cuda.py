"""The CUDA driver calls of the native extension (``csrc/cuda_*.cpp``), typed, with their
failures in the error tree. No torch here: devices, allocations, streams, events, modules and
functions are integers (ordinals, addresses and driver handles).

The driver (``libcuda.so.1``, or ``$TRANSPORT_CUDA_LIB``) is loaded at run time, once per
process. Every call here raises :class:`BackendUnavailableError` (saying why) without a usable
driver, and :class:`CudaError` when the driver refuses it. The policy built on these calls
(caches, pools, identities, streams per device) is :mod:`transport._cuda`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar

from .._errors import BackendUnavailableError, TransportInternalError
from ._extension import _C

_P = ParamSpec("_P")
_R = TypeVar("_R")

Dim3 = tuple[int, int, int]


class CudaError(TransportInternalError):
    """The CUDA driver refused a call; the message names the call and the driver's error."""


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


def event_create(device: int) -> int:
    """A new CUevent on ``device`` (timing disabled)."""
    return _driver(_C.cuda_event_create, device)


def event_destroy(event: int, device: int) -> None:
    _driver(_C.cuda_event_destroy, event, device)


def copy_and_wait(dst: int, src: int, nbytes: int, stream: int, wait_event: int, done_event: int, device: int) -> None:
    """Copies ``nbytes`` (device or host addresses) on ``stream`` after ``wait_event`` (0: none),
    records ``done_event`` after it and blocks until that completed. Call it from a worker
    thread (the GIL is released meanwhile)."""
    _driver(_C.cuda_copy_and_wait, dst, src, nbytes, stream, wait_event, done_event, device)


def copy_list_and_wait(packed: bytes, stream: int, wait_event: int, done_event: int, device: int) -> None:
    """As :func:`copy_and_wait` for every (dst, src, nbytes) of ``packed`` (see
    :func:`transport._native.pack_segments`): all enqueued on ``stream``, then one event
    recorded and waited for. An empty ``packed`` waits for the work already on ``stream``."""
    _driver(_C.cuda_copy_list_and_wait, packed, stream, wait_event, done_event, device)


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
