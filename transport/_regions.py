"""Registered regions: the local table, and the one rule every transfer is checked against.

:func:`check` is used by both ends of a transfer: the initiator checks against the region as
its peer published it (before any byte moves), the target against its own live registration
(before it lets any byte in). Same rule, same words.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import torch

from . import _cuda, _native
from ._errors import (
    BackendUnavailableError,
    BoundsError,
    DTypeMismatchError,
    ReadOnlyRegionError,
    RegistrationError,
    TransportError,
)
from ._tensors import MemoryKind, byte_view, check_tensor, dtype_from_name, dtype_name, memory_kind, nbytes_of
from ._wire import RegionRecord, TransferOp

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Region:
    """A local tensor exposed to remote ``put``/``get`` under ``key``.

    The Transport keeps a reference to ``tensor`` while it is registered; its memory must not be
    resized or freed by other means in that time. ``shared`` is the library-owned shareable
    buffer the tensor lives in, when it was allocated with :meth:`Transport.empty`.
    """

    key: str
    tensor: torch.Tensor
    writable: bool
    shared: Any = None  # the native shareable buffer it lives in, if any
    device: str = "cpu"  # "cpu" or "cuda:<GPU UUID>" (as published in the peer record)
    view: memoryview | None = field(init=False, repr=False)  # the bytes, for host memory only
    # Backends' per-registration state (e.g. an exported CUDA IPC descriptor): it lives and dies
    # with this registration, so a later tensor at the same address never inherits it.
    backend_state: dict[str, Any] = field(default_factory=dict, repr=False)
    # The memory as registered, to notice a tensor whose storage was replaced (``set_``) or
    # resized since. Holding the storage also keeps the registered memory alive meanwhile, so
    # a one-sided peer that has not yet heard of the change never writes into freed memory.
    _storage: Any = field(init=False, repr=False)
    _memory: tuple[int, int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.view = byte_view(self.tensor) if self.tensor.device.type == "cpu" else None
        self._storage = self.tensor.untyped_storage()
        self._memory = self._current_memory()

    def _current_memory(self) -> tuple[int, int, int]:
        t = self.tensor
        return (t.data_ptr(), nbytes_of(t), t.untyped_storage().data_ptr())

    def moved(self) -> str | None:
        """Why the tensor no longer lives in the memory it was registered with, or None."""
        now = self._current_memory()
        if now == self._memory:
            return None
        was_ptr, was_nbytes, _ = self._memory
        return (f"the tensor registered as {self.key!r} was given new storage after registration "
                f"({was_nbytes} bytes at {was_ptr:#x}, now {now[1]} bytes at {now[0]:#x}; e.g. by "
                "set_(), resize_() or an optimizer that replaces .data): register it again")

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.tensor)

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    def record(self, descriptors: Mapping[str, bytes]) -> RegionRecord:
        return RegionRecord(
            key=self.key,
            dtype=dtype_name(self.dtype),
            shape=tuple(self.tensor.shape),
            nbytes=self.nbytes,
            writable=self.writable,
            descriptors=dict(descriptors),
            device=self.device,
            moved=self.moved() or "",
        )


def check(
    op: TransferOp,
    owner: str,
    key: object,
    region: RegionRecord | Region | None,
    dtype: object,
    offset: object,
    nbytes: object,
    *,
    known: Collection[str] = (),
) -> None:
    """The one rule for a transfer of ``nbytes`` ``dtype`` bytes at byte ``offset`` of
    ``owner``'s region ``key`` (``region``, or None when ``owner`` has no such key).

    Every argument but ``op`` and ``owner`` may come off the wire, so each is type-checked.
    It runs for every transfer: nothing is formatted unless it fails.

    Raises:
        RegistrationError: no such region (``known``: keys it does have, for the message), or
            its owner reports that the tensor behind it moved.
        DTypeMismatchError: ``dtype`` is not the region's.
        BoundsError: the range is negative, outside the region, or not element-aligned.
        ReadOnlyRegionError: a put into a region registered read-only.
    """

    def refuse(error: type[TransportError], why: str) -> TransportError:
        return error(f"{op.value} of {nbytes} bytes at offset {offset} of {owner}:{key!r}: {why}")

    if region is None:
        has = f" (it has: {', '.join(sorted(known)[:8])})" if known else ""
        raise refuse(RegistrationError, f"{owner} has no region {key!r}{has}")
    if isinstance(region, RegionRecord) and region.moved:
        raise refuse(RegistrationError, f"{owner} reports: {region.moved}")
    region_dtype = region.dtype if isinstance(region.dtype, str) else dtype_name(region.dtype)
    if dtype != region_dtype:
        raise refuse(DTypeMismatchError, f"the data is {dtype} but the region is {region_dtype}")
    if type(offset) is not int or type(nbytes) is not int:  # bool is no byte count either
        raise refuse(BoundsError, "offset and size must be integers")
    if offset < 0 or nbytes < 0 or offset + nbytes > region.nbytes:
        raise refuse(BoundsError, f"exceeds its {region.nbytes} bytes")
    itemsize = dtype_from_name(region_dtype).itemsize
    if offset % itemsize:
        raise refuse(BoundsError, f"offset is not a multiple of the {region_dtype} element size {itemsize}")
    if op == TransferOp.PUT and not region.writable:
        raise refuse(ReadOnlyRegionError, f"{owner}:{key!r} is read-only")


class RegionObserver(Protocol):
    """What follows this table's changes (a backend's target side, see ``Backend``)."""

    def region_added(self, region: Region) -> None: ...

    def region_removed(self, region: Region) -> None: ...

    def region_moved(self, key: str) -> None: ...


class Describer(Protocol):
    """What builds a region's published descriptors: a backend."""

    @property
    def name(self) -> str: ...

    def region_descriptor(self, region: Region) -> bytes | None: ...


