"""The generator side of weight sync: ``Subscriber``.

A subscriber registers two staging slots (three with ``zero_copy``) and a control block; the
publisher writes complete versions into them. ``apply()`` claims the newest complete slot with
the two-flag handshake (see :mod:`transport.weights._control`) and writes it into the model
(:mod:`._target`: copied, or the model's tensors re-pointed at it), or applies the delta it
holds (:mod:`._delta_intake`). ``apply_async()`` runs the same in a worker thread. ``pull()``
reads the publisher's snapshot one-sidedly under its seqlock.

Any peer may write a subscriber's control block, so a version past the newest one the
publisher's own (read-only) control block has vouched for is checked against that block before
it is applied, and one the block does not cover is refused (:mod:`._trust`, which also owns the
live version). The subscriber sequences these parts: it asks the trust, claims the slot, has the
version written, and tells the trust what is live.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import anyio
import torch

from .. import _cuda
from .._errors import (
    BackendUnavailableError,
    ClosedError,
    DeltaRefusedError,
    MalformedLayoutError,
    TransferTimeoutError,
    TransportError,
)
from ._control import (
    APPLIED,
    CTL_WORDS,
    DELTA,
    FILLING,
    FRONT,
    GEN0,
    LAYOUT_ID,
    NO_SLOT,
    READING,
    TRYING,
    StreamKeys,
    claim,
    decode_front,
    memory_barrier,
    read_words,
    release,
    withdraw,
)
from ._copy import available_threads
from ._delta_intake import DeltaIntake
from ._layout import MAX_LAYOUT_BYTES, Layout, tensors_of
from ._lifecycle import Lifecycle
from ._polling import PENDING, Pending, even, poll, seqlock_read
from ._relay_block import block_words
from ._relay_member import RelayMember
from ._target import Target
from ._trust import Trust, Vouch

if TYPE_CHECKING:
    from .. import Transport
    from ._codec.apply import DeltaApplier

log = logging.getLogger(__name__)


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
        relay: take part in per-host relays (see ``Publisher(relays=...)``): where the
            publisher is on another host and other subscribers share this one, a version may
            arrive through one of them (this one may be it): it copies the version into its
            slot over ``ipc`` as the parts land (host slots: shared memory; device slots: CUDA
            IPC from the relay's GPU memory), in a task of its Transport, from ``start`` to
            ``aclose``. The version is applied exactly as a pushed one. None (the default):
            host slots take part, device slots do not (relays of device slots have not run on
            a GPU yet: ``tests/gpu/test_relays_cuda.py``); True: device slots too. False:
            every version is pushed to it directly. ``zero_copy`` subscribers never take part.

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
        relay: bool | None = None,
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
        self._trust = Trust(transport, publisher, name)  # the live version, and the publisher's word on versions
        self._apply_lock = threading.Lock()
        self._threads = available_threads()
        self._started = False
        self._want_delta = delta
        # Device slots relay only when asked for (see ``relay``).
        self._want_relay = (self.device.type == "cpu" if relay is None else relay) and not zero_copy
        self._relay: RelayMember | None = None  # follows relay orders (set by start when it takes part)
        self._relay_scope: anyio.CancelScope | None = None
        self._deltas: DeltaIntake | None = None  # set by start when this subscriber takes deltas
        self._last_apply_s: float | None = None

    @property
    def version(self) -> int | None:
        """The version the local weights hold (None before the first apply/pull)."""
        return self._trust.live

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

    @property
    def _delta(self) -> DeltaApplier | None:
        """The delta applier (None: this subscriber takes dense versions only)."""
        return None if self._deltas is None else self._deltas.applier

    @property
    def _indexes(self) -> list[torch.Tensor]:
        """The delta index beside slot 0 and 1 (none without deltas)."""
        return [] if self._deltas is None else self._deltas.indexes

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
        self._trust.map(peer)
        nbytes = peer.regions[k.layout].nbytes
        if not 0 < nbytes <= MAX_LAYOUT_BYTES:  # sized from a record: checked before anything is allocated
            raise MalformedLayoutError(f"{self.publisher} publishes a {nbytes}-byte layout of {self.name!r} "
                                       f"(at most {MAX_LAYOUT_BYTES})")
        raw = torch.empty(nbytes, dtype=torch.uint8)
        await t.get(raw, self.publisher, key=k.layout)
        self.layout = Layout.decode(raw.numpy().tobytes())
        self._target = Target.match(self._local, self.layout, rename=self._rename, strict=self._strict,
                                    who=t.name, where=f"{self.publisher}'s layout of {self.name!r}",
                                    device=self.device, threads=self._threads)
        ctl = torch.zeros(CTL_WORDS, dtype=torch.int64)
        ctl[READING] = NO_SLOT
        ctl[TRYING] = NO_SLOT
        ctl[APPLIED] = NO_SLOT
        ctl[LAYOUT_ID] = self.layout.layout_id
        self._deltas = DeltaIntake.of(self.layout, self._target, zero_copy=self.zero_copy, threads=self._threads,
                                      who=f"{t.name}/{self.name}") \
            if self._want_delta else None
        ctl[DELTA] = int(self._deltas is not None)
        self._ctl = t.empty(k.ctl, CTL_WORDS, torch.int64)
        self._ctl.copy_(ctl)
        if self._deltas is not None:
            self._deltas.register(t, k.deltas, self.layout)
        block = t.empty(k.relay, block_words(self.layout), torch.int64) if self._want_relay else None
        # slot1 last: publishers treat a peer as subscribed once it is registered.
        order = (0, 2, 1) if self.zero_copy else (0, 1)
        slots = {i: self._new_slot(k.slots[i]) for i in order}
        self._slots = [slots[i] for i in sorted(slots)]
        if block is not None:
            self._relay = RelayMember(t, k, self.layout, block, self._slots, self._indexes, self.publisher)
            self._relay_scope = t._run_service(self._relay.run)
        self._started = True

    @property
    def last_apply_s(self) -> float | None:
        """Seconds the last apply that made a version live spent copying (or, for a delta,
        checking and scattering) into the local tensors; None before the first."""
        return self._last_apply_s

    @property
    def refused_deltas(self) -> int:
        """How many delta versions this subscriber refused (their base was not its live
        weights, or they failed a check); each left the live weights as they were."""
        return 0 if self._deltas is None else self._deltas.refusals

    def _new_slot(self, key: str) -> torch.Tensor:
        if self.device.type == "cpu":
            return self.t.empty(key, self.layout.total, torch.uint8)
        slot = torch.zeros(self.layout.total, dtype=torch.uint8, device=self.device)
        self.t.register(key, slot)
        return slot

    async def aclose(self) -> None:
        """Unsubscribes (withdraws the slots). The local weights stay as they are. Idempotent.

        Cancellation: the slots are withdrawn all the same (nothing here waits).
        """
        if self._started:
            self._started = False
            self._trust.unmap()  # (its mapping of the publisher's block goes with it)
            if self._relay_scope is not None:
                self._relay_scope.cancel()
            if self._deltas is not None:
                self._deltas.applier.close()
            k = self._keys
            withdraw(self.t, [key for key in (k.slots[1], k.slots[2], k.slots[0], *k.deltas, k.relay, k.ctl)
                              if key in self.t.regions])

    def _unpack(self, buf: torch.Tensor) -> None:
        """Copies a whole version from ``buf`` (a slot or a pulled copy) into the local tensors
        (:meth:`Target.unpack`); with deltas, around the applier's checksums of the live
        weights (stopped before, begun again after, when the publisher says deltas may come)."""
        deltas = self._deltas
        if deltas is not None:
            deltas.applier.before_dense()
        self._target.unpack(buf)
        if deltas is not None:
            deltas.applier.dense_applied(self._trust.diffs)

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
        return self._apply_newest(self._trust.here)

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
        verdict = Vouch.NO
        if front is not None and self._trust.newer(word, front[0]):
            verdict = await self._trust.ask(front[0])
        if front is None or verdict is Vouch.NO:
            await anyio.lowlevel.checkpoint()
            return None
        version = front[0]

        def vouch(v: int) -> Vouch:  # a newer front meanwhile is checked without the network
            return verdict if v == version else self._trust.here(v)

        # The copies go on the caller's current streams, after its queued work, as apply()'s do.
        applied = await self._in_thread(self._apply_newest, vouch)
        await anyio.lowlevel.checkpoint_if_cancelled()
        return applied

    async def _in_thread(self, fn: Callable[..., int | None], *args: object) -> int | None:
        """Runs ``fn`` in a worker thread (not abandoned on cancellation) with the caller's
        current CUDA streams as its own: its copies queue after the caller's work, as they
        would on the caller's thread."""
        streams = [torch.cuda.current_stream(d) for d in self._target.devices]

        def run() -> int | None:
            with contextlib.ExitStack() as stack:
                for stream in streams:
                    stack.enter_context(torch.cuda.stream(stream))
                return fn(*args)

        return await anyio.to_thread.run_sync(run)

    def _apply_newest(self, vouch: Callable[[int], Vouch]) -> int | None:
        """Claims the newest complete slot (two-flag handshake), makes it live, releases it.
        A front naming a slot we lack, or a version ``vouch`` refuses, is not applied."""
        at = TRYING if self.zero_copy else READING
        with self._apply_lock:
            ctl = self._ctl
            while True:
                word = int(ctl[FRONT])
                front = decode_front(word, len(self._slots))
                if front is None or not self._trust.newer(word, front[0]):
                    return None
                if self._deltas is not None and self._deltas.refused(word):
                    return None  # refused already: pull() or the next version
                verdict = vouch(front[0])
                if verdict is Vouch.NO:
                    return None
                if claim(ctl, at, front[1], FRONT, word):  # the publisher had not moved on: the slot is ours
                    break
            version, slot = front
            t0 = time.perf_counter()
            try:
                if self.zero_copy:
                    self._target.repoint(self._slots[slot])
                elif self._deltas is not None and self._deltas.holds(version, slot):
                    if (refusal := self._deltas.take(self._slots[slot], slot, version, word)) is not None:
                        self._refused_delta(version, refusal)
                        return None
                else:
                    self._unpack(self._slots[slot])
                    for d in self._target.gpus:  # the slot is released below: the device copies must be done
                        torch.cuda.current_stream(d).synchronize()
            finally:
                if self.zero_copy:
                    memory_barrier()
                    ctl[READING] = slot  # the tensors live there now; the old slot is free
                    memory_barrier()
                    ctl[TRYING] = NO_SLOT
                else:
                    release(ctl, READING)
            ctl[APPLIED] = version
            self._trust.made_live(version, word, verdict)
            self._last_apply_s = time.perf_counter() - t0
            return version

    def _refused_delta(self, version: int, exc: DeltaRefusedError) -> None:
        """Says again which version is live after the delta of ``version`` was refused."""
        live = self._trust.live
        # Our APPLIED word may have been scribbled over (that is how a wrong base is
        # chosen): say again what we hold, so the publisher's next version comes dense.
        self._ctl[APPLIED] = NO_SLOT if live is None else live
        log.warning("subscriber %s: delta version %d of %r refused, live weights stay on %s: %s", self.t.name,
                    version, self.name, live, exc)

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
        trust = self._trust
        with anyio.move_on_after(timeout):
            while True:
                if trust.live is not None and trust.live >= version and await trust.ask(trust.live) is not Vouch.NO:
                    return trust.live
                latest = self.latest
                if latest is not None and latest >= version and await self.apply_async() is not None:
                    continue
                if self._deltas is not None and self._deltas.refused(int(self._ctl[FRONT])) and latest is not None \
                        and latest >= version and await self._pull_refused(timeout):
                    continue
                try:  # the doorbell wakes us; polling covers an unacknowledged one
                    await self.t.wait_signal(self._keys.doorbell, at_least=version, timeout=0.05)
                except TransferTimeoutError:
                    pass
        if (live := trust.live_at_least(version)) is not None:
            return live  # the timeout fell during the copy
        raise TransferTimeoutError(f"{self.t.name}: version {version} of {self.name!r} did not arrive within "
                                   f"{timeout:g}s (live: {trust.live})")

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
        buf: torch.Tensor | None = None

        async def attempt() -> int | Pending | None:
            ctl = await read_words(t, self.publisher, k.pubctl, CTL_WORDS)
            front = decode_front(int(ctl[FRONT]))
            filling = int(ctl[FILLING])  # a newer version whose snapshot is still being filled
            if front is None:
                return PENDING if filling else self._trust.live  # (filling: the first snapshot)
            version, slot = front
            self._trust.heard(ctl)
            live = self._trust.live
            if live is not None and max(version, filling) == live:
                return live
            # Past the publisher's own version (a third peer's word, or a restarted
            # publisher): the publisher's current version replaces it.
            reset = live is not None and live > max(version, filling)
            if filling > version:  # wait for it rather than take the older one
                return PENDING

            async def generation() -> int:
                return int((await read_words(t, self.publisher, k.pubctl, CTL_WORDS))[GEN0 + slot])

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
            live = self._trust.live
            if live is not None and version <= live and not reset:
                return live
            self._unpack(buf)
            self._trust.made_live(version, 0, Vouch.YES)  # the publisher's own copy
            if self._started:
                self._ctl[APPLIED] = version
            return version
