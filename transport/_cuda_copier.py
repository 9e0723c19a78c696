"""One Transport's CUDA copies (:class:`CudaCopier`): jobs enqueued on the calling thread and
their ends learnt from the native CUDA copy engine (:class:`transport._native.cuda.CudaEngine`),
laid-out batches of many ranges, and what copies hold while they run: a stream per device, peers'
CUDA IPC imports, page-locked peer mappings and pinned staging buffers. The CUDA policy under it
(devices, allocations, kernels, streams) is :mod:`transport._cuda`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec

import anyio
import torch
from anyio.abc import TaskStatus

from ._background import start_background
from ._cuda import Kernels, PinnedBuffer, driver_call, kernels
from ._errors import BackendUnavailableError, TransportError, TransportInternalError
from ._native import cuda as driver
from ._native import kernels as abi
from ._native import pack_segments
from ._native.copy import Segment

_P = ParamSpec("_P")

log = logging.getLogger(__name__)

IpcImportKey = tuple[str, str, bytes, int]  # a peer's IPC import: (peer, incarnation, handle, device)

# A DeviceBatch of this many ranges or more, of at most KERNEL_MAX_MEAN_BYTES each on average, is
# moved by one batched-copy kernel launch (when they are all memory of the copying device): many
# small ranges cost one launch instead of a cuMemcpyAsync each. Fewer or larger ones (a state
# dict's tensors) go one cuMemcpyAsync each, which moves a large range at the device's copy rate.
KERNEL_MIN_COPIES = 16
KERNEL_MAX_MEAN_BYTES = 1 << 20
# Pinned staging buffers are pooled up to this many bytes; beyond it they are freed on release.
STAGING_POOL_BYTES = 1 << 30
# How long the thread that enqueues a device copy polls its end before leaving it to the engine's
# reaper (CudaEngine.submit): the copy's expected time by these rates, times SPIN_SLACK plus
# SPIN_BASE_S, when that expected time is at most SPIN_MAX_S; a longer copy is not polled at all.
# The event loop is held meanwhile (the GIL is not), as it is for a small synchronous host copy.
# The rates are low for an H100/H200 (device copy ~1.4-2 TB/s, pinned host ~55 GB/s): a copy
# that ends sooner than estimated ends the poll sooner.
DEVICE_RATE = 1e12  # bytes/s, device to device
HOST_RATE = 2e10  # bytes/s, with host memory on one side
SPIN_MAX_S = 250e-6
SPIN_BASE_S = 50e-6
SPIN_SLACK = 3.0


def spin_for(nbytes: int, host: bool) -> float:
    """Seconds to poll a just-enqueued copy of ``nbytes`` on the enqueueing thread (see
    ``SPIN_MAX_S``): 0 for a copy expected to take longer than that."""
    expected = nbytes / (HOST_RATE if host else DEVICE_RATE)
    return 0.0 if expected > SPIN_MAX_S else min(SPIN_MAX_S, SPIN_SLACK * expected + SPIN_BASE_S)


# Legacy CUDA IPC opens a handle once per process and device (a second open of the same handle
# fails), so the imports of every CudaCopier in the process share one table:
# (handle, device) -> [address, number of copiers' imports using it].
_ipc_lock = threading.Lock()
_ipc_opened: dict[tuple[bytes, int], list[int]] = {}


def _ipc_open(handle: bytes, device: int, what: str) -> int:
    with _ipc_lock:
        hit = _ipc_opened.get((handle, device))
        if hit is None:
            hit = _ipc_opened[(handle, device)] = [driver_call(what, driver.ipc_open, handle, device), 0]
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


def _disjoint(copies: Sequence[Segment]) -> bool:
    """Whether no two (dst, src, nbytes) copies write the same byte."""
    ranges = sorted((d, d + n) for d, _s, n in copies if n)
    return all(prev[1] <= cur[0] for prev, cur in itertools.pairwise(ranges))


class DeviceCopy:
    """One job of device copies, enqueued (see :meth:`CudaCopier.start`): ended already when
    its enqueueing thread saw it end, else running until :meth:`wait` learns its end."""

    __slots__ = ("_engine", "_job", "_result", "_what")

    def __init__(self, engine: driver.CudaEngine, job: int, result: driver.JobResult | None, what: str) -> None:
        self._engine = engine
        self._job = job
        self._result = result
        self._what = what

    def done(self) -> bool:
        """Whether the copies are known to have ended (:meth:`wait` then returns at once)."""
        return self._result is not None

    def check(self) -> None:
        """Raises what an ended job failed with (see :meth:`wait`)."""
        r = self._result
        if r is not None and not r.ok:
            raise TransportInternalError(f"{self._what}: {r.message}")

    async def wait(self) -> None:
        """Returns once the copies have ended on the device.

        Raises:
            TransportInternalError: the driver refused a copy (those before it ran) or the device
                failed running them (the message names the call and the driver's error).

        Cancellation: the copies cannot be recalled: this returns (re-raising the cancellation)
        only once they have ended, so no memory is freed or reused under them.
        """
        if self._result is None:
            self._result = await self._engine.wait(self._job)
        self.check()


class DeviceBatch:
    """Copies of one device laid out once for repeated runs (see :meth:`CudaCopier.batch`): one
    launch of the batched-copy kernel over a pinned table, or the packed list for one
    ``cuMemcpyAsync`` each."""

    __slots__ = ("_grid", "_kernels", "_packed", "_params", "_table", "device", "nbytes", "segments")

    def __init__(self, copies: Sequence[Segment], device: int, launcher: Kernels | None) -> None:
        self.device = device
        self.segments = sum(1 for c in copies if c[2])
        self.nbytes = sum(c[2] for c in copies)
        self._kernels = launcher
        self._packed = b""
        self._table: torch.Tensor | None = None
        self._params = b""
        self._grid: driver.Dim3 = (1, 1, 1)
        if launcher is None:
            self._packed = pack_segments(copies)
            return
        table = abi.table_of(copies)
        if table:
            # Read by the kernel through unified addressing, so it lives in pinned host memory,
            # written once: a start costs one launch, not a table.
            self._table = torch.tensor(table, dtype=torch.int64).pin_memory()
            self._params = abi.batched_copy_params(self._table.data_ptr(), len(table))
            self._grid = abi.grid_for(len(table), 1)

    def launch(self, stream: int) -> None:
        """Enqueues the kernel over the table on ``stream`` (nothing without a kernel or copies)."""
        if self._kernels is not None and self._table is not None:
            self._kernels.launch(abi.BATCHED_COPY, self._grid, abi.BLOCK, self._params, stream)

    @property
    def packed(self) -> bytes:
        """The packed list for ``cuMemcpyAsync`` (empty when the kernel moves the copies)."""
        return self._packed


def _release_all(releases: list[Callable[[], None]], holds: list[object]) -> None:
    """Runs every release (page-locked memory is slow to unlock: ~ms per 100 MiB), then lets go
    of ``holds``, the mappings that must stay mapped until their memory is unlocked."""
    for release in releases:
        try:
            release()
        except TransportError as exc:  # releasing must not fail anything; say it happened
            log.warning("cuda: releasing page-locked memory failed: %s", exc)
    holds.clear()


class CudaCopier:
    """One Transport's CUDA resources: the copy engine, a stream per device, pinned staging
    buffers, page-locked peer mappings, and CUDA IPC imports cached per peer.

    Copies are enqueued on the calling thread (:meth:`start`) and their ends learnt from the
    engine: polled right after the enqueue when they are short, else reaped by its native
    thread and delivered by :meth:`run`, which must run in a task group of the Transport's
    that outlives every transfer. :meth:`close` runs once every transfer has ended.

    Raises:
        BackendUnavailableError: no usable CUDA driver.
    """

    def __init__(self) -> None:
        driver.require_driver()
        self._engine = driver.CudaEngine()
        self._streams: dict[int, int] = {}
        self._imports: dict[IpcImportKey, int] = {}  # (peer, incarnation, handle, device) -> address
        self._holds: dict[IpcImportKey, int] = {}  # imports in use by running copies
        self._closing: set[IpcImportKey] = set()  # forgotten while in use
        self._pinned_maps: dict[tuple[int, int], int] = {}  # (address, nbytes) -> device
        self._pin_refused: set[tuple[int, int]] = set()
        self._pinning: dict[tuple[int, int], anyio.Event] = {}  # registrations running on a worker thread
        self._pin_holds: dict[tuple[int, int], int] = {}  # ranges in use by running copies
        self._unpin_later: dict[tuple[int, int], object] = {}  # unpinned while in use -> what to keep mapped
        self._staging: list[PinnedBuffer] = []
        self._lock = threading.Lock()  # the staging pool is used from worker threads

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Delivers the ends of copies that were not seen to end when enqueued, until cancelled."""
        await self._engine.run(task_status=task_status)

    def stream(self, device: int) -> int:
        """This copier's stream on ``device`` (created on first use)."""
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = driver_call("cuStreamCreate", driver.stream_create, device)
        return s

    def start(self, device: int, packed: bytes, *, nbytes: int, host: bool, after: Sequence[driver.StreamRef] = (),
              ready: Sequence[Any] = (), spin: bool = True, what: str = "") -> DeviceCopy:
        """Enqueues the packed ``(dst, src, nbytes)`` copies (:func:`transport._native.pack_segments`)
        on this copier's stream for ``device``, right here: after the work queued so far on each
        ``after`` stream (``(device, CUstream)``, e.g. :func:`current_stream`'s) and after each
        ``torch.cuda.Event`` of ``ready``; then, with ``spin``, polls their end for as long as
        ``nbytes`` is expected to take (:func:`spin_for`; ``host``: host memory on one side).
        Callable from a worker thread (with ``spin=False``) when a side is pageable host memory,
        whose copy the driver stages synchronously.

        Returns:
            The job: :meth:`DeviceCopy.wait` must follow before its memory is reused.

        Raises:
            TransportInternalError: nothing was enqueued (the driver refused a wait, the event,
                or the engine is closed).
        """
        label = what or f"CUDA copy of {nbytes} bytes on device {device}"
        spin_s = spin_for(nbytes, host) if spin else 0.0
        events = [int(ev.cuda_event) for ev in ready]
        try:
            job, result = self._engine.submit(device, self.stream(device), packed, after=after, events=events,
                                              spin_s=spin_s)
        except driver.CudaError as exc:
            raise TransportInternalError(f"{label}: {exc}") from exc
        return DeviceCopy(self._engine, job, result, label)

    async def copy(self, dst: int, src: int, nbytes: int, device: int, ready: Any = None, *, host: bool = True,
                   pageable: bool = False) -> None:
        """Copies ``nbytes`` (device or host addresses) on this copier's stream for ``device``,
        after ``ready`` (a torch.cuda.Event or None), and returns once the copy is done.

        Args:
            host: host memory is on one side (the copy's expected time, for polling it).
            pageable: a side is pageable host memory: the driver copies it synchronously
                through its own staging, so the enqueue runs on a worker thread.

        Raises:
            TransportInternalError: the driver refused or failed the copy.

        Cancellation: takes effect once the enqueued copy has finished on the device (it cannot
        be recalled), so no buffer is reused or freed under a running copy.
        """
        packed = pack_segments([(dst, src, nbytes)])
        ready_list = () if ready is None else (ready,)
        what = f"CUDA copy of {nbytes} bytes 0x{src:x} -> 0x{dst:x} on device {device}"
        if pageable:
            with anyio.CancelScope(shield=True):  # once enqueued, the job must be waited for
                job = await anyio.to_thread.run_sync(functools.partial(
                    self.start, device, packed, nbytes=nbytes, host=True, ready=ready_list, spin=False, what=what))
        else:
            job = self.start(device, packed, nbytes=nbytes, host=host, ready=ready_list, what=what)
        await job.wait()

    def batch(self, copies: Sequence[Segment], device: int, *, kernel: bool) -> DeviceBatch:
        """Lays out ``copies`` (``(dst, src, nbytes)`` of memory ``device`` can address; where
        destinations overlap, the later range wins) for :meth:`start_batch`, once.

        Args:
            kernel: every range is memory of ``device`` itself (or pinned host memory): from
                ``KERNEL_MIN_COPIES`` disjoint ranges of ``KERNEL_MAX_MEAN_BYTES`` or less on
                average, one launch of the batched copy kernel moves them all (when this build
                has the kernels; else one ``cuMemcpyAsync`` each).
        """
        launcher = None
        # The kernel's blocks run in no order: overlapping destinations (a prepared get into
        # overlapping local views) go as the ordered list, where the last range wins.
        n = len(copies)
        many_small = n >= KERNEL_MIN_COPIES and sum(c[2] for c in copies) <= KERNEL_MAX_MEAN_BYTES * n
        if kernel and many_small and _disjoint(copies):
            try:
                launcher = kernels(device)
            except BackendUnavailableError as exc:
                log.debug("batched copy kernel unavailable on device %d (%s): one cuMemcpyAsync per range",
                          device, exc)
        return DeviceBatch(copies, device, launcher)

    def start_batch(self, batch: DeviceBatch, *, after: Sequence[driver.StreamRef] = (),
                    ready: Sequence[Any] = ()) -> DeviceCopy:
        """Enqueues ``batch`` as :meth:`start` does (its kernel, or its list).

        Raises:
            TransportInternalError: the driver refused a wait, the launch or the event (once a
                launch is enqueued, the job exists and reports a failure through its wait).
        """
        device, stream = batch.device, self.stream(batch.device)
        what = f"CUDA copy of {batch.segments} ranges ({batch.nbytes} bytes) on device {device}"
        if not batch.packed:  # the kernel: its waits first, then the launch, then the job's event
            try:
                self._engine.order(device, stream, after, [int(ev.cuda_event) for ev in ready])
            except driver.CudaError as exc:
                raise TransportInternalError(f"{what}: {exc}") from exc
            batch.launch(stream)
            after, ready = (), ()
        return self.start(device, batch.packed, nbytes=batch.nbytes, host=False, after=after, ready=ready, what=what)

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

    def pinned(self, address: int, nbytes: int) -> bool:
        """Whether the host range was page-locked by :meth:`pin` (and is not being unpinned)."""
        key = (address, nbytes)
        return key in self._pinned_maps and key not in self._unpin_later

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

    def hold_pin(self, key: tuple[int, int]) -> None:
        """Holds an already page-locked range (see :meth:`pinned`) for one copy, as :meth:`pin`."""
        self._pin_holds[key] = self._pin_holds.get(key, 0) + 1

    def release_pin(self, key: tuple[int, int]) -> None:
        left = self._pin_holds.get(key, 0) - 1
        if left > 0:
            self._pin_holds[key] = left
            return
        self._pin_holds.pop(key, None)
        if key in self._unpin_later:
            self.unpin(*key, hold=self._unpin_later.pop(key))

    def unpin(self, address: int, nbytes: int, *, hold: object = None) -> None:
        """Undoes :meth:`pin`: while a copy holds the range, once that copy finished, never under
        a running DMA. The unlocking runs on a background thread (it takes ~ms per 100 MiB);
        ``hold`` (the mapping of the range) is kept referenced, so mapped, until it is done."""
        key = (address, nbytes)
        if self._pin_holds.get(key):
            self._unpin_later[key] = hold
            return
        self._pin_refused.discard(key)
        device = self._pinned_maps.pop(key, None)
        if device is not None:
            release = functools.partial(driver_call, "cuMemHostUnregister", driver.host_unregister, address, device)
            start_background(functools.partial(_release_all, [release], [hold]))

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
        start_background(functools.partial(_release_all, [buf.free], [buf]))

    def forget_peer(self, peer: str) -> None:
        """Closes the IPC imports of every incarnation of ``peer`` (those in use by a copy once
        it finished)."""
        for key in [k for k in self._imports if k[0] == peer]:
            if self._holds.get(key):
                self._closing.add(key)
            else:
                self._close_import(key)

    def close(self) -> None:
        """Releases everything; called once every transfer has ended (no copy runs). Returns at
        once: page-locked memory is unlocked on a background thread."""
        self._engine.close()
        for key in list(self._imports):
            self._close_import(key)
        self._holds.clear()
        self._closing.clear()
        self._pin_holds.clear()
        releases: list[Callable[[], None]] = []
        holds: list[object] = [*self._unpin_later.values(), *self._staging]
        self._unpin_later.clear()
        for (address, _nbytes), device in self._pinned_maps.items():
            releases.append(functools.partial(driver_call, "cuMemHostUnregister", driver.host_unregister, address,
                                              device))
        releases += [buf.free for buf in self._staging]
        self._pinned_maps.clear()
        self._pin_refused.clear()
        self._staging.clear()
        if releases:
            start_background(functools.partial(_release_all, releases, holds))
        for device, s in self._streams.items():
            self._quietly("cuStreamDestroy", driver.stream_destroy, s, device)
        self._streams.clear()

    def _quietly(self, what: str, fn: Callable[_P, None], *args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except TransportError as exc:  # releasing must not fail a close; say it happened
            log.warning("cuda: %s failed: %s", what, exc)
