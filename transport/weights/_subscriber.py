"""The generator side of weight sync: ``Subscriber``.

A subscriber registers two staging slots (three with ``zero_copy``) and a control block; the
publisher writes complete versions into them. ``apply()`` claims the newest complete slot with
the two-flag handshake (see :mod:`transport.weights._control`) and copies it into the model (host
tensors: a memcpy split across the available cores, :mod:`._copy`; CUDA: one ``_tensor_kernels.unpack``;
plus a dequantisation per fp8 tensor), or re-points the model's tensors at it. ``apply_async()``
runs the same in a worker thread. ``pull()`` reads the publisher's snapshot one-sidedly under its
seqlock.

Any peer may write a subscriber's control block, so a version past the newest one the
publisher's own (read-only) control block has vouched for is checked against that block before
it is applied (:meth:`Subscriber._vouched`): through this process's mapping of it when the
publisher is on this host (:class:`~._control.LocalBlock`: no network, and still readable after
the publisher left), else over the network (the asynchronous calls only). A version the block
does not cover is refused; one that cannot be checked (the publisher has gone or does not
answer, or, for the synchronous ``apply()``, lives on another host) is applied as it is, and
marked unasked: an unasked live version never holds back another version.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import anyio
import torch

from .. import _cuda, _tensor_kernels
from .._errors import (
    BackendUnavailableError,
    ClosedError,
    DeltaRefusedError,
    LayoutMismatchError,
    MalformedLayoutError,
    TransferTimeoutError,
    TransportError,
)
from .._tensors import dtype_name
from ._apply import ApplyPlan, dequantize_into, host_unpack
from ._codec.apply import DeltaApplier
from ._codec.checksum import deltable
from ._codec.format import index_bytes
from ._control import (
    APPLIED,
    CTL_WORDS,
    DELTA,
    DIFFING,
    FILLING,
    FRONT,
    GEN0,
    LAYOUT_ID,
    NO_SLOT,
    READING,
    TRYING,
    LocalBlock,
    StreamKeys,
    decode_front,
    memory_barrier,
    publisher_latest,
    withdraw,
)
from ._copy import available_threads
from ._layout import MAX_LAYOUT_BYTES, Entry, Layout, tensors_of
from ._lifecycle import Lifecycle
from ._polling import PENDING, Pending, even, poll, seqlock_read

if TYPE_CHECKING:
    from .. import Transport

log = logging.getLogger(__name__)
SHOWN_NAMES = 5  # names listed in a mismatch message before "and N more"
# How long the asynchronous calls wait for the publisher's control block over the network before
# they take the publisher as not answering (the read takes a millisecond when it answers).
ASK_S = 2.0


class _Vouch(enum.Enum):
    """What the publisher's control block says of a version (see ``Subscriber._vouched``)."""

    YES = "vouched"  # it has published (or begun to push) that version
    NO = "refused"  # read now, it has not: somebody else wrote our front word
    UNASKED = "unasked"  # it cannot be read now (the publisher left, or is not reachable this way)


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:SHOWN_NAMES])
    return shown + (f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else "")


