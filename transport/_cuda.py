"""CUDA memory: the driver, device identities, allocations, CUDA IPC, streams, pinned staging
and the kernel module: the policy (caches, pools, streams per device, torch's streams and events)
over the typed driver calls of :mod:`transport._native.cuda`.

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
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import anyio
import torch

from ._errors import BackendUnavailableError, TransportError, TransportInternalError
from ._native import cuda as driver
from ._native import kernels as abi
from ._native import pack_segments
from ._native.copy import Segment

_P = ParamSpec("_P")
_R = TypeVar("_R")

log = logging.getLogger(__name__)

IpcImportKey = tuple[str, str, bytes, int]  # a peer's IPC import: (peer, incarnation, handle, device)

# CudaCopier.copy_many moves this many ranges or more by one batched-copy kernel launch (when
# they are all memory of the copying device); fewer, one cuMemcpyAsync each.
KERNEL_MIN_COPIES = 16
# Pinned staging buffers are pooled up to this many bytes; beyond it they are freed on release.
STAGING_POOL_BYTES = 1 << 30
def unavailable_reason() -> str | None:
    """None when a CUDA driver with at least one device is usable here, else why not."""
    return driver.unavailable_reason()


def _call(what: str, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R:
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
    v = _call("cuDriverGetVersion", driver.driver_version)
    return f"{v // 1000}.{v % 1000 // 10}"


def device_count() -> int:
    return _call("cuDeviceGetCount", driver.device_count)


@functools.cache
def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device ``index`` ("GPU-..."): what identifies a GPU
    across processes, whose ordinals differ with ``CUDA_VISIBLE_DEVICES``."""
    return _call(f"cuDeviceGetUuid({index})", driver.device_uuid, index)


def device_name(index: int) -> str:
    return _call(f"cuDeviceGetName({index})", driver.device_name, index)


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
    base, size, device, ipc = _call(f"allocation of 0x{ptr:x}", driver.allocation, ptr, device)
    return Allocation(base, size, device, ipc)


def ipc_export(alloc: Allocation) -> bytes:
    """The 64-byte legacy CUDA IPC handle of ``alloc``."""
    if not alloc.ipc_capable:
        raise BackendUnavailableError(
            f"the allocation at 0x{alloc.base:x} cannot be exported with CUDA IPC (a VMM allocation, e.g. "
            "PyTorch's expandable segments: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False for "
            "tensors you register)"
        )
    return _call("cuIpcGetMemHandle", driver.ipc_export, alloc.base, alloc.device)


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
            f = self._functions[name] = _call(f"kernel {name}", driver.module_function, self._module, name, self.device)
        _call(f"launch of {name}", driver.launch, f, grid, block, shared_bytes, stream, params, self.device)


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


def launch_batched_copy_on(kernels: Kernels, stream: int, copies: Sequence[Segment]) -> torch.Tensor | None:
    """Enqueues one batched-copy launch of every (dst, src, nbytes) on ``stream`` (a CUstream
    handle of the kernels' device, e.g. a transport-owned one), with its segment table in pinned
    host memory, which the kernel reads through unified addressing: nothing runs on torch's
    streams. Returns the table (None: nothing to copy); keep it alive until ``stream`` has run
    the launch.

    Raises:
        TransportInternalError: the driver refused the launch.
    """
    table = abi.table_of(copies)
    if not table:
        return None
    host_table = torch.tensor(table, dtype=torch.int64).pin_memory()
    kernels.launch(abi.BATCHED_COPY, abi.grid_for(len(table), 1), abi.BLOCK,
                   abi.batched_copy_params(host_table.data_ptr(), len(table)), stream)
    return host_table


def stream_create(device: int) -> int:
    """A new CUstream on ``device``, non-blocking w.r.t. the legacy default stream and shared
    with nobody (torch's stream pool hands the same streams to everyone)."""
    return _call("cuStreamCreate", driver.stream_create, device)


def stream_destroy(stream: int, device: int) -> None:
    _call("cuStreamDestroy", driver.stream_destroy, stream, device)


