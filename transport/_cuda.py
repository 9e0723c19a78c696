"""CUDA memory: the driver, device identities, allocations, CUDA IPC export, streams, page-locked
buffers and the kernel module: the policy (caches, torch's streams and events) over the typed
driver calls of :mod:`transport._native.cuda`. The copies themselves, and what they hold, are
:mod:`transport._cuda_copier`'s.

The driver (``libcuda.so.1``, or ``$TRANSPORT_CUDA_LIB``) is loaded at run time, so everything
builds and imports without one. Without a driver every entry point here raises
:class:`BackendUnavailableError` saying why.

Stream semantics (shared by every backend that moves CUDA memory): a transfer of a CUDA tensor
makes a transport-owned stream wait for an event recorded on the caller's current stream when
the transfer was *started* (so it sees all work queued before it), and completes only once the
copy finished on the device (so a completed Transfer means the bytes are in place).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import torch

from ._errors import BackendUnavailableError, TransportInternalError
from ._native import cuda as driver

_P = ParamSpec("_P")
_R = TypeVar("_R")

log = logging.getLogger(__name__)

def unavailable_reason() -> str | None:
    """None when a CUDA driver with at least one device is usable here, else why not."""
    return driver.unavailable_reason()


def driver_call(what: str, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """Runs a driver call of :mod:`transport._native.cuda`; a refused call is reported with
    ``what`` was being done.

    Raises:
        BackendUnavailableError: no usable CUDA driver (the message says why).
        TransportInternalError: the driver refused the call.
    """
    try:
        return fn(*args, **kwargs)
    except driver.CudaError as exc:
        raise TransportInternalError(f"{what}: {exc}") from exc


def driver_version() -> str:
    """The driver's CUDA version, e.g. "12.4"."""
    v = driver_call("cuDriverGetVersion", driver.driver_version)
    return f"{v // 1000}.{v % 1000 // 10}"


def device_count() -> int:
    return driver_call("cuDeviceGetCount", driver.device_count)


@functools.cache
def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device ``index`` ("GPU-..."): what identifies a GPU
    across processes, whose ordinals differ with ``CUDA_VISIBLE_DEVICES``."""
    return driver_call(f"cuDeviceGetUuid({index})", driver.device_uuid, index)


def device_name(index: int) -> str:
    return driver_call(f"cuDeviceGetName({index})", driver.device_name, index)


def device_label(index: int) -> str:
    """How a region on device ``index`` is published: "cuda:<uuid>"."""
    return f"cuda:{device_uuid(index)}"


def local_index(label: str) -> int | None:
    """This process's ordinal of the GPU a peer published as ``label``, or None if not visible."""
    uuid = label.removeprefix("cuda:")
    for i in range(device_count()):
        if device_uuid(i) == uuid:
            return i
    return None


@dataclass(frozen=True)
class Allocation:
    """The device allocation a pointer lies in (what CUDA IPC exports)."""

    base: int
    size: int
    device: int
    ipc_capable: bool  # False for VMM allocations, e.g. PyTorch's expandable segments


def allocation(ptr: int, device: int = -1) -> Allocation:
    """The allocation ``ptr`` lies in; ``device`` (-1: unknown) is the device it is expected on,
    whose context is made current for the driver's pointer queries."""
    base, size, device, ipc = driver_call(f"allocation of 0x{ptr:x}", driver.allocation, ptr, device)
    return Allocation(base, size, device, ipc)


def ipc_export(alloc: Allocation) -> bytes:
    """The 64-byte legacy CUDA IPC handle of ``alloc``."""
    if not alloc.ipc_capable:
        raise BackendUnavailableError(
            f"the allocation at 0x{alloc.base:x} cannot be exported with CUDA IPC (a VMM allocation, e.g. "
            "PyTorch's expandable segments: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False for "
            "tensors you register)"
        )
    return driver_call("cuIpcGetMemHandle", driver.ipc_export, alloc.base, alloc.device)


