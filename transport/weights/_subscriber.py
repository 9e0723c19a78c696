"""The generator side of weight sync: ``Subscriber``.

A subscriber registers two staging slots (three with ``zero_copy``) and a control block; the
publisher writes complete versions into them. ``apply()`` claims the newest complete slot with
the two-flag handshake (see :mod:`transport.weights._control`) and copies it into the model with
one ``_kernels.unpack`` (plus a dequantisation per fp8 tensor), or re-points the model's tensors
at it. ``pull()`` reads the publisher's snapshot one-sidedly under its seqlock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import torch

from .. import _cuda, _kernels
from .._errors import BackendUnavailableError, TransferTimeoutError, TransportError
from .._tensors import dtype_from_name, dtype_name
from ._control import (
    APPLIED,
    CTL_WORDS,
    FRONT,
    GEN0,
    LAYOUT_ID,
    NO_SLOT,
    POLL_S,
    READING,
    TRYING,
    StreamKeys,
    decode_front,
    memory_barrier,
    withdraw,
)
from ._layout import Entry, Layout, LayoutMismatchError, tensors_of

if TYPE_CHECKING:
    from .. import Transport


@dataclass
class _Copies:
    """Destinations filled by one ``_kernels.unpack`` from a slot: (tensor, byte offset, stored dtype)."""

    dsts: list[torch.Tensor] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)

    def add(self, entry: Entry, dst: torch.Tensor) -> None:
        self.dsts.append(dst)
        self.offsets.append(entry.offset)
        self.dtypes.append(dtype_from_name(entry.wire_dtype))


@dataclass
class _ApplyPlan:
    """How a slot becomes the local weights, worked out once per layout.

    ``copies`` and ``converted`` (fp8 entries: dequantised) make a copy apply and ``pull``;
    zero-copy apply re-points ``repoint`` (tensor, storage offset in elements, strides) at the
    slot and fills the rest (``zc_copies``, ``converted``) by copying.
    """

    copies: _Copies
    converted: list[tuple[Entry, torch.Tensor]]
    repoint: list[tuple[Entry, torch.Tensor, tuple[int, ...]]]
    zc_copies: _Copies

    @classmethod
    def of(cls, matched: list[tuple[Entry, torch.Tensor]]) -> _ApplyPlan:
        plan = cls(_Copies(), [], [], _Copies())
        for e, dst in matched:
            if e.scale_offset >= 0:
                plan.converted.append((e, dst))
                continue
            plan.copies.add(e, dst)
            if e.wire_dtype == dtype_name(dst.dtype) and e.numel:
                plan.repoint.append((e, dst, torch.empty(e.shape, device="meta").stride()))
            else:
                plan.zc_copies.add(e, dst)
        return plan


def _dequantize_into(buf: torch.Tensor, converted: list[tuple[Entry, torch.Tensor]]) -> None:
    for e, dst in converted:
        q = _kernels.view_in(buf, e.offset, dtype_from_name(e.wire_dtype), e.shape)
        scale = _kernels.view_in(buf, e.scale_offset, torch.float32, ())
        dst.copy_(_kernels.dequantize_fp8(q, scale, dst.dtype))


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
        TypeError, TransportError: a target value is not a CPU or CUDA tensor.
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
        self._local = tensors_of(target, detach=False)  # the very objects: zero-copy re-points them
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device= must be cpu or a CUDA device, not {self.device}")
        if self.device.type == "cuda":
            if (why := _cuda.unavailable_reason()) is not None:
                raise BackendUnavailableError(f"slots on {self.device}: {why}")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        if zero_copy and (on := sorted({str(t.device) for t in self._local.values() if t.device != self.device})):
            raise ValueError(f"zero_copy=True re-points tensors at the slots on {self.device}; the target has tensors "
                             f"on {', '.join(on)} (pass device= where they live, or use the default copy apply)")
        self._rename = rename
        self._strict = strict
        self._keys = StreamKeys.of(name)
        self._applied: int | None = None
        self._apply_lock = threading.Lock()
        self._started = False

    @property
    def version(self) -> int | None:
        """The version the local weights hold (None before the first apply/pull)."""
        return self._applied

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging slots (valid once started)."""
        return len(self._slots) * self.layout.total

    @property
    def latest(self) -> int | None:
        """The newest complete version waiting in a slot (may be newer than ``version``)."""
        front = decode_front(int(self._ctl[FRONT])) if self._started else None
        return None if front is None else front[0]

    async def start(self, *, timeout: float | None = None) -> None:
        """Fetches the publisher's layout, checks it against the local tensors, and subscribes
        (registers the slots; the publisher includes this peer from its next publish on).

        Args:
            timeout: seconds to wait for the publisher (default: the Transport's timeout).

        Raises:
            PeerNotFoundError: the publisher did not appear in time.
            LayoutMismatchError: names or shapes do not match the local tensors.
            WireError: the publisher's layout is malformed.

        Cancellation: safe before the slots are registered; after, call :meth:`aclose`.
        """
        t, k = self.t, self._keys
        peer = await t.peer(self.publisher, regions=[k.layout, k.pubctl], timeout=timeout)
        raw = torch.empty(peer.regions[k.layout].nbytes, dtype=torch.uint8)
        await t.get(raw, self.publisher, key=k.layout)
        self.layout = Layout.decode(raw.numpy().tobytes())
        self._plan = list(self._match(self.layout))
        self._apply_plan = _ApplyPlan.of(self._plan)
        # Devices whose queued copies read a device slot in apply() (a host slot is consumed by
        # the time copy_ returns): apply() waits for them before it lets the slot go.
        self._gpus = sorted({dst.device.index for _, dst in self._plan if dst.is_cuda} | {self.device.index}) \
            if self.device.type == "cuda" else []
        ctl = torch.zeros(CTL_WORDS, dtype=torch.int64)
        ctl[READING] = NO_SLOT
        ctl[TRYING] = NO_SLOT
        ctl[APPLIED] = NO_SLOT
        ctl[LAYOUT_ID] = self.layout.layout_id
        self._ctl = t.empty(k.ctl, CTL_WORDS, torch.int64)
        self._ctl.copy_(ctl)
        # slot1 last: publishers treat a peer as subscribed once it is registered.
        order = (0, 2, 1) if self.zero_copy else (0, 1)
        slots = {i: self._new_slot(k.slots[i]) for i in order}
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
                raise LayoutMismatchError(
                    f"{local_name!r}: local shape {tuple(dst.shape)} but the publisher sends {e.shape}"
                )
            yield e, dst

    async def aclose(self) -> None:
        """Unsubscribes (withdraws the slots). The local weights stay as they are. Idempotent.

        Cancellation: the slots are withdrawn all the same (nothing here waits).
        """
        if self._started:
            self._started = False
            k = self._keys
            withdraw(self.t, [key for key in (k.slots[1], k.slots[2], k.slots[0], k.ctl) if key in self.t.regions])

    async def __aenter__(self) -> Subscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _unpack(self, buf: torch.Tensor) -> None:
        """Copies a whole version from ``buf`` (a slot or a pulled copy) into the local tensors.

        CUDA work is queued on the current streams of the devices involved (a device ``buf``:
        one batched-copy launch for the same-dtype tensors on its device); host-to-host copies
        are done when this returns.
        """
        plan = self._apply_plan
        with torch.no_grad():
            _kernels.unpack(buf, plan.copies.dsts, plan.copies.offsets, plan.copies.dtypes)
            _dequantize_into(buf, plan.converted)

    def _repoint(self, slot: torch.Tensor) -> None:
        """Re-points the local tensors at ``slot``; those that need a conversion are copied."""
        plan = self._apply_plan
        storage = slot.untyped_storage()
        with torch.no_grad():
            for e, dst, strides in plan.repoint:
                dst.set_(storage, e.offset // dst.element_size(), e.shape, strides)
            _kernels.unpack(slot, plan.zc_copies.dsts, plan.zc_copies.offsets, plan.zc_copies.dtypes)
            _dequantize_into(slot, plan.converted)

    def apply(self) -> int | None:
        """Makes the newest complete version live, if newer than the live one.

        Copy mode copies the received slot into the local tensors; zero-copy mode re-points
        them at it. Never blocks on the network and never applies a torn or mixed version.
        With device slots, returns once the device copies have finished.

        Returns:
            The version applied now, or None if there was nothing newer.

        Raises:
            TransportError: the subscriber is not started.
        """
        if not self._started:
            raise TransportError("subscriber not started; use `async with Subscriber(...)`")
        claim = TRYING if self.zero_copy else READING
        with self._apply_lock:
            ctl = self._ctl
            while True:
                word = int(ctl[FRONT])
                front = decode_front(word)
                if front is None or (self._applied is not None and front[0] <= self._applied):
                    return None
                ctl[claim] = front[1]
                memory_barrier()
                if int(ctl[FRONT]) == word:  # the publisher had not moved on: the slot is ours
                    break
                ctl[claim] = NO_SLOT
            try:
                if self.zero_copy:
                    self._repoint(self._slots[front[1]])
                else:
                    self._unpack(self._slots[front[1]])
                    for d in self._gpus:  # the slot is released below: the device copies must be done
                        torch.cuda.current_stream(d).synchronize()
            finally:
                memory_barrier()
                if self.zero_copy:
                    ctl[READING] = front[1]  # the tensors live there now; the old slot is free
                    memory_barrier()
                    ctl[TRYING] = NO_SLOT
                else:
                    ctl[READING] = NO_SLOT
            ctl[APPLIED] = front[0]
            self._applied = front[0]
            return front[0]

    async def wait_version(self, version: int, *, timeout: float | None = None) -> int:
        """Waits until a version ≥ ``version`` is complete here, applies it, returns it.

        Raises:
            TransferTimeoutError: none arrived within the timeout (default: the Transport's).

        Cancellation: safe; a version is either applied whole or not at all.
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
                    await self.t.wait_signal(self._keys.doorbell, at_least=version, timeout=0.05)
                except TransferTimeoutError:
                    pass
        raise TransferTimeoutError(f"{self.t.name}: version {version} of {self.name!r} did not arrive within "
                                   f"{timeout:g}s (live: {self._applied})")

    async def pull(self, *, timeout: float | None = None) -> int | None:
        """Fetches the publisher's latest complete version one-sidedly and applies it.

        For a generator that just joined or restarted; the publisher does nothing.

        Returns:
            The version now live, or None if the publisher has published nothing yet.

        Raises:
            TransferTimeoutError: no consistent copy could be read within the timeout.
            PeerLostError, PeerNotFoundError: the publisher is gone.

        Cancellation: safe; the local weights change only once a consistent copy is read.
        """
        t, k = self.t, self._keys
        timeout = t.timeout if timeout is None else timeout
        ctl = torch.zeros(CTL_WORDS, dtype=torch.int64)
        buf: torch.Tensor | None = None
        with anyio.move_on_after(timeout):
            while True:
                await t.get(ctl, self.publisher, key=k.pubctl)
                front = decode_front(int(ctl[FRONT]))
                if front is None:
                    return self._applied
                version, slot = front
                if self._applied is not None and version <= self._applied:
                    return self._applied
                gen = int(ctl[GEN0 + slot])
                if gen % 2 == 0:
                    if buf is None:
                        buf = torch.empty(self.layout.total, dtype=torch.uint8)
                    await t.get(buf, self.publisher, key=k.snapshots[slot])
                    await t.get(ctl, self.publisher, key=k.pubctl)
                    if int(ctl[GEN0 + slot]) == gen:  # nobody wrote that snapshot meanwhile
                        with self._apply_lock:
                            self._unpack(buf)
                            self._applied = version
                            if self._started:
                                self._ctl[APPLIED] = version
                        return version
                await anyio.sleep(POLL_S)
        raise TransferTimeoutError(f"{t.name}: no consistent copy of {self.name!r} from {self.publisher} "
                                   f"within {timeout:g}s")