def ready_event(t: torch.Tensor) -> Any:
    """A ``torch.cuda.Event`` recorded now on ``t``'s device's current stream: what a transfer
    of ``t`` waits for before touching it."""
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


# Legacy CUDA IPC opens a handle once per process and device (a second open of the same handle
# fails), so the imports of every CudaCopier in the process share one table:
# (handle, device) -> [address, number of copiers' imports using it].
_ipc_lock = threading.Lock()
_ipc_opened: dict[tuple[bytes, int], list[int]] = {}


def _ipc_open(handle: bytes, device: int, what: str) -> int:
    with _ipc_lock:
        hit = _ipc_opened.get((handle, device))
        if hit is None:
            hit = _ipc_opened[(handle, device)] = [_call(what, driver.ipc_open, handle, device), 0]
        hit[1] += 1
        return hit[0]


def _ipc_close(handle: bytes, device: int) -> None:
    with _ipc_lock:
        hit = _ipc_opened.get((handle, device))
        if hit is None:
            return
        hit[1] -= 1
        if hit[1] > 0:
            return
        del _ipc_opened[(handle, device)]
        driver.ipc_close(hit[0], device)


class PinnedBuffer:
    """A page-locked host buffer from :class:`CudaCopier`'s staging pool."""

    def __init__(self, nbytes: int, device: int) -> None:
        self.tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.nbytes = nbytes
        self.address = self.tensor.data_ptr()
        _call("cuMemHostRegister", driver.host_register, self.address, self.tensor.numel(), False, device)
        self._device = device

    def free(self) -> None:
        _call("cuMemHostUnregister", driver.host_unregister, self.address, self._device)


def _disjoint(copies: Sequence[Segment]) -> bool:
    """Whether no two (dst, src, nbytes) copies write the same byte."""
    ranges = sorted((d, d + n) for d, _s, n in copies if n)
    return all(prev[1] <= cur[0] for prev, cur in itertools.pairwise(ranges))