class Subscriber(Lifecycle):
    """Generator side: receives versions into staging slots and applies complete ones.

    Use as ``async with Subscriber(t, model, publisher="trainer-0") as sub:``. Between
    generation steps call ``await sub.apply_async()`` (the copy runs in a worker thread; the
    event loop keeps running) or ``await sub.wait_version(v)``; ``sub.apply()`` does the same
    copy on the calling thread (from async code: the event loop stalls for the whole copy).

    Args:
        transport: an open Transport.
        target: the ``nn.Module`` or name -> tensor mapping that receives the weights (CPU or CUDA).
        publisher: the publisher's Transport name.
        name: the stream name.
        rename: wire name -> local name, or None to ignore that tensor.
        strict: (default) ``start`` raises :class:`LayoutMismatchError` when the names do not
            match both ways: a tensor the publisher sends has no local counterpart, or a local
            tensor is not sent (it would keep its own values forever). ``rename`` returning None
            leaves a wire tensor out on purpose. ``strict=False`` ignores the extra wire tensors
            and leaves the unsent local tensors as they are, with a warning that names them.
        zero_copy: apply by re-pointing the local tensors at the received slot (``set_``)
            instead of copying: ``apply()`` costs no copy, at the price of a third slot (the
            local tensors' own memory is released after the first apply, so the total is the
            same as in copy mode). Tensors that need conversion (fp8, another dtype) are still
            copied. Keep no other views of the tensors' old storage. The tensors must live on
            ``device``, where the slots are.
        delta: take delta versions (default): a version that differs little from the live one
            arrives as the new values of the changed elements only and is applied by scattering
            them into the live tensors, after checking per-tensor checksums (a delta whose base
            is not exactly the live weights is refused whole, and ``pull()`` or the next dense
            version catches up). Only host slots copied into host tensors of the wire dtypes
            take deltas (not ``zero_copy``, not device slots); the others always get dense
            versions, as with ``delta=False``.
        device: where the staging slots live. ``"cpu"`` (default): shareable host memory that
            every backend reaches; a GPU model is applied by a host -> device copy. A CUDA
            device: the publisher writes straight into GPU memory (``ipc`` on one host,
            ``nccl`` across hosts; not ``ucx``/``tcp``), ``apply()`` is a device copy, or with
            ``zero_copy`` a re-point of the GPU tensors.

    Raises:
        ValueError: ``zero_copy`` with tensors that are not on ``device``; a ``device`` that is
            neither the CPU nor a CUDA device.
        LayoutMismatchError: (from ``start``) see ``strict``; shapes that differ, always.
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
        delta: bool = True,
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
        self._pub_latest = 0  # the newest version the publisher's own control block vouched for
        self._pub_diffs = True  # its block's DIFFING word, last read: deltas may come
        self._refused: int | None = None  # the last unvouched version logged
        self._unasked_logged: int | None = None  # the last version taken unasked that was logged
        self._block: LocalBlock | None = None  # the publisher's control block mapped here (same host)
        self._unasked = False  # the live version was applied without the publisher's word on it
        self._live_word = 0  # the front word the live version came from (0: pulled, or none)
        self._apply_lock = threading.Lock()
        self._threads = available_threads()
        self._started = False
        self._want_delta = delta
        self._delta: DeltaApplier | None = None  # set by start when this subscriber takes deltas
        self._indexes: list[torch.Tensor] = []
        self._refused_word = 0  # the front word of the last delta refused (not tried again)
        self._refusals = 0
        self._last_apply_s: float | None = None

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
        front = self._front() if self._started else None
        return None if front is None else front[0]

    def _front(self) -> tuple[int, int] | None:
        """(version, slot) of our FRONT word; None for nothing, or for a slot we do not have."""
        return decode_front(int(self._ctl[FRONT]), len(self._slots))

    def _newer(self, word: int, front: tuple[int, int]) -> bool:
        """Whether the version of ``front`` (our front word ``word``) should replace the live
        one: it is newer, or the live one was taken unasked and this is another word (so a
        version nobody could vouch for never holds back the publisher's next one)."""
        if self._applied is None or front[0] > self._applied:
            return True
        return self._unasked and word != self._live_word

    def _judge(self, version: int, words: torch.Tensor, authoritative: bool) -> _Vouch:
        """What the publisher's control block ``words`` says of ``version``.

        ``authoritative``: the block is the current publisher's (read now over the network, or
        through a mapping of a block it still publishes): a version past it is refused, and a
        live version past it is forgotten (written by a third peer, or the publisher restarted
        since), so that the publisher's next version is applied. Otherwise the block is what a
        publisher that has gone wrote last: it still vouches for what it covers, and cannot
        refuse the rest."""
        latest = publisher_latest(words)
        self._pub_latest = latest if authoritative else max(self._pub_latest, latest)
        self._pub_diffs = int(words[DIFFING]) != 0
        if self._applied is not None and self._applied > self._pub_latest and authoritative:
            log.warning("subscriber %s: live version %d of %r is past what %s has published (%d): not "
                        "trusted; the next version it publishes is applied", self.t.name, self._applied,
                        self.name, self.publisher, self._pub_latest)
            self._applied = None
            self._unasked = False
        elif self._unasked and self._applied is not None and self._applied <= self._pub_latest:
            self._unasked = False  # vouched for after all
        if version <= self._pub_latest:
            return _Vouch.YES
        if not authoritative:
            return _Vouch.UNASKED
        if version != self._refused:
            self._refused = version
            log.warning("subscriber %s: version %d in %r's front word is past what %s has published (%d): "
                        "someone else wrote it; ignored", self.t.name, version, self.name, self.publisher,
                        self._pub_latest)
        return _Vouch.NO

    def _past_vouch(self, version: int) -> bool:
        """Whether ``version``, or the live version, is past the newest one vouched for (the
        publisher's block must be read again)."""
        return version > self._pub_latest or (self._applied is not None and self._applied > self._pub_latest)

    def _vouch_here(self, version: int) -> _Vouch:
        """:meth:`_vouched` without the network, on any thread: the last word seen, then the
        publisher's block through the mapping here (same host); UNASKED where there is none."""
        if not self._past_vouch(version):
            return _Vouch.YES
        block = self._block
        words = block.read() if block is not None else None
        if words is None or block is None:
            return self._take_unasked(version, "its control block cannot be read here without the network")
        if (verdict := self._judge(version, words, block.current())) is _Vouch.UNASKED:
            return self._take_unasked(version, "it no longer publishes the control block mapped here")
        return verdict

    async def _vouched(self, version: int) -> _Vouch:
        """Whether the publisher's own control block (only it writes it) vouches for
        ``version``: any peer can write our FRONT, so a version past what the publisher has
        begun to push is refused, and never becomes the live one (see :meth:`_judge`).

        The block is read through the mapping here while the publisher still publishes it,
        else over the network (at most ``ASK_S`` seconds), else through the mapping of the block
        a publisher that left wrote last. When none can be read (the publisher has exited,
        crashed, is restarting or does not answer, and is not on this host), the version is
        UNASKED: taken as it is, as the synchronous :meth:`apply` takes it. Never raises for the
        publisher (only ClosedError, for our own Transport)."""
        if not self._past_vouch(version):
            return _Vouch.YES
        block = self._block
        if block is not None and block.current() and (words := block.read()) is not None:
            return self._judge(version, words, True)
        ctl = torch.zeros(CTL_WORDS, dtype=torch.int64)
        why = ""
        try:
            await self.t.get(ctl, self.publisher, key=self._keys.pubctl, timeout=min(self.t.timeout, ASK_S))
        except ClosedError:
            raise
        except TransportError as exc:  # gone, restarting, not answering
            why = f"{type(exc).__name__}: {exc}"
        else:
            if block is not None:
                await self._map_block()  # a publisher back on this host: its new block
            return self._judge(version, ctl, True)
        if block is not None and (words := block.read()) is not None:
            if (verdict := self._judge(version, words, False)) is not _Vouch.UNASKED:
                return verdict  # what the publisher wrote last covers it
        return self._take_unasked(version, why)

    def _take_unasked(self, version: int, why: str) -> _Vouch:
        """UNASKED (logged once per version) for a version past the newest one vouched for."""
        if version <= self._pub_latest:
            return _Vouch.YES  # (the block was to be read for the live version's sake)
        if version != self._unasked_logged:
            self._unasked_logged = version
            log.info("subscriber %s: cannot ask %s whether it published version %d of %r (%s): taken as it "
                     "is", self.t.name, self.publisher, version, self.name, why)
        return _Vouch.UNASKED

    async def _map_block(self) -> None:
        """Maps the control block of the publisher now in the store (when it is on this host),
        unless the one mapped is still current. Keeps the old one when the new one cannot be
        mapped: what a publisher that left wrote last still vouches for what it covers."""
        if self._block is not None and self._block.current():
            return
        try:
            peer = await self.t.lookup(self.publisher)
        except ClosedError:
            raise
        except TransportError:
            return
        if peer is not None:
            self._block = LocalBlock.of(self.t, peer, self._keys.pubctl, CTL_WORDS) or self._block

    async def start(self, *, timeout: float | None = None) -> None:
        """Fetches the publisher's layout, checks it against the local tensors, and subscribes
        (registers the slots; the publisher includes this peer from its next publish on).

        Args:
            timeout: seconds to wait for the publisher (default: the Transport's timeout).

        Raises:
            PeerNotFoundError: the publisher did not appear in time.
            LayoutMismatchError: shapes differ, or (``strict``) names do not match both ways:
                the message lists the first few, ``not_received``/``not_sent`` all of them.
            MalformedLayoutError: the publisher's layout is malformed or its fields do not fit
                together (also a ``WireError``); nothing was allocated from it.

        Cancellation: safe before the slots are registered; after, call :meth:`aclose`.
        """
        t, k = self.t, self._keys
        peer = await t.peer(self.publisher, regions=[k.layout, k.pubctl], timeout=timeout)
        self._block = LocalBlock.of(t, peer, k.pubctl, CTL_WORDS)
        nbytes = peer.regions[k.layout].nbytes
        if not 0 < nbytes <= MAX_LAYOUT_BYTES:  # sized from a record: checked before anything is allocated
            raise MalformedLayoutError(f"{self.publisher} publishes a {nbytes}-byte layout of {self.name!r} "
                                       f"(at most {MAX_LAYOUT_BYTES})")
        raw = torch.empty(nbytes, dtype=torch.uint8)
        await t.get(raw, self.publisher, key=k.layout)
        self.layout = Layout.decode(raw.numpy().tobytes())
        self._plan = self._match(self.layout)
        self._apply_plan = ApplyPlan.of(self._plan)
        # Host slots into host tensors: copies split across the cores (else _tensor_kernels.unpack).
        self._host = self.device.type == "cpu" and all(not dst.is_cuda for _, dst in self._plan)
        # CUDA devices an apply queues work on (apply_async queues it on the caller's streams).
        self._devices = sorted({dst.device.index for _, dst in self._plan if dst.is_cuda}
                               | ({self.device.index} if self.device.type == "cuda" else set()))
        # Devices whose queued copies read a device slot in apply() (a host slot is consumed by
        # the time copy_ returns): apply() waits for them before it lets the slot go.
        self._gpus = sorted({dst.device.index for _, dst in self._plan if dst.is_cuda} | {self.device.index}) \
            if self.device.type == "cuda" else []
        ctl = torch.zeros(CTL_WORDS, dtype=torch.int64)
        ctl[READING] = NO_SLOT
        ctl[TRYING] = NO_SLOT
        ctl[APPLIED] = NO_SLOT
        ctl[LAYOUT_ID] = self.layout.layout_id
        self._delta = self._delta_applier() if self._want_delta else None
        ctl[DELTA] = int(self._delta is not None)
        self._ctl = t.empty(k.ctl, CTL_WORDS, torch.int64)
        self._ctl.copy_(ctl)
        if self._delta is not None:
            self._indexes = [t.empty(key, index_bytes(self.layout) // 8, torch.int64) for key in k.deltas]
        # slot1 last: publishers treat a peer as subscribed once it is registered.
        order = (0, 2, 1) if self.zero_copy else (0, 1)
        slots = {i: self._new_slot(k.slots[i]) for i in order}
        self._slots = [slots[i] for i in sorted(slots)]
        self._started = True

    def _delta_applier(self) -> DeltaApplier | None:
        """The delta applier, when every tensor that can travel as a delta lands as it is in a
        contiguous host tensor of its wire dtype (a conversion has no bits to patch)."""
        if self.zero_copy or not self._host:
            return None
        local: dict[int, torch.Tensor] = {}
        index = {e.name: i for i, e in enumerate(self.layout.entries)}
        for e, dst in self._plan:
            if deltable(e) and (dst.is_cuda or not dst.is_contiguous() or dtype_name(dst.dtype) != e.wire_dtype):
                return None
            local[index[e.name]] = dst
        return DeltaApplier(self.layout, [local.get(i) for i in range(len(self.layout.entries))], self._threads)

    @property
    def last_apply_s(self) -> float | None:
        """Seconds the last apply that made a version live spent copying (or, for a delta,
        checking and scattering) into the local tensors; None before the first."""
        return self._last_apply_s

    @property
    def refused_deltas(self) -> int:
        """How many delta versions this subscriber refused (their base was not its live
        weights, or they failed a check); each left the live weights as they were."""
        return self._refusals

    def _new_slot(self, key: str) -> torch.Tensor:
        if self.device.type == "cpu":
            return self.t.empty(key, self.layout.total, torch.uint8)
        slot = torch.zeros(self.layout.total, dtype=torch.uint8, device=self.device)
        self.t.register(key, slot)
        return slot

    def _match(self, layout: Layout) -> list[tuple[Entry, torch.Tensor]]:
        """The (entry, local tensor) pairs; checks shapes, and names both ways (see ``strict``)."""
        matched: list[tuple[Entry, torch.Tensor]] = []
        not_received: list[str] = []
        received: set[str] = set()
        for e in layout.entries:
            local_name = self._rename(e.name) if self._rename is not None else e.name
            if local_name is None:
                continue  # left out on purpose
            dst = self._local.get(local_name)
            if dst is None:
                not_received.append(e.name if local_name == e.name else f"{e.name} -> {local_name}")
                continue
            if tuple(dst.shape) != e.shape:
                raise LayoutMismatchError(
                    f"{local_name!r}: local shape {tuple(dst.shape)} but the publisher sends {e.shape}"
                )
            matched.append((e, dst))
            received.add(local_name)
        not_sent = [n for n in self._local if n not in received]
        where = f"{self.publisher}'s layout of {self.name!r}"
        if self._strict and (not_received or not_sent):
            parts = []
            if not_received:
                parts.append(f"{len(not_received)} tensor(s) it sends have no local counterpart: "
                             f"{_names(not_received)}")
            if not_sent:
                parts.append(f"{len(not_sent)} local tensor(s) are not sent: {_names(not_sent)}")
            raise LayoutMismatchError(
                f"{self.t.name}: the local tensors do not match {where}: {'; '.join(parts)} (map names with "
                f"rename=, or pass strict=False to leave them unsynced)",
                not_received=not_received, not_sent=not_sent,
            )
        if not_sent:
            log.warning("subscriber %s: %d local tensor(s) are not in %s and stay unsynced (strict=False): %s",
                        self.t.name, len(not_sent), where, _names(not_sent))
        if not_received:
            log.info("subscriber %s: ignoring %d tensor(s) of %s with no local counterpart (strict=False): %s",
                     self.t.name, len(not_received), where, _names(not_received))
        return matched

    async def aclose(self) -> None:
        """Unsubscribes (withdraws the slots). The local weights stay as they are. Idempotent.

        Cancellation: the slots are withdrawn all the same (nothing here waits).
        """
        if self._started:
            self._started = False
            self._block = None  # (its mapping of the publisher's block goes with it)
            if self._delta is not None:
                self._delta.close()
            k = self._keys
            withdraw(self.t, [key for key in (k.slots[1], k.slots[2], k.slots[0], *k.deltas, k.ctl)
                              if key in self.t.regions])

    def _unpack(self, buf: torch.Tensor) -> None:
        """Copies a whole version from ``buf`` (a slot or a pulled copy) into the local tensors.

        CUDA work is queued on the current streams of the devices involved (a device ``buf``:
        one batched-copy launch for the same-dtype tensors on its device); host-to-host copies
        are done when this returns.
        """
        plan = self._apply_plan
        with torch.no_grad():
            if self._host:
                if self._delta is not None:
                    self._delta.before_dense()
                host_unpack(buf, plan.copies, plan.converted, self._threads)
                if self._delta is not None:
                    self._delta.dense_applied(self._pub_diffs)
                return
            _tensor_kernels.unpack(buf, plan.copies.dsts, plan.copies.offsets, plan.copies.dtypes)
            dequantize_into(buf, plan.converted)

    def _repoint(self, slot: torch.Tensor) -> None:
        """Re-points the local tensors at ``slot``; those that need a conversion are copied."""
        plan = self._apply_plan
        storage = slot.untyped_storage()
        with torch.no_grad():
            for e, dst, strides in plan.repoint:
                dst.set_(storage, e.offset // dst.element_size(), e.shape, strides)
            if self._host:
                host_unpack(slot, plan.zc_copies, plan.converted, self._threads)
                return
            _tensor_kernels.unpack(slot, plan.zc_copies.dsts, plan.zc_copies.offsets, plan.zc_copies.dtypes)
            dequantize_into(slot, plan.converted)

    def apply(self) -> int | None:
        """Makes the newest complete version live, if newer than the live one, on the calling
        thread.

        Copy mode copies the received slot into the local tensors; zero-copy mode re-points
        them at it. Never waits on the network and never applies a torn or mixed version, but
        the copy itself takes as long as a memcpy of the model: called from async code it
        stalls the event loop (every other task, the Transport's own included) for that long.
        Async code should call :meth:`apply_async`. With device slots, returns once the device
        copies have finished.

        A version past the newest one the publisher has vouched for is checked against the
        publisher's own control block where that needs no network: a publisher on this host
        (reached over ``ipc``) is read through this process's mapping of its block, which
        stays readable after it exited. A version the block does not cover is not applied
        (another peer wrote our front word). Where the block cannot be read that way (a
        publisher on another host, or one that restarted, until an asynchronous call has
        mapped its new block), the version is applied as it is; such a version never
        holds back a later one (the publisher's next version replaces it), and the next
        :meth:`apply_async`, :meth:`wait_version` or :meth:`pull` checks it.

        Returns:
            The version applied now, or None if there was nothing newer (or only a version
            the publisher does not vouch for).

        Raises:
            TransportError: the subscriber is not started.
        """
        if not self._started:
            raise TransportError("subscriber not started; use `async with Subscriber(...)`")
        return self._apply_newest(self._vouch_here)

    async def apply_async(self) -> int | None:
        """:meth:`apply` with the copy in a worker thread: the event loop keeps running.

        Host copies are split across the cores this process may run on; CUDA copies are queued
        on the caller's current streams, as :meth:`apply` queues them. Correct alongside
        publishes in flight (the same slot handshake as :meth:`apply`: a version is applied
        whole or not at all) and alongside other ``apply``/``apply_async``/``pull`` calls (one
        runs at a time). Call it between generation steps: the local tensors change while it
        runs. Returns at once (after a checkpoint) when there is nothing newer.

        A version past the newest one the publisher has vouched for is checked against the
        publisher's own control block: through this process's mapping of it (a publisher on
        this host), else over the network (waiting at most ``ASK_S`` = 2 seconds). A version
        the block does not cover is not applied. A publisher that cannot be asked (it exited,
        crashed, is restarting or does not answer) is no error: what it completed into our
        slots before it left is applied (a publisher on this host still vouches through the
        mapping; one on another host cannot, and its version is applied as it is, as
        :meth:`apply` would; such a version never holds back a later one).

        Returns:
            The version applied now, or None if there was nothing newer (or only a version
            the publisher does not vouch for).

        Raises:
            TransportError: the subscriber is not started.
            ClosedError: this subscriber's Transport is closed. Never an error of the publisher.

        Cancellation: a copy that has started is not interrupted: the call waits for its thread,
        so that version is applied whole (``version`` says which), then raises the
        cancellation. Cancelled before the copy starts, nothing changes.
        """
        if not self._started:
            raise TransportError("subscriber not started; use `async with Subscriber(...)`")
        word = int(self._ctl[FRONT])
        front = decode_front(word, len(self._slots))
        verdict = _Vouch.NO
        if front is not None and self._newer(word, front):
            verdict = await self._vouched(front[0])
        if front is None or verdict is _Vouch.NO:
            await anyio.lowlevel.checkpoint()
            return None
        version = front[0]

        def vouch(v: int) -> _Vouch:  # a newer front meanwhile is checked without the network
            return verdict if v == version else self._vouch_here(v)

        # The copies go on the caller's current streams, after its queued work, as apply()'s do.
        applied = await self._in_thread(self._apply_newest, vouch)
        await anyio.lowlevel.checkpoint_if_cancelled()
        return applied

    async def _in_thread(self, fn: Callable[..., int | None], *args: object) -> int | None:
        """Runs ``fn`` in a worker thread (not abandoned on cancellation) with the caller's
        current CUDA streams as its own: its copies queue after the caller's work, as they
        would on the caller's thread."""
        streams = [torch.cuda.current_stream(d) for d in self._devices]

        def run() -> int | None:
            with contextlib.ExitStack() as stack:
                for stream in streams:
                    stack.enter_context(torch.cuda.stream(stream))
                return fn(*args)

        return await anyio.to_thread.run_sync(run)

    def _apply_newest(self, vouch: Callable[[int], _Vouch]) -> int | None:
        """Claims the newest complete slot (two-flag handshake), makes it live, releases it.
        A front naming a slot we lack, or a version ``vouch`` refuses, is not applied."""
        claim = TRYING if self.zero_copy else READING
        with self._apply_lock:
            ctl = self._ctl
            while True:
                word = int(ctl[FRONT])
                front = decode_front(word, len(self._slots))
                if front is None or not self._newer(word, front):
                    return None
                if word == self._refused_word:
                    return None  # refused already: pull() or the next version
                verdict = vouch(front[0])
                if verdict is _Vouch.NO:
                    return None
                ctl[claim] = front[1]
                memory_barrier()
                if int(ctl[FRONT]) == word:  # the publisher had not moved on: the slot is ours
                    break
                ctl[claim] = NO_SLOT
            t0 = time.perf_counter()
            try:
                if self.zero_copy:
                    self._repoint(self._slots[front[1]])
                elif self._is_delta(front):
                    if not self._apply_delta(front, word):
                        return None
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
            self._live_word = word
            self._unasked = verdict is _Vouch.UNASKED
            self._last_apply_s = time.perf_counter() - t0
            return front[0]

    def _is_delta(self, front: tuple[int, int]) -> bool:
        """Whether the slot of ``front`` holds a delta (its header names that version)."""
        if self._delta is None or front[1] >= len(self._indexes):
            return False
        head = DeltaApplier.header_of(self._indexes[front[1]])
        return head is not None and head[0] == front[0]

    def _apply_delta(self, front: tuple[int, int], word: int) -> bool:
        """Applies the delta in the slot of ``front``, or refuses it whole (and remembers the
        front word, so it is not tried again). The caller holds the claim on the slot."""
        assert self._delta is not None
        try:
            self._delta.apply(self._slots[front[1]], self._indexes[front[1]], front[0])
        except DeltaRefusedError as exc:
            self._refused_word = word
            self._refusals += 1
            # Our APPLIED word may have been scribbled over (that is how a wrong base is
            # chosen): say again what we hold, so the publisher's next version comes dense.
            self._ctl[APPLIED] = NO_SLOT if self._applied is None else self._applied
            log.warning("subscriber %s: delta version %d of %r refused, live weights stay on %s: %s", self.t.name,
                        front[0], self.name, self._applied, exc)
            return False
        return True

    async def wait_version(self, version: int, *, timeout: float | None = None) -> int:
        """Waits until a version ≥ ``version`` is complete here, applies it, returns it.

        Versions are checked against the publisher's control block as in :meth:`apply_async`:
        a publisher that has left (exited, crashed, restarting) or does not answer makes no
        error here; what it completed into our slots before it left is applied.

        Raises:
            TransferTimeoutError: none arrived within the timeout (default: the Transport's).
                The only error a publisher, present or gone, can cause here.
            ClosedError: this subscriber's Transport is closed.

        The copy runs in a worker thread, as in :meth:`apply_async`.

        Cancellation: safe; a version is either applied whole or not at all.
        """
        timeout = self.t.timeout if timeout is None else timeout
        with anyio.move_on_after(timeout):
            while True:
                if self._applied is not None and self._applied >= version \
                        and await self._vouched(self._applied) is not _Vouch.NO:
                    return self._applied
                latest = self.latest
                if latest is not None and latest >= version and await self.apply_async() is not None:
                    continue
                if self._refused_word and self._refused_word == int(self._ctl[FRONT]) and latest is not None \
                        and latest >= version and await self._pull_refused(timeout):
                    continue
                try:  # the doorbell wakes us; polling covers an unacknowledged one
                    await self.t.wait_signal(self._keys.doorbell, at_least=version, timeout=0.05)
                except TransferTimeoutError:
                    pass
        if self._applied is not None and self._applied >= version \
                and (self._unasked or self._applied <= self._pub_latest):
            return self._applied  # the timeout fell during the copy
        raise TransferTimeoutError(f"{self.t.name}: version {version} of {self.name!r} did not arrive within "
                                   f"{timeout:g}s (live: {self._applied})")

    async def _pull_refused(self, timeout: float) -> bool:
        """Catches up from the snapshot after a refused delta; False when the publisher cannot
        be read (it left: its next version, or its return, is waited for)."""
        try:
            await self.pull(timeout=timeout)
        except ClosedError:
            raise
        except TransportError as exc:
            log.info("subscriber %s: cannot pull %r from %s after a refused delta: %s", self.t.name, self.name,
                     self.publisher, exc)
            return False
        return True

    async def pull(self, *, timeout: float | None = None) -> int | None:
        """Fetches the publisher's latest complete version one-sidedly and applies it.

        For a generator that just joined or restarted; the publisher does nothing.

        Returns:
            The version now live, or None if the publisher has published nothing yet.

        Raises:
            TransferTimeoutError: no consistent copy could be read within the timeout.
            PeerLostError, PeerNotFoundError: the publisher is gone.

        Cancellation: safe; the local weights change only once a consistent copy is read (its
        copy into them, in a worker thread, is not interrupted).
        """
        t, k = self.t, self._keys
        timeout = t.timeout if timeout is None else timeout
        ctl = torch.zeros(CTL_WORDS, dtype=torch.int64)
        buf: torch.Tensor | None = None

        async def attempt() -> int | Pending | None:
            await t.get(ctl, self.publisher, key=k.pubctl)
            front = decode_front(int(ctl[FRONT]))
            filling = int(ctl[FILLING])  # a newer version whose snapshot is still being filled
            if front is None:
                return PENDING if filling else self._applied  # (filling: the first snapshot)
            version, slot = front
            self._pub_latest = publisher_latest(ctl)
            self._pub_diffs = int(ctl[DIFFING]) != 0
            if self._applied is not None and max(version, filling) == self._applied:
                return self._applied
            # Past the publisher's own version (a third peer's word, or a restarted
            # publisher): the publisher's current version replaces it.
            reset = self._applied is not None and self._applied > max(version, filling)
            if filling > version:  # wait for it rather than take the older one
                return PENDING

            async def generation() -> int:
                await t.get(ctl, self.publisher, key=k.pubctl)
                return int(ctl[GEN0 + slot])

            async def read() -> torch.Tensor:
                nonlocal buf
                if buf is None:
                    buf = torch.empty(self.layout.total, dtype=torch.uint8)
                await t.get(buf, self.publisher, key=k.snapshots[slot])
                return buf

            copy = await seqlock_read(generation, read, stable=even, seen=int(ctl[GEN0 + slot]))
            if copy is PENDING:  # being written, or written while we read it
                return PENDING
            return await self._in_thread(self._keep_pulled, copy, version, reset)

        return await poll(attempt, timeout=timeout,
                          what=f"{t.name}: no consistent copy of {self.name!r} from {self.publisher}")

    def _keep_pulled(self, buf: torch.Tensor, version: int, reset: bool = False) -> int | None:
        """Copies a pulled version into the local tensors, unless a newer one is live by now
        (``reset``: the live one is not the publisher's, so the pulled one replaces it)."""
        with self._apply_lock:
            if self._applied is not None and version <= self._applied and not reset:
                return self._applied
            self._unpack(buf)
            self._applied = version
            self._unasked, self._live_word = False, 0  # the publisher's own copy
            if self._started:
                self._ctl[APPLIED] = version
            return version
