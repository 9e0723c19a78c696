"""Weight sync: a ``Publisher`` on the trainer, a ``Subscriber`` on each generator.

After every optimizer step the trainer calls ``await publisher.publish(version)``; every
subscribed generator receives the whole state dict **independently and concurrently**, and
applies it between its own generation steps with ``subscriber.apply()``. Nothing is collective:
generators subscribe and leave at any time (through the rendezvous), a slow or dead generator
is reported as a straggler after ``deadline`` seconds and never delays the others, and a
generator that joins late (or restarts) catches up with ``await subscriber.pull()``.

How a version travels, and why it is never torn:

* The publisher packs the state dict (after ``rename``/``include``/``fp8`` hooks) into one of
  two **snapshot** buffers, guarded by a per-slot generation counter (a seqlock), and publishes
  the layout (names, shapes, dtypes, byte offsets, buckets) as a read-only region.
* Each subscriber registers two **slots** of the packed size and a small control block. The
  publisher writes a version into the slot the subscriber is *not* about to read, bucket by
  bucket (many tensors per transfer, at most ``max_inflight`` transfers in flight per
  subscriber), and only when every byte is in the subscriber's memory does it write the slot's
  number and the version into the control block (the *front*) and ring a doorbell signal.
* ``apply()`` announces which slot it is reading in the control block, re-checks the front (the
  classic two-flag handshake, with memory fences on both sides), and copies that slot into the
  model. The publisher never writes the slot a subscriber has announced; if the subscriber is
  still reading it, the publisher waits (at most until the deadline).
* ``pull()`` reads the publisher's current snapshot one-sidedly and keeps it only if the slot's
  generation counter did not move during the read.

Memory: the publisher holds two packed copies of the (converted) weights, each subscriber two
packed slots; nothing else grows with the model or the number of subscribers.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import anyio
import torch

from . import _cuda, _kernels
from ._errors import BackendUnavailableError, TransferTimeoutError, TransportError
from ._transport import Transport
from ._wire import PeerRecord
from ._weights_layout import Entry, Layout, LayoutMismatchError, build_layout, describe

__all__ = ["Publisher", "Subscriber", "PublishReport", "SyncResult", "SyncStatus", "LayoutMismatchError"]

log = logging.getLogger(__name__)

# Control blocks are int64[8]. A "front" word encodes (version, slot) as ((version << 2) | slot) + 1
# so that 0 means "nothing yet" and one aligned 8-byte store publishes both at once.
# Subscriber control block: _READING is the slot being read (copy mode: while applying;
# zero-copy mode: the slot the model lives in), _TRYING the slot a zero-copy apply is claiming.
_FRONT, _READING, _APPLIED, _LAYOUT_ID, _TRYING = 0, 1, 2, 3, 4
_GEN0 = 4  # publisher control block: _FRONT, _LAYOUT_ID, and per-slot generations at 4 and 5
_CTL_WORDS = 8
_POLL_S = 0.002


def _encode_front(version: int, slot: int) -> int:
    return ((version << 2) | slot) + 1  # two bits of slot: copy mode has 2 slots, zero-copy 3


def _decode_front(word: int) -> tuple[int, int] | None:
    if word <= 0:
        return None
    word -= 1
    return word >> 2, word & 3


def _free_slot(ctl: torch.Tensor, nslots: int) -> int | None:
    """A subscriber slot the publisher may write: not the front (the newest complete version,
    which the subscriber may apply at any moment), not the one it reads or lives in, not the
    one a zero-copy apply is claiming."""
    front = _decode_front(int(ctl[_FRONT]))
    busy = {int(ctl[_READING]), int(ctl[_TRYING])} | ({front[1]} if front is not None else set())
    return next((s for s in range(nslots) if s not in busy), None)


def _keys(name: str) -> dict[str, str]:
    p = f"wsync.{name}."
    return {
        "layout": p + "layout",
        "pubctl": p + "pubctl",
        "snap0": p + "snap0",
        "snap1": p + "snap1",
        "ctl": p + "ctl",
        "slot0": p + "slot0",
        "slot1": p + "slot1",
        "slot2": p + "slot2",  # zero-copy subscribers only
        "doorbell": p + "version",
    }


def _withdraw(t: Transport, keys: list[str]) -> None:
    """Unregisters ``keys`` in order; a closed Transport has withdrawn them already."""
    for key in keys:
        try:
            t.unregister(key)
        except TransportError:
            pass


def _fence() -> None:
    # Orders this thread's store of a flag before its next load of the other side's flag.
    from ._native import load

    load().memory_fence()


def _tensors_of(target: torch.nn.Module | Mapping[str, torch.Tensor], *, detach: bool = True) -> dict[str, torch.Tensor]:
    items = target.state_dict(keep_vars=True) if isinstance(target, torch.nn.Module) else target
    out = {}
    for k, v in items.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{k!r} is a {type(v).__name__}, not a tensor")
        if v.device.type not in ("cpu", "cuda"):
            raise TransportError(f"{k!r} is on {v.device}; weight sync serves cpu and cuda tensors")
        out[k] = v.detach() if detach else v  # the subscriber keeps the very objects (set_)
    return out


class SyncStatus(enum.Enum):
    DONE = "done"  # every byte and the front are in the subscriber's memory
    STRAGGLER = "straggler"  # not complete within the deadline; caught up by a later publish (or pull)
    FAILED = "failed"  # an error (peer lost, layout mismatch, ...); see ``error``


@dataclass(frozen=True)
class SyncResult:
    """How one subscriber fared in one publish."""

    subscriber: str
    version: int
    status: SyncStatus
    nbytes: int  # bytes written into the subscriber
    seconds: float  # from the start of the publish until this subscriber was complete (or given up)
    error: str | None = None


@dataclass(frozen=True)
class PublishReport:
    """What ``publish`` did, per subscriber."""

    version: int
    seconds: float
    snapshot_seconds: float
    results: dict[str, SyncResult] = field(default_factory=dict)

    def by_status(self, status: SyncStatus) -> list[str]:
        return sorted(n for n, r in self.results.items() if r.status == status)

    @property
    def done(self) -> list[str]:
        return self.by_status(SyncStatus.DONE)

    @property
    def stragglers(self) -> list[str]:
        return self.by_status(SyncStatus.STRAGGLER)

    @property
    def failed(self) -> list[str]:
        return self.by_status(SyncStatus.FAILED)


class Publisher:
    """Trainer side: publishes versions of a state dict to every current subscriber.

    Use as ``async with Publisher(t, model) as pub:`` (or ``await pub.start()`` /
    ``await pub.aclose()``).

    Args:
        transport: an open Transport.
        state: an ``nn.Module`` or a name -> tensor mapping (CPU or CUDA). Tensors are read at each
            publish, so in-place optimizer updates are picked up.
        name: the stream name; subscribers name the same one.
        bucket_bytes: target size of one transfer (many tensors are packed per bucket).
        max_inflight: transfers in flight per subscriber.
        deadline: seconds a publish waits for any one subscriber; slower ones are stragglers.
        rename: trainer name -> wire name, or None to leave the tensor out.
        include: keep only tensors for which this returns True (applied before ``rename``).
        fp8: send tensors for which ``fp8(wire_name, tensor)`` is True as float8 e4m3 with a
            per-tensor scale (subscribers convert back to their own dtype on apply).
    """

    def __init__(
        self,
        transport: Transport,
        state: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        name: str = "policy",
        bucket_bytes: int = 16 << 20,
        max_inflight: int = 4,
        deadline: float = 30.0,
        rename: Callable[[str], str | None] | None = None,
        include: Callable[[str], bool] | None = None,
        fp8: Callable[[str, torch.Tensor], bool] | None = None,
    ) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        if not deadline > 0:
            raise ValueError("deadline must be > 0")
        self.t = transport
        self.name = name
        self.deadline = float(deadline)
        self.max_inflight = max_inflight
        self._keys = _keys(name)
        wire: dict[str, torch.Tensor] = {}
        for k, v in _tensors_of(state).items():
            if include is not None and not include(k):
                continue
            w = rename(k) if rename is not None else k
            if w is None:
                continue
            if w in wire:
                raise ValueError(f"two tensors map to the wire name {w!r}")
            wire[w] = v
        self._wire = wire
        self.layout = build_layout(name, wire, bucket_bytes=bucket_bytes, fp8=fp8)
        self.version: int | None = None
        self._ringing: dict[tuple[str, str], int] = {}
        self._lock = anyio.Lock()
        self._started = False

    @property
    def staging_bytes(self) -> int:
        """Bytes this publisher holds for staging: two packed snapshots."""
        return 2 * self.layout.total

    async def start(self) -> None:
        """Registers the layout, the snapshots and the control block (read-only to peers)."""
        t, k = self.t, self._keys
        layout_bytes = self.layout.encode()
        layout_t = t.empty(k["layout"], len(layout_bytes), torch.uint8, writable=False)
        layout_t.copy_(torch.frombuffer(bytearray(layout_bytes), dtype=torch.uint8))
        self._snaps = [t.empty(k[f"snap{i}"], self.layout.total, torch.uint8, writable=False) for i in (0, 1)]
        ctl = torch.zeros(_CTL_WORDS, dtype=torch.int64)
        ctl[_LAYOUT_ID] = self.layout.layout_id
        self._ctl = t.empty(k["pubctl"], _CTL_WORDS, torch.int64, writable=False)
        self._ctl.copy_(ctl)
        self._plan_sources()
        self._started = True
        log.info("publisher %s/%s: %s (%d of %d buckets sent straight from the live tensors)", t.name, self.name,
                 describe(self.layout), len(self._direct), len(self.layout.buckets))

    async def aclose(self) -> None:
        """Withdraws the published regions (subscribers can no longer pull)."""
        if self._started:
            self._started = False
            _withdraw(self.t, [self._keys[k] for k in ("pubctl", "snap0", "snap1", "layout")])

    async def __aenter__(self) -> Publisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _plan_sources(self) -> None:
        """Which buckets can be sent straight from the live tensors (a byte range inside one
        unconverted tensor) and which must be packed first (several small tensors, or fp8)."""
        self._direct: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
        for start, end in self.layout.buckets:
            for e in self.layout.entries:
                if e.offset <= start and end <= e.offset + e.nbytes and e.scale_offset < 0:
                    self._direct[(start, end)] = (_kernels.as_bytes(self._wire[e.name]), e.offset)
                    break
        self._packed_ranges = [b for b in self.layout.buckets if b not in self._direct]

    def _pack(self, slot: int, ranges: list[tuple[int, int]]) -> None:
        """Packs the bytes of ``ranges`` of the version into snapshot ``slot`` (fp8 tensors
        that touch them are quantised whole). Runs in a worker thread."""
        snap = self._snaps[slot]
        with torch.no_grad():
            for e in self.layout.entries:
                end = e.scale_offset + 4 if e.scale_offset >= 0 else e.offset + e.nbytes
                parts = [(max(a, e.offset), min(b, e.offset + e.nbytes)) for a, b in ranges if a < end and b > e.offset]
                if not parts:
                    continue
                src = self._wire[e.name]
                if e.scale_offset >= 0:
                    q, scale = _kernels.quantize_fp8(src)
                    _kernels.pack(snap, [q, scale], [e.offset, e.scale_offset])
                    continue
                data = _kernels.as_bytes(src.contiguous())
                for lo, hi in parts:
                    if hi > lo:
                        snap[lo:hi].copy_(data[lo - e.offset : hi - e.offset])

    def _source(self, snap: torch.Tensor, start: int, end: int) -> torch.Tensor:
        direct = self._direct.get((start, end))
        if direct is None:
            return snap[start:end]
        data, offset = direct
        return data[start - offset : end - offset]

    async def subscribers(self) -> list[str]:
        """Names of the peers currently subscribed to this stream."""
        return sorted(await self._discover())

    async def _discover(self) -> dict[str, PeerRecord]:
        out = {}
        for n in await self.t.peers():
            if n == self.t.name:
                continue
            record = await self.t._lookup(n)
            if record is not None and self._keys["slot1"] in record.regions and self._keys["ctl"] in record.regions:
                out[n] = record
        return out

    async def publish(self, version: int) -> PublishReport:
        """Snapshots the state dict as ``version`` and pushes it to every current subscriber.

        Subscribers are served independently and concurrently; this returns when each one is
        complete, failed, or hit the deadline (a straggler: its transfers are aborted and its
        live weights stay on the previous complete version).

        Args:
            version: must grow from one publish to the next.

        Returns:
            A :class:`PublishReport` with one :class:`SyncResult` per subscriber.

        Raises:
            ValueError: ``version`` does not grow.
            ClosedError: the Transport is closed.

        Cancellation: aborts the pushes in flight; subscribers keep their last complete version.
        """
        if not self._started:
            raise TransportError("publisher not started; use `async with Publisher(...)`")
        if self.version is not None and version <= self.version:
            raise ValueError(f"version must grow: {version} after {self.version}")
        async with self._lock:
            t0 = time.perf_counter()
            front = _decode_front(int(self._ctl[_FRONT]))
            slot = 0 if front is None else 1 - front[1]
            gen = _GEN0 + slot
            self._ctl[gen] += 1  # odd: the snapshot is being written (pullers skip it)
            _fence()
            # Only what cannot go straight from the live tensors is packed before the pushes;
            # the rest of the snapshot (for pull) is filled after them: copying it meanwhile
            # would compete with the pushes for the same memory bandwidth and cores.
            await anyio.to_thread.run_sync(self._pack, slot, self._packed_ranges)
            snap_s = time.perf_counter() - t0
            results: dict[str, SyncResult] = {}
            subs = await self._discover()
            async with anyio.create_task_group() as tg:
                for sub, record in subs.items():
                    tg.start_soon(self._push, record, version, self._snaps[slot], t0, results)
            await anyio.to_thread.run_sync(self._pack, slot, list(self._direct))
            _fence()
            self._ctl[gen] += 1  # even: stable
            self._ctl[_FRONT] = _encode_front(version, slot)
            self.version = version
            return PublishReport(version, time.perf_counter() - t0, snap_s, results)

    async def _push(self, record: PeerRecord, version: int, snap: torch.Tensor, t0: float, results: dict[str, SyncResult]) -> None:
        sub, moved = record.name, [0]
        handles: list = []
        status, error = SyncStatus.STRAGGLER, f"not complete within the {self.deadline:g}s deadline"
        with anyio.move_on_after(self.deadline):
            try:
                await self._push_inner(record, version, snap, handles, moved)
                status, error = SyncStatus.DONE, None
            except TransportError as exc:
                status, error = SyncStatus.FAILED, f"{type(exc).__name__}: {exc}"
            finally:
                for h in handles:
                    h.cancel()
        seconds = time.perf_counter() - t0
        results[sub] = SyncResult(sub, version, status, moved[0], seconds, error)
        if status == SyncStatus.DONE:
            self._ring(sub, record.incarnation, version)
        else:
            log.warning("publisher %s: version %d to %s: %s (%s)", self.t.name, version, sub, status.value, error)

    def _ring(self, sub: str, incarnation: str, version: int) -> None:
        """Rings the doorbell in the background: a subscriber busy generating acknowledges it
        when it next yields, and nobody waits for that. At most one ring per subscriber is in
        flight; it always carries the newest version."""
        key = (sub, incarnation)
        pending = key in self._ringing
        self._ringing[key] = version
        if not pending:
            self.t._tg.start_soon(self._ring_loop, key)

    async def _ring_loop(self, key: tuple[str, str]) -> None:
        sub = key[0]
        try:
            while True:
                version = self._ringing[key]
                try:
                    await self.t.signal(sub, self._keys["doorbell"], version, timeout=self.deadline)
                except TransportError as exc:  # its front is set; apply()/wait_version poll it
                    log.info("publisher %s: doorbell %d to %s not acknowledged: %s", self.t.name, version, sub, exc)
                    return
                if self._ringing[key] == version:
                    return
        finally:
            self._ringing.pop(key, None)

    async def _push_inner(self, record: PeerRecord, version: int, snap: torch.Tensor, handles: list, moved: list[int]) -> None:
        t, k, sub = self.t, self._keys, record.name
        if record.regions[k["slot0"]].nbytes != self.layout.total:
            raise LayoutMismatchError(f"{sub}'s slots hold {record.regions[k['slot0']].nbytes} bytes; this layout needs {self.layout.total}")
        ctl = torch.zeros(_CTL_WORDS, dtype=torch.int64)
        await t.get(ctl, sub, key=k["ctl"])
        if int(ctl[_LAYOUT_ID]) != self.layout.layout_id:
            raise LayoutMismatchError(f"{sub} subscribed to a different layout of {self.name!r} (restart it or let it re-subscribe)")
        nslots = 3 if k["slot2"] in record.regions else 2
        while (back := _free_slot(ctl, nslots)) is None:  # it is applying or living in them
            await anyio.sleep(_POLL_S)
            await t.get(ctl, sub, key=k["ctl"])
        slot_key = k[f"slot{back}"]
        window: list = []
        for start, end in self.layout.buckets:
            if len(window) >= self.max_inflight:
                await window.pop(0)
            h = t.put(self._source(snap, start, end), sub, key=slot_key, offset=start)
            handles.append(h)
            window.append(h)
        for h in window:
            await h
        moved[0] = self.layout.total
        # Every byte is in its memory (puts complete only then): now make the slot the front.
        await t.put(torch.tensor([_encode_front(version, back)], dtype=torch.int64), sub, key=k["ctl"], offset=_FRONT * 8)


class Subscriber:
    """Generator side: receives versions into staging slots and applies complete ones.

    Use as ``async with Subscriber(t, model, publisher="trainer-0") as sub:``. Between
    generation steps call ``sub.apply()`` (non-blocking) or ``await sub.wait_version(v)``.

    Args:
        transport: an open Transport.
        target: the ``nn.Module`` or name -> tensor mapping that receives the weights (CPU or CUDA).
        publisher: the publisher's Transport name.
        name: the stream name.
        rename: wire name -> local name, or None to ignore that tensor.
        strict: raise if a wire tensor has no local counterpart (else ignore it).
        zero_copy: apply by re-pointing the local tensors at the received slot (``set_``)
            instead of copying: ``apply()`` costs no copy, at the price of a third slot (the
            local tensors' own memory is released after the first apply, so the total is the
            same as in copy mode). Tensors that need conversion (fp8, another dtype) are still
            copied. Keep no other views of the tensors' old storage. The tensors must live on
            ``device``, where the slots are.
        device: where the staging slots live. ``"cpu"`` (default): shareable host memory that
            every backend reaches; a GPU model is applied by a host -> device copy. A CUDA
            device: the publisher writes straight into GPU memory (``ipc`` on one host,
            ``nccl`` across hosts; not ``ucx``/``tcp``), ``apply()`` is a device copy, or with
            ``zero_copy`` a re-point of the GPU tensors.

    Raises:
        ValueError: ``zero_copy`` with tensors that are not on ``device``; a ``device`` that is
            neither the CPU nor a CUDA device.
        BackendUnavailableError: slots on a CUDA device without a usable CUDA driver.
    """

    def __init__(
        self,
        transport: Transport,
        target: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        publisher: str,
        name: str = "policy",
        rename: Callable[[str], str | None] | None = None,
        strict: bool = True,
        zero_copy: bool = False,
        device: str | torch.device = "cpu",
    ) -> None:
        self.t = transport
        self.zero_copy = zero_copy
        self.device = torch.device(device)
        self.publisher = publisher
        self.name = name
        self._local = _tensors_of(target, detach=False)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device= must be cpu or a CUDA device, not {self.device}")
        if self.device.type == "cuda":
            if (why := _cuda.unavailable_reason()) is not None:
                raise BackendUnavailableError(f"slots on {self.device}: {why}")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        if zero_copy and (on := sorted({str(t.device) for t in self._local.values() if t.device != self.device})):
            raise ValueError(f"zero_copy=True re-points tensors at the slots on {self.device}; the target has tensors on "
                             f"{', '.join(on)} (pass device= where they live, or use the default copy apply)")
        self._rename = rename
        self._strict = strict
        self._keys = _keys(name)
        self._applied: int | None = None
        self._apply_lock = threading.Lock()
        self._started = False

    @property
    def version(self) -> int | None:
        """The version the local weights hold (None before the first apply/pull)."""
        return self._applied

    @property
    def staging_bytes(self) -> int:
        return len(self._slots) * self.layout.total

    @property
    def latest(self) -> int | None:
        """The newest complete version waiting in a slot (may be newer than ``version``)."""
        front = _decode_front(int(self._ctl[_FRONT])) if self._started else None
        return None if front is None else front[0]

    async def start(self, *, timeout: float | None = None) -> None:
        """Fetches the publisher's layout, checks it against the local tensors, and subscribes
        (registers the slots; the publisher includes this peer from its next publish on).

        Raises:
            PeerNotFoundError: the publisher did not appear in time.
            LayoutMismatchError: names or shapes do not match the local tensors.
        """
        t, k = self.t, self._keys
        peer = await t.peer(self.publisher, regions=[k["layout"], k["pubctl"]], timeout=timeout)
        raw = torch.empty(peer.regions[k["layout"]].nbytes, dtype=torch.uint8)
        await t.get(raw, self.publisher, key=k["layout"])
        self.layout = Layout.decode(raw.numpy().tobytes())
        self._plan = list(self._match(self.layout))
        # Devices whose queued copies read a device slot in apply() (a host slot is consumed by
        # the time copy_ returns): apply() waits for them before it lets the slot go.
        self._gpus = sorted({dst.device.index for _, dst in self._plan if dst.is_cuda} | {self.device.index}) if self.device.type == "cuda" else []
        ctl = torch.zeros(_CTL_WORDS, dtype=torch.int64)
        ctl[_READING] = -1
        ctl[_TRYING] = -1
        ctl[_APPLIED] = -1
        ctl[_LAYOUT_ID] = self.layout.layout_id
        self._ctl = t.empty(k["ctl"], _CTL_WORDS, torch.int64)
        self._ctl.copy_(ctl)
        # slot1 last: publishers treat a peer as subscribed once it is registered.
        nslots = (0, 2, 1) if self.zero_copy else (0, 1)
        slots = {i: self._new_slot(k[f"slot{i}"]) for i in nslots}
        self._slots = [slots[i] for i in sorted(slots)]
        self._started = True

    def _new_slot(self, key: str) -> torch.Tensor:
        if self.device.type == "cpu":
            return self.t.empty(key, self.layout.total, torch.uint8)
        slot = torch.zeros(self.layout.total, dtype=torch.uint8, device=self.device)
        self.t.register(key, slot)
        return slot

    def _match(self, layout: Layout) -> Iterator[tuple[Entry, torch.Tensor]]:
        for e in layout.entries:
            local_name = self._rename(e.name) if self._rename is not None else e.name
            dst = self._local.get(local_name) if local_name is not None else None
            if dst is None:
                if self._strict and local_name is not None:
                    raise LayoutMismatchError(f"the publisher sends {e.name!r} but there is no local {local_name!r}")
                continue
            if tuple(dst.shape) != e.shape:
                raise LayoutMismatchError(f"{local_name!r}: local shape {tuple(dst.shape)} but the publisher sends {e.shape}")
            yield e, dst

    async def aclose(self) -> None:
        """Unsubscribes (withdraws the slots). The local weights stay as they are."""
        if self._started:
            self._started = False
            _withdraw(self.t, [self._keys[k] for k in ("slot1", "slot2", "slot0", "ctl") if self._keys[k] in self.t.regions])

    async def __aenter__(self) -> Subscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _unpack(self, buf: torch.Tensor) -> None:
        with torch.no_grad():
            for e, dst in self._plan:
                src = _kernels.view_in(buf, e.offset, getattr(torch, e.wire_dtype), e.shape)
                if e.scale_offset >= 0:
                    scale = _kernels.view_in(buf, e.scale_offset, torch.float32, ())
                    src = _kernels.dequantize_fp8(src, scale, dst.dtype)
                dst.copy_(src)

    def apply(self) -> int | None:
        """Makes the newest complete version live, if newer than the live one.

        Copy mode copies the received slot into the local tensors; zero-copy mode re-points
        them at it. Never blocks on the network and never applies a torn or mixed version.

        Returns:
            The version applied now, or None if there was nothing newer.
        """
        if not self._started:
            raise TransportError("subscriber not started; use `async with Subscriber(...)`")
        claim = _TRYING if self.zero_copy else _READING
        with self._apply_lock:
            ctl = self._ctl
            while True:
                word = int(ctl[_FRONT])
                front = _decode_front(word)
                if front is None or (self._applied is not None and front[0] <= self._applied):
                    return None
                ctl[claim] = front[1]
                _fence()
                if int(ctl[_FRONT]) == word:  # the publisher had not moved on: the slot is ours
                    break
                ctl[claim] = -1
            try:
                if self.zero_copy:
                    self._repoint(self._slots[front[1]])
                else:
                    self._unpack(self._slots[front[1]])
                    for d in self._gpus:  # the slot is released below: the device copies must be done
                        torch.cuda.current_stream(d).synchronize()
            finally:
                _fence()
                if self.zero_copy:
                    ctl[_READING] = front[1]  # the tensors live there now; the old slot is free
                    _fence()
                    ctl[_TRYING] = -1
                else:
                    ctl[_READING] = -1
            ctl[_APPLIED] = front[0]
            self._applied = front[0]
            return front[0]

    def _repoint(self, slot: torch.Tensor) -> None:
        storage = slot.untyped_storage()
        with torch.no_grad():
            for e, dst in self._plan:
                if e.scale_offset < 0 and e.wire_dtype == str(dst.dtype).removeprefix("torch.") and e.numel:
                    strides = torch.empty(e.shape, device="meta").stride()
                    dst.set_(storage, e.offset // dst.element_size(), e.shape, strides)
                else:
                    src = _kernels.view_in(slot, e.offset, getattr(torch, e.wire_dtype), e.shape)
                    if e.scale_offset >= 0:
                        src = _kernels.dequantize_fp8(src, _kernels.view_in(slot, e.scale_offset, torch.float32, ()), dst.dtype)
                    dst.copy_(src)

    async def wait_version(self, version: int, *, timeout: float | None = None) -> int:
        """Waits until a version ≥ ``version`` is complete here, applies it, returns it.

        Raises:
            TransferTimeoutError: none arrived within the timeout (default: the Transport's).
        """
        timeout = self.t.timeout if timeout is None else timeout
        with anyio.move_on_after(timeout):
            while True:
                if self._applied is not None and self._applied >= version:
                    return self._applied
                latest = self.latest
                if latest is not None and latest >= version:
                    self.apply()
                    continue
                try:  # the doorbell wakes us; polling covers an unacknowledged one
                    await self.t.wait_signal(self._keys["doorbell"], at_least=version, timeout=0.05)
                except TransferTimeoutError:
                    pass
        raise TransferTimeoutError(f"{self.t.name}: version {version} of {self.name!r} did not arrive within {timeout:g}s (live: {self._applied})")

    async def pull(self, *, timeout: float | None = None) -> int | None:
        """Fetches the publisher's latest complete version one-sidedly and applies it.

        For a generator that just joined or restarted; the publisher does nothing.

        Returns:
            The version now live, or None if the publisher has published nothing yet.

        Raises:
            TransferTimeoutError: no consistent copy could be read within the timeout.
            PeerLostError, PeerNotFoundError: the publisher is gone.
        """
        t, k = self.t, self._keys
        timeout = t.timeout if timeout is None else timeout
        ctl = torch.zeros(_CTL_WORDS, dtype=torch.int64)
        buf: torch.Tensor | None = None
        with anyio.move_on_after(timeout):
            while True:
                await t.get(ctl, self.publisher, key=k["pubctl"])
                front = _decode_front(int(ctl[_FRONT]))
                if front is None:
                    return self._applied
                version, slot = front
                if self._applied is not None and version <= self._applied:
                    return self._applied
                gen = int(ctl[_GEN0 + slot])
                if gen % 2 == 0:
                    if buf is None:
                        buf = torch.empty(self.layout.total, dtype=torch.uint8)
                    await t.get(buf, self.publisher, key=k[f"snap{slot}"])
                    await t.get(ctl, self.publisher, key=k["pubctl"])
                    if int(ctl[_GEN0 + slot]) == gen:  # nobody wrote that snapshot meanwhile
                        with self._apply_lock:
                            self._unpack(buf)
                            self._applied = version
                            if self._started:
                                self._ctl[_APPLIED] = version
                        return version
                await anyio.sleep(_POLL_S)
        raise TransferTimeoutError(f"{t.name}: no consistent copy of {self.name!r} from {self.publisher} within {timeout:g}s")