class RegionTable:
    """The regions one Transport has registered, by key, and the shareable buffers behind them.

    Args:
        owner: the Transport's name (for messages).
        device_kinds: whether a backend that serves device memory runs here (a CUDA tensor can
            only be registered then).
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._regions: dict[str, Region] = {}
        self._by_memory: dict[tuple[int, int, torch.dtype], str] = {}
        self._reported: set[str] = set()  # keys whose moved storage was already warned about
        self._shared: list[Any] = []  # buffers allocated by allocate()
        self._observers: list[RegionObserver] = []  # told of every change (backends' target sides)

    def __iter__(self) -> Iterator[Region]:
        return iter(list(self._regions.values()))

    def __len__(self) -> int:
        return len(self._regions)

    def get(self, key: object) -> Region | None:
        return self._regions.get(key) if isinstance(key, str) else None

    def check(self, op: TransferOp, key: object, dtype: object, offset: object, nbytes: object) -> Region:
        """The live region a peer's request may touch, after :func:`check` (the target side).

        Raises:
            As :func:`check`; RegistrationError also when the tensor's storage moved since it
            was registered.
        """
        region = self.get(key)
        check(op, self.owner, key, region, dtype, offset, nbytes)
        assert region is not None  # check() refuses a missing region
        if (why := region.moved()) is not None:
            raise RegistrationError(f"{op.value} into {self.owner}:{key!r} refused: {why}")
        return region

    def moved(self) -> dict[str, str]:
        """Every region whose tensor's storage moved since registration: key -> why."""
        return {r.key: why for r in self._regions.values() if (why := r.moved()) is not None}

    def notice_moved(self, republish: Callable[[], None]) -> None:
        """Looks for registered tensors whose storage moved (``set_``, ``resize_``) and calls
        ``republish`` when new ones did, so that the published record marks them moved and
        peers' transfers into them fail with RegistrationError instead of landing in the old
        memory (which the registration keeps alive until then)."""
        moved = self.moved()
        if fresh := moved.keys() - self._reported:
            for key in fresh:
                log.warning("transport %s: %s", self.owner, moved[key])
                for o in self._observers:
                    o.region_moved(key)
            republish()
        self._reported = set(moved)

    async def watch(self, interval: float, republish: Callable[[], None]) -> None:
        """:meth:`notice_moved` every ``interval`` seconds (the Transport also calls it at its
        owner's calls that are not transfers). Runs until cancelled."""
        while True:
            await anyio.sleep(interval)
            self.notice_moved(republish)

    def as_dict(self) -> dict[str, Region]:
        return dict(self._regions)

    def key_of(self, tensor: torch.Tensor) -> str | None:
        """The key ``tensor`` (its exact memory and dtype) is registered under, or None.

        Raises:
            RegistrationError: ``tensor`` itself is registered, but its storage moved since.
        """
        key = self._by_memory.get((tensor.data_ptr(), nbytes_of(tensor), tensor.dtype))
        if key is None:
            for region in self._regions.values():
                if region.tensor is tensor and (why := region.moved()) is not None:
                    raise RegistrationError(why)
        return key

    def prepare(self, tensors: Mapping[str, torch.Tensor], prefix: str, writable: bool,
                serves_device: bool, backends: Sequence[str]) -> dict[str, Region]:
        """Validates and builds the regions for ``tensors`` without adding them.

        Raises:
            RegistrationError, BackendUnavailableError: as ``Transport.register``; nothing changes.
        """
        new: dict[str, Region] = {}
        for k, t in tensors.items():
            key = prefix + k if isinstance(k, str) else k
            if key in new:
                raise RegistrationError(f"key {key!r} appears twice")
            new[key] = self._new_region(key, t, writable, serves_device, backends)
        return new

    def _new_region(self, key: object, tensor: torch.Tensor, writable: bool, serves_device: bool,
                    backends: Sequence[str]) -> Region:
        if not isinstance(key, str) or not key:
            raise RegistrationError(f"region key must be a non-empty string, got {key!r}")
        if key in self._regions:
            raise RegistrationError(f"{self.owner}: key {key!r} is already registered; unregister it first")
        check_tensor(tensor, f"tensor for {key!r}")
        kind = memory_kind(tensor, f"tensor for {key!r}")
        if not tensor.is_contiguous():
            raise RegistrationError(f"{key!r}: only contiguous tensors can be registered (call .contiguous() first)")
        if kind == MemoryKind.CUDA:
            if (why := _cuda.unavailable_reason()) is not None:
                raise BackendUnavailableError(f"cannot register the {tensor.device} tensor {key!r}: {why}")
            if not serves_device:
                raise BackendUnavailableError(
                    f"cannot register the {tensor.device} tensor {key!r}: none of {tuple(backends)} serves device "
                    "memory (ipc and nccl do)"
                )
            return Region(key, tensor, bool(writable), device=_cuda.device_label(tensor.device.index))
        shared = None
        for buf in self._shared:
            if buf.address <= tensor.data_ptr() and tensor.data_ptr() + nbytes_of(tensor) <= buf.address + buf.nbytes:
                shared = buf
        return Region(key, tensor, bool(writable), shared)

    def observe(self, observer: RegionObserver) -> None:
        """Tells ``observer`` of every region added, removed or moved from now on."""
        self._observers.append(observer)

    def add(self, regions: Mapping[str, Region]) -> None:
        for region in regions.values():
            self._regions[region.key] = region
            self._by_memory.setdefault((region.address, region.nbytes, region.dtype), region.key)
            for o in self._observers:
                o.region_added(region)

    def remove(self, key: str) -> Region:
        """Withdraws ``key``.

        Raises:
            RegistrationError: ``key`` is not registered.
        """
        region = self._regions.pop(key, None) if isinstance(key, str) else None
        if region is None:
            raise RegistrationError(f"{self.owner}: no region {key!r} to unregister")
        mem = (region.address, region.nbytes, region.dtype)
        if self._by_memory.get(mem) == key:
            del self._by_memory[mem]
        for o in self._observers:
            o.region_removed(region)
        if region.shared is not None and all(r.shared is not region.shared for r in self._regions.values()):
            # The memory itself lives as long as the tensors over it; we only stop tracking it.
            self._shared = [b for b in self._shared if b is not region.shared]
        return region

    def allocate(self, key: str, shape: Sequence[int] | int, dtype: torch.dtype, *,
                 writable: bool = True) -> torch.Tensor:
        """A zeroed, shareable, pre-faulted host tensor for ``key`` (not yet registered).
        ``writable=False`` seals its memfd at creation: no other process can ever map it
        writable or write it through the file (this process's own mapping stays writable).

        Raises:
            RegistrationError: the allocation failed.
        """
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        try:
            dims = (operator.index(shape),) if not isinstance(shape, Sequence) else tuple(map(operator.index, shape))
        except TypeError:
            raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
        if any(d < 0 for d in dims):
            raise ValueError(f"shape must not have negative sizes, got {dims}")
        numel = 1
        for s in dims:
            numel *= s
        nbytes = numel * dtype.itemsize
        try:
            buf = _native.shared_buffer(nbytes, f"transport:{self.owner}:{key}", read_only=not writable)
        except RuntimeError as exc:
            raise RegistrationError(f"cannot allocate {nbytes} shareable bytes for {key!r}: {exc}") from exc
        self._shared.append(buf)
        return torch.from_dlpack(buf.array()).view(dtype).view(dims)

    def records(self, describers: Sequence[Describer]) -> dict[str, RegionRecord]:
        """Every region as published, with each backend's descriptor for it."""
        out = {}
        for key, region in self._regions.items():
            descs = {}
            for b in describers:
                d = b.region_descriptor(region)
                if d is not None:
                    descs[b.name] = d
            out[key] = region.record(descs)
        return out

    def clear(self) -> None:
        """Forgets every region (the Transport closed; its backends are closed)."""
        self._regions.clear()
        self._by_memory.clear()
        self._observers.clear()