class Kernels:
    """The kernels of ``csrc/kernels`` loaded on one device (see :func:`kernels`)."""

    def __init__(self, device: int) -> None:
        driver.require_driver()
        image = driver.kernels_image()
        if image is None:
            raise BackendUnavailableError(
                "this build of transport has no CUDA kernels (nvcc was not found when it was built)"
            )
        self.device = device
        self.arches = driver.kernels_arches()
        try:
            self._module = driver.module_load(image, device)
        except driver.CudaError as exc:  # e.g. no code for this GPU, or PTX newer than the driver
            raise BackendUnavailableError(
                f"the kernels ({self.arches}) do not load on device {device}: {exc} "
                "(rebuild for this GPU or update the driver)"
            ) from exc
        self._functions: dict[str, int] = {}

    def launch(self, name: str, grid: driver.Dim3, block: driver.Dim3, params: bytes, stream: int,
               shared_bytes: int = 0) -> None:
        """Enqueues kernel ``name`` on ``stream`` (a CUstream handle, e.g.
        ``torch.cuda.current_stream().cuda_stream``); ``params`` are its arguments packed as the
        C ABI lays them out (:mod:`transport._native.kernels`).

        Raises:
            BackendUnavailableError: no usable CUDA driver.
            TransportInternalError: the driver refused the kernel or the launch.
        """
        f = self._functions.get(name)
        if f is None:
            f = self._functions[name] = driver_call(f"kernel {name}", driver.module_function, self._module, name,
                                                    self.device)
        driver_call(f"launch of {name}", driver.launch, f, grid, block, shared_bytes, stream, params, self.device)


_kernels_lock = threading.Lock()
_kernels: dict[int, Kernels] = {}


def kernels(device: int) -> Kernels:
    """The kernel module on ``device`` (loaded once per process and device).

    Raises:
        BackendUnavailableError: no driver, or a build without kernels.
    """
    with _kernels_lock:
        k = _kernels.get(device)
        if k is None:
            k = _kernels[device] = Kernels(device)
        return k


def stream_create(device: int) -> int:
    """A new CUstream on ``device``, non-blocking w.r.t. the legacy default stream and shared
    with nobody (torch's stream pool hands the same streams to everyone)."""
    return driver_call("cuStreamCreate", driver.stream_create, device)


def stream_destroy(stream: int, device: int) -> None:
    driver_call("cuStreamDestroy", driver.stream_destroy, stream, device)


def stream_synchronize(stream: int, device: int) -> None:
    """Blocks until the work queued on ``stream`` so far has run."""
    driver_call("cuStreamSynchronize", driver.stream_synchronize, stream, device)


def ready_event(t: torch.Tensor) -> Any:
    """A ``torch.cuda.Event`` recorded now on ``t``'s device's current stream: what a transfer
    of ``t`` waits for before touching it. Recorded by the transfer engine when a transfer
    starts (one per device it touches), and for a staging GPU buffer when it is allocated
    (``transport._staging``); nothing below records one for a transfer (``transport._pieces``)."""
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


def _raw_stream() -> Callable[[int], int]:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # a private torch call, ~10x cheaper
    if callable(raw):
        return raw
    return lambda device: int(torch.cuda.current_stream(device).cuda_stream)


_current_stream = functools.cache(_raw_stream)


def current_stream(device: int) -> int:
    """The CUstream handle of this thread's current torch stream on ``device``: what a copy
    enqueued now orders itself after (``CudaCopier.start(after=...)``)."""
    return _current_stream()(device)


class PinnedBuffer:
    """A page-locked host buffer from :class:`CudaCopier`'s staging pool."""

    def __init__(self, nbytes: int, device: int) -> None:
        self.tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.nbytes = nbytes
        self.address = self.tensor.data_ptr()
        driver_call("cuMemHostRegister", driver.host_register, self.address, self.tensor.numel(), False, device)
        self._device = device

    def free(self) -> None:
        driver_call("cuMemHostUnregister", driver.host_unregister, self.address, self._device)