class CudaCopier:
    """One Transport's CUDA resources: a stream per device, a pool of done-events, pinned
    staging buffers, page-locked peer mappings, and CUDA IPC imports cached per peer."""

    def __init__(self) -> None:
        driver.require_driver()
        self._streams: dict[int, int] = {}
        self._events: dict[int, list[int]] = {}
        self._imports: dict[IpcImportKey, int] = {}  # (peer, incarnation, handle, device) -> address
        self._holds: dict[IpcImportKey, int] = {}  # imports in use by running copies
        self._closing: set[IpcImportKey] = set()  # forgotten while in use
        self._pinned_maps: dict[tuple[int, int], int] = {}  # (address, nbytes) -> device
        self._pin_refused: set[tuple[int, int]] = set()
        self._pinning: dict[tuple[int, int], anyio.Event] = {}  # registrations running on a worker thread
        self._pin_holds: dict[tuple[int, int], int] = {}  # ranges in use by running copies
        self._unpin_later: set[tuple[int, int]] = set()  # unpinned while in use
        self._staging: list[PinnedBuffer] = []
        self._lock = threading.Lock()  # events are returned from worker threads

    def _stream(self, device: int) -> int:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = _call("cuStreamCreate", driver.stream_create, device)
        return s

    def _event(self, device: int) -> int:
        with self._lock:
            pool = self._events.setdefault(device, [])
            if pool:
                return pool.pop()
        return _call("cuEventCreate", driver.event_create, device)

    async def copy(self, dst: int, src: int, nbytes: int, device: int, ready: Any = None) -> None:
        """Copies ``nbytes`` (device or host addresses) on this copier's stream for ``device``,
        after ``ready`` (a torch.cuda.Event or None), and returns once the copy is done.

        Cancellation: takes effect once the enqueued copy has finished on the device (it cannot
        be recalled), so no buffer is reused or freed under a running copy.
        """
        stream = self._stream(device)
        wait = int(ready.cuda_event) if ready is not None else 0

        def run() -> None:
            # Taken here, not before the await: a cancellation that stops the thread from
            # starting would otherwise lose the event.
            done = self._event(device)
            try:
                driver.copy_and_wait(dst, src, nbytes, stream, wait, done, device)
            finally:
                with self._lock:
                    self._events.setdefault(device, []).append(done)

        try:
            await anyio.to_thread.run_sync(run)
        except driver.CudaError as exc:
            what = f"CUDA copy of {nbytes} bytes 0x{src:x} -> 0x{dst:x} on device {device}"
            raise TransportInternalError(f"{what}: {exc}") from exc

    async def copy_many(self, copies: Sequence[Segment], device: int, *, kernel: bool = False,
                        ready: Sequence[Any] = ()) -> None:
        """Copies every (dst, src, nbytes) on this copier's stream for ``device`` and returns once
        all are done: one hand-off to a worker thread and one wait for the whole list, where
        :meth:`copy` costs one of each per range.

        Args:
            copies: (dst, src, nbytes) ranges of memory ``device`` can address; where
                destinations overlap, the later range wins.
            device: the device whose stream (and context) runs the copies.
            kernel: every range is memory of ``device`` itself (or pinned host memory): from
                ``KERNEL_MIN_COPIES`` ranges on, one launch of the batched copy kernel moves
                them all (when this build has the kernels; else one ``cuMemcpyAsync`` each).
            ready: ``torch.cuda.Event``s the copies wait for (on the device, not here).

        Raises:
            TransportInternalError: the driver refused a copy or the launch.

        Cancellation: as :meth:`copy`: once everything enqueued has finished on the device.
        """
        stream = self._stream(device)
        launcher = None
        # The kernel's blocks run in no order: overlapping destinations (a prepared get into
        # overlapping local views) go as the ordered list, where the last range wins.
        if kernel and len(copies) >= KERNEL_MIN_COPIES and _disjoint(copies):
            try:
                launcher = kernels(device)
            except BackendUnavailableError as exc:
                log.debug("batched copy kernel unavailable on device %d (%s): one cuMemcpyAsync per range",
                          device, exc)
        packed = b"" if launcher is not None else pack_segments(copies)
        waits = [int(ev.cuda_event) for ev in ready]

        def run() -> None:
            done = self._event(device)
            table = None
            try:
                for wait in waits:  # the stream waits for it (and this thread with it: nothing moves before)
                    driver.copy_list_and_wait(b"", stream, wait, done, device)
                if launcher is not None:
                    table = launch_batched_copy_on(launcher, stream, copies)
                driver.copy_list_and_wait(packed, stream, 0, done, device)  # empty: waits for the launch
            finally:
                del table  # the kernel has read it (or never ran)
                with self._lock:
                    self._events.setdefault(device, []).append(done)

        try:
            await anyio.to_thread.run_sync(run)
        except driver.CudaError as exc:
            raise TransportInternalError(f"CUDA copy of {len(copies)} ranges on device {device}: {exc}") from exc

    def acquire_ipc(self, peer: str, incarnation: str, handle: bytes, device: int) -> tuple[IpcImportKey, int]:
        """(import key, address in this process) of a peer's exported allocation, opened once
        per peer incarnation and device and held until :meth:`release_ipc`: a forgotten peer's
        import is closed only after the copies using it finished, never under a running copy."""
        key = (peer, incarnation, handle, device)
        ptr = self._imports.get(key)
        if ptr is None:
            ptr = self._imports[key] = _ipc_open(handle, device, f"opening {peer}'s CUDA IPC handle on device {device}")
        self._holds[key] = self._holds.get(key, 0) + 1
        return key, ptr

    def release_ipc(self, key: IpcImportKey) -> None:
        left = self._holds.get(key, 0) - 1
        if left > 0:
            self._holds[key] = left
            return
        self._holds.pop(key, None)
        if key in self._closing:
            self._closing.discard(key)
            self._close_import(key)

    def _close_import(self, key: IpcImportKey) -> None:
        if self._imports.pop(key, None) is not None:
            self._quietly(f"closing {key[0]}'s CUDA IPC import", _ipc_close, key[2], key[3])

    async def pin(self, address: int, nbytes: int, read_only: bool, device: int) -> tuple[int, int]:
        """Page-locks a host range once (e.g. this process's mapping of a peer's shared region),
        so device copies to and from it are DMA, not staged by the driver, and holds it for
        one copy: pass the returned key to :meth:`release_pin` once that copy finished (an
        :meth:`unpin` meanwhile waits for it). If the driver refuses, copies still work (the
        driver stages them); that is logged once.

        The registration (slow for a large range) runs on a worker thread. Cancellation: no
        hold is left behind; a registration under way completes and is kept.
        """
        key = (address, nbytes)
        self._pin_holds[key] = self._pin_holds.get(key, 0) + 1
        try:
            while (pending := self._pinning.get(key)) is not None:
                await pending.wait()
            if key not in self._pinned_maps and key not in self._pin_refused:
                self._pinning[key] = pending = anyio.Event()
                try:
                    await anyio.to_thread.run_sync(driver.host_register, address, nbytes, read_only, device)
                except driver.CudaError as exc:
                    self._pin_refused.add(key)
                    log.warning("cuda: could not page-lock a %d-byte peer mapping (%s); its copies go through "
                                "the driver's staging", nbytes, exc)
                else:
                    self._pinned_maps[key] = device
                finally:
                    del self._pinning[key]
                    pending.set()
        except BaseException:
            self.release_pin(key)
            raise
        return key

    def release_pin(self, key: tuple[int, int]) -> None:
        left = self._pin_holds.get(key, 0) - 1
        if left > 0:
            self._pin_holds[key] = left
            return
        self._pin_holds.pop(key, None)
        if key in self._unpin_later:
            self._unpin_later.discard(key)
            self.unpin(*key)

    def unpin(self, address: int, nbytes: int) -> None:
        """Undoes :meth:`pin` (call it before the range is unmapped); while a copy holds the
        range, once that copy finished, never under a running DMA."""
        key = (address, nbytes)
        if self._pin_holds.get(key):
            self._unpin_later.add(key)
            return
        self._pin_refused.discard(key)
        device = self._pinned_maps.pop(key, None)
        if device is not None:
            self._quietly("cuMemHostUnregister", driver.host_unregister, address, device)

    async def acquire_staging(self, nbytes: int, device: int) -> PinnedBuffer:
        """A pinned buffer of at least ``nbytes`` (reused from the pool when one fits; a new
        one is page-locked on a worker thread)."""
        with self._lock:
            fits = [b for b in self._staging if b.nbytes >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.nbytes)
                self._staging.remove(best)
                return best
        size = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
        return await anyio.to_thread.run_sync(PinnedBuffer, size, device)

    def release_staging(self, buf: PinnedBuffer) -> None:
        with self._lock:
            if sum(b.nbytes for b in self._staging) + buf.nbytes <= STAGING_POOL_BYTES:
                self._staging.append(buf)
                return
        self._quietly("cuMemHostUnregister", buf.free)

    def forget_peer(self, peer: str) -> None:
        """Closes the IPC imports of every incarnation of ``peer`` (those in use by a copy once
        it finished)."""
        for key in [k for k in self._imports if k[0] == peer]:
            if self._holds.get(key):
                self._closing.add(key)
            else:
                self._close_import(key)

    def close(self) -> None:
        # Called once every transfer has finished: nothing holds an import any more.
        for key in list(self._imports):
            self._close_import(key)
        self._holds.clear()
        self._closing.clear()
        self._pin_holds.clear()
        self._unpin_later.clear()
        for address, nbytes in list(self._pinned_maps):
            self.unpin(address, nbytes)
        for buf in self._staging:
            self._quietly("cuMemHostUnregister", buf.free)
        self._staging.clear()
        for device, events in self._events.items():
            for e in events:
                self._quietly("cuEventDestroy", driver.event_destroy, e, device)
        self._events.clear()
        for device, s in self._streams.items():
            self._quietly("cuStreamDestroy", driver.stream_destroy, s, device)
        self._streams.clear()

    def _quietly(self, what: str, fn: Callable[_P, None], *args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except TransportError as exc:  # releasing must not fail a close; say it happened
            log.warning("cuda: %s failed: %s", what, exc)
