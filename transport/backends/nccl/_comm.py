"""One communicator of the ``nccl`` backend, with everything it owns.

A :class:`Comm` is one NCCL communicator (two ranks: the ends of one ordered peer pair; or one
rank, for transfers to this very Transport) together with its CUDA stream, its ack buffers,
its issue order, and why it was aborted. Only its own methods change that state: the backend
and the table of communicators (:mod:`._comms`) call them and read its identity; it never calls
back into either. An initiator's Comm holds the target's record and the :class:`Requests` of its
backend, so it posts its transfers and tells the target when it aborts, itself.

Issue order: NCCL matches sends and receives in the order each rank issues them, so the
initiator issues under :attr:`Comm._order` and numbers its transfers; the target serves them in
that order and refuses (aborts) on a gap. Ack slot ``seq % ACK_SLOTS`` is held by transfer
``seq`` until it has read its ack, so transfer ``seq + ACK_SLOTS`` cannot overwrite it first.

Streams: every Comm has a CUDA stream of its own, created for it and destroyed when it is
aborted. (torch's ``torch.cuda.Stream()`` hands out 32 pooled streams per device round-robin,
shared with everything else in the process, e.g. ProcessGroupNCCL: a receive waiting for one
peer would block every other peer's transfers, or the application's work, queued on the same
stream, and two processes could each block the other's next operation.)

Failures: an operation cancelled or timed out after both ends enqueued gets a short grace to
finish; otherwise the communicator is aborted (``ncclCommAbort``: NCCL lets go of the buffers).
Other transfers on an aborted Comm fail with the error it was aborted with (an operation that an
abort cut short also completes on its stream, so a completed event on a lost Comm is a failure).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import anyio
import torch

from ... import _cuda
from ..._errors import (
    PeerLostError,
    TransferAbortedError,
    TransportError,
    TransportInternalError,
)
from ..._native.nccl import Communicator, NcclError, NcclResult
from ..._wire import PeerRecord, TransferOp
from ._protocol import Op, Requests, remaining

log = logging.getLogger(__name__)

ACK_SLOTS = 64  # transfers in flight per communicator (each has its ack slot)
ACK_BYTES = 8
CANCEL_GRACE_S = 0.5  # a cancelled transfer already enqueued may finish within this, else abort
_POLL_MIN_S, _POLL_MAX_S = 20e-6, 2e-3


@dataclasses.dataclass(frozen=True)
class Posted:
    """An initiator's transfer that both ranks have enqueued; it holds ack slot
    ``seq % ACK_SLOTS`` until :meth:`Comm.complete`."""

    seq: int
    direction: TransferOp
    event: Any  # torch.cuda.Event recorded after our side


@dataclasses.dataclass(frozen=True)
class Accepted:
    """A target's transfer whose first operation is enqueued; the issue order stays held until
    :meth:`Comm.finish`."""

    seq: int
    direction: TransferOp
    first: NcclResult


class Comm:
    """One communicator with its stream and ack buffers, as initiator (rank 0), target (rank 1),
    or the 1-rank communicator of transfers to self.

    Args:
        cid: the comm id (also the NCCL communicator's name).
        peer, incarnation: the other end (this very Transport for a 1-rank Comm).
        nccl: the communicator; this Comm aborts it.
        stream: a ``torch.cuda.ExternalStream`` over ``stream_handle``.
        stream_handle: the CUstream, created for this Comm; destroyed when it is aborted.
        ack_dev: ``ACK_SLOTS`` int64 on the device. ack_host: their copies in page-locked host
            memory (initiator only), ``ack_pinned``'s: registered by us, not taken from torch's
            caching host allocator, which would record our stream on the block and, when the
            block is freed after the stream was destroyed, record an event on a stream that no
            longer exists (the process crashed so at close).
        pair: "<local uuid>><remote uuid>" as the initiator names the GPU pair.
        owner: this Transport's name (for the log).
        target, requests: initiator only: the target's record and the requests to its agent.
    """

    def __init__(self, cid: str, peer: str, incarnation: str, nccl: Communicator, stream: Any, stream_handle: int,
                 ack_dev: torch.Tensor, ack_host: torch.Tensor | None, *, ack_pinned: _cuda.PinnedBuffer | None = None,
                 pair: str = "", owner: str = "", target: PeerRecord | None = None,
                 requests: Requests | None = None) -> None:
        self.cid = cid
        self.peer = peer
        self.incarnation = incarnation
        self.pair = pair
        self.nccl = nccl
        self._stream = stream
        self._stream_handle = stream_handle
        self._ack_dev = ack_dev
        self._ack_host = ack_host
        self._ack_pinned = ack_pinned
        self._owner = owner
        self._target = target
        self._requests = requests
        self._seq = 0  # initiator: next seq to post; target: next seq expected
        self._order = anyio.Semaphore(1)  # a semaphore: the target releases it in another task
        self._slots = [anyio.Lock() for _ in range(ACK_SLOTS)]
        self._lost: TransportError | None = None

    @classmethod
    def create(cls, cid: str, peer: str, incarnation: str, nccl: Communicator, *, initiator: bool, pair: str = "",
               owner: str = "", target: PeerRecord | None = None, requests: Requests | None = None) -> Comm:
        """A Comm over ``nccl`` with a new stream and ack buffers on its device.

        Raises:
            TransportInternalError: CUDA could not provide them (``nccl`` is aborted then).
        """
        device, handle = nccl.device, 0
        pinned: _cuda.PinnedBuffer | None = None
        try:
            with torch.cuda.device(device):  # also restores the current device the driver call sets
                handle = _cuda.stream_create(device)
                stream = torch.cuda.ExternalStream(handle, device=torch.device("cuda", device))
                ack_dev = torch.zeros(ACK_SLOTS, dtype=torch.int64, device=f"cuda:{device}")
                # The zeros are written (and the block was last used) on the current stream,
                # which our stream does not otherwise wait for: order it after them once.
                stream.wait_stream(torch.cuda.current_stream(device))
                ack_host = None
                if initiator:
                    pinned = _cuda.PinnedBuffer(ACK_SLOTS * ACK_BYTES, device)
                    ack_host = pinned.tensor[: ACK_SLOTS * ACK_BYTES].view(torch.int64).fill_(-1)
        except BaseException as exc:
            nccl.abort()
            if handle:
                _destroy_stream(handle, device, cid)
            if pinned is not None:
                _free_pinned(pinned, cid)
            if isinstance(exc, Exception) and not isinstance(exc, TransportError):
                raise TransportInternalError(f"cannot set up comm {cid} with {peer} on cuda:{device}: {exc}") from exc
            raise
        return cls(cid, peer, incarnation, nccl, stream, handle, ack_dev, ack_host, ack_pinned=pinned, pair=pair,
                   owner=owner, target=target, requests=requests)

    @property
    def device(self) -> int:
        return self.nccl.device

    @property
    def lost(self) -> TransportError | None:
        """Why this Comm was aborted, or None while it is usable."""
        return self._lost

    @property
    def _other(self) -> int:
        return 1 - self.nccl.rank if self.nccl.nranks == 2 else 0

    # -- failure --------------------------------------------------------------------------------

    def nccl_error(self, exc: NcclError | TimeoutError, what: str) -> TransportError:
        """The transport error for an NCCL failure of an operation on this Comm."""
        if isinstance(exc, TimeoutError):
            return TransportInternalError(f"{what}: enqueueing timed out")
        cls = PeerLostError if exc.remote else TransportInternalError
        err = cls(f"{what} failed on comm {self.cid} with {self.peer}: {exc}")
        err.__cause__ = exc
        return err

    def lost_error(self, what: str) -> TransportError:
        """The error of operation ``what`` on this aborted Comm."""
        why = self._lost
        cls = type(why) if isinstance(why, (PeerLostError, TransferAbortedError)) else TransportInternalError
        err = cls(f"{what}: comm {self.cid} was aborted: {why}")
        if isinstance(err, TransferAbortedError):
            err.partial = True
        err.__cause__ = why
        return err

    def abort(self, why: TransportError, *, tell: bool = True) -> TransportError:
        """Marks this Comm lost (once), aborts its communicator and destroys its stream; an
        initiator's also asks the target to abort its side, unless ``tell`` is False (the peer
        is gone, or we are closing). Returns ``why``."""
        if self._lost is not None:
            return why
        self._lost = why
        log.info("transport %s: aborting nccl comm %s (%s)", self._owner, self.cid, why)
        self.nccl.abort()  # blocks until NCCL's own work is gone; it keeps nothing of our stream
        # Our own work on the stream (an ack copied to the host, events) may still be queued
        # behind NCCL's: it ends before the stream goes and before the ack buffers may be
        # reused or unlocked. Nothing enqueues on a lost Comm's stream (every enqueue checks
        # ``_lost`` or the aborted communicator first, with no await in between).
        device = self.nccl.device
        try:
            with torch.cuda.device(device):
                _cuda.stream_synchronize(self._stream_handle, device)
        except Exception as exc:  # noqa: BLE001 - an abort must not fail; say it happened
            log.warning("nccl: waiting for the stream of comm %s failed: %s", self.cid, exc)
        _destroy_stream(self._stream_handle, device, self.cid)
        if self._ack_pinned is not None:  # the tensor over it stays valid (pageable memory)
            _free_pinned(self._ack_pinned, self.cid)
            self._ack_pinned = None
        if tell and self._target is not None and self._requests is not None:
            self._requests.tell_close(self._target, self.cid)
        return why

    def _raise_if_lost(self, what: str) -> None:
        if self._lost is not None:
            raise self.lost_error(what)

    # -- opening ----------------------------------------------------------------------------

    async def ready(self, what: str) -> None:
        """Waits until NCCL finished creating the communicator (not bounded: bound it outside).

        Raises:
            NcclError: the init failed (the caller aborts).
        """
        await self.nccl.settle(what)

    async def connect(self, what: str) -> None:
        """Finishes this rank's init and exchanges the warm-up message (both ranks at once), so
        that a Comm that cannot connect fails here, not in a transfer.

        Raises:
            TransportError: it failed (this Comm is aborted then).
        """
        try:
            await self.ready(f"init for {what}")
            h, peer = self._stream.cuda_stream, self._other
            ptr0, ptr1 = self._ack_dev[0].data_ptr(), self._ack_dev[1].data_ptr()
            result = self.nccl.grouped("the warm-up exchange", [lambda: self.nccl.send(ptr0, ACK_BYTES, peer, h),
                                                                 lambda: self.nccl.recv(ptr1, ACK_BYTES, peer, h)])
            await self.nccl.settled(result, f"warm-up on comm {self.cid}")
        except NcclError as exc:
            raise self.abort(self.nccl_error(exc, f"opening comm {self.cid} for {what}")) from exc
        await self.wait(self._record(), f"connecting comm {self.cid}")

    def _record(self) -> Any:
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    # -- waiting ----------------------------------------------------------------------------

    async def wait(self, event: Any, what: str) -> None:
        """Polls ``event`` (with backoff) while watching the communicator for failure.

        Raises:
            PeerLostError / TransportInternalError / TransferAbortedError: the communicator
            failed or was aborted (it is aborted then), also when ``event`` completed: an
            aborted operation completes on its stream without having moved its bytes.

        Cancellation: only stops waiting (see :meth:`watch`).
        """
        delay = 0.0
        while True:
            done = event.query()
            self._raise_if_lost(what)
            try:
                self.nccl.state()
            except NcclError as exc:
                raise self.abort(self.nccl_error(exc, what)) from exc
            if done:
                return
            await anyio.sleep(delay)
            delay = min(max(2 * delay, _POLL_MIN_S), _POLL_MAX_S)

    async def grace_or_abort(self, event: Any, what: str) -> None:
        """After a cancelled or failed wait: the operations were enqueued, so NCCL may still be
        using the buffers. Lets them finish briefly, else aborts the communicator (NCCL then
        lets go of them). Never raises."""
        if self._lost is not None:
            return
        with anyio.move_on_after(CANCEL_GRACE_S):
            try:
                await self.wait(event, what)
                return
            except TransportError:
                return  # it failed and was aborted
        err = TransferAbortedError(f"{what} was cancelled or timed out on the device; comm {self.cid} to {self.peer} "
                                   "aborted", partial=True)
        log.warning("transport %s: %s", self._owner, err)
        self.abort(err)

    async def watch(self, event: Any, what: str) -> None:
        """:meth:`wait`; when that is cancelled or fails, :meth:`grace_or_abort` (shielded), so
        that no buffer is released while NCCL may still use it.

        Raises:
            as :meth:`wait`. Cancellation: returns only once NCCL let go of the buffers.
        """
        try:
            await self.wait(event, what)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.grace_or_abort(event, what)
            raise

    # -- initiator --------------------------------------------------------------------------

    async def post(self, direction: TransferOp, ptr: int, nbytes: int, ready: Any, fields: Mapping[str, Any],
                   timeout: float, what: str) -> Posted | None:
        """Asks the target to enqueue its side of our next transfer (``post`` with ``fields``:
        the region fields its agent checks) and enqueues ours, after ``ready``, in issue order.

        Returns:
            The posted transfer (holding its ack slot: pass it to :meth:`complete`), or None when
            the target no longer has this communicator (nothing was enqueued; this Comm is aborted).

        Raises:
            TransportError: the target refused (nothing was enqueued), or the post or our enqueue
                failed (this Comm is aborted then).

        Cancellation: before the request is sent, nothing happens; after, this Comm is aborted
        (the issue order is lost) unless the target replied, in which case ours is enqueued first.
        """
        if self._target is None or self._requests is None:
            raise TransportInternalError(f"comm {self.cid} is not an initiator's")
        target, requests = self._target, self._requests
        async with self._order:
            self._raise_if_lost(what)
            seq = self._seq
            slot = self._slots[seq % ACK_SLOTS]
            # Held until transfer seq - ACK_SLOTS has read its ack; nothing is sent before.
            await slot.acquire()
            keep_slot = False
            try:
                self._raise_if_lost(what)
                meta = requests.meta(Op.POST, cid=self.cid, seq=seq, dir=direction.value, **fields,
                                     timeout=remaining(timeout))
                try:
                    reply = await requests.send(target, meta)
                except PeerLostError as exc:
                    # The connection broke (or the peer restarted): the target may have enqueued.
                    self.abort(PeerLostError(f"{what}: the post to {target.name} failed ({exc}); "
                                             f"comm {self.cid} aborted"))
                    raise
                except TransportError:
                    raise  # a refusal: the target answers with an error only before it enqueues anything
                except BaseException:
                    # Cancelled after the request may have reached the target: the issue order is lost.
                    self.abort(TransferAbortedError(f"{what}: cancelled while posting; comm {self.cid} aborted",
                                                    partial=True))
                    raise
                if reply.get("comm") != "ok":
                    self.abort(PeerLostError(f"{target.name} no longer has comm {self.cid}"), tell=False)
                    return None
                self._seq += 1
                with anyio.CancelScope(shield=True):  # the target has enqueued: ours must follow
                    event = await self._enqueue_initiator(direction, ptr, nbytes, ready, seq, timeout, what)
                keep_slot = True  # released by complete()
                return Posted(seq, direction, event)
            finally:
                if not keep_slot:
                    slot.release()

    async def _enqueue_initiator(self, direction: TransferOp, ptr: int, nbytes: int, ready: Any, seq: int,
                                 timeout: float, what: str) -> Any:
        self._raise_if_lost(what)  # aborted while we waited for the reply: its stream is gone
        stream, nccl, peer, slot = self._stream, self.nccl, self._other, seq % ACK_SLOTS
        h = stream.cuda_stream
        stream.wait_event(ready)
        try:
            with anyio.fail_after(timeout):
                if direction is TransferOp.PUT:
                    await nccl.settled(nccl.send(ptr, nbytes, peer, h), what)
                    await nccl.settled(nccl.recv(self._ack_dev[slot].data_ptr(), ACK_BYTES, peer, h), what)
                    assert self._ack_host is not None
                    with torch.cuda.stream(stream):
                        self._ack_host[slot].copy_(self._ack_dev[slot], non_blocking=True)
                else:
                    await nccl.settled(nccl.recv(ptr, nbytes, peer, h), what)
        except NcclError as exc:
            raise self.abort(self.nccl_error(exc, what)) from exc
        except TimeoutError:
            raise self.abort(PeerLostError(f"{what}: NCCL did not finish enqueueing on comm {self.cid} within "
                                           f"{timeout:g}s")) from None
        return self._record()

    async def complete(self, posted: Posted, what: str) -> None:
        """Waits until ``posted`` is complete (a put: its ack arrived, so the bytes are in the
        target's memory) and releases its ack slot.

        Raises:
            TransportError: it failed; TransportInternalError when the ack carried another
                transfer's number (the ranks' operations did not match: this Comm is aborted).

        Cancellation: as :meth:`watch`.
        """
        slot = posted.seq % ACK_SLOTS
        try:
            await self.watch(posted.event, what)
            if posted.direction is TransferOp.PUT:
                assert self._ack_host is not None
                got = int(self._ack_host[slot])
                if got != posted.seq:
                    raise self.abort(TransportInternalError(
                        f"{what}: the ack on comm {self.cid} carried transfer {got}, not {posted.seq}: "
                        "the two ranks' operations did not match; communicator aborted"))
        finally:
            self._slots[slot].release()  # only now: transfer seq + ACK_SLOTS reuses the slot

    # -- target -----------------------------------------------------------------------------

    async def accept(self, seq: int, direction: TransferOp, ptr: int, nbytes: int, what: str) -> Accepted | None:
        """Takes the issue order for the initiator's transfer ``seq`` and enqueues its first
        operation (the receive of a put, the send of a get). The order stays held: pass the
        result to :meth:`finish`.

        Returns:
            None when this Comm is lost, ``seq`` is not the next one (this Comm is aborted), or
            NCCL refused (aborted): the initiator is told the communicator is gone.
        """
        await self._order.acquire()  # released once our side is fully enqueued (finish)
        if self._lost is not None or seq != self._seq:
            self._order.release()
            if self._lost is None:
                self.abort(TransportInternalError(f"comm {self.cid}: {self.peer} posted transfer {seq}, "
                                                  f"expected {self._seq}"))
            return None
        self._seq += 1
        h = self._stream.cuda_stream
        try:
            if direction is TransferOp.PUT:
                first = self.nccl.recv(ptr, nbytes, self._other, h)
            else:
                first = self.nccl.send(ptr, nbytes, self._other, h)
        except NcclError as exc:
            self._order.release()
            self.abort(self.nccl_error(exc, what))
            return None
        return Accepted(seq, direction, first)

    async def finish(self, accepted: Accepted, deadline: float, what: str, hold: object = None) -> None:
        """Completes the target's side of ``accepted`` (the ack of a put), releases the issue
        order and watches it until done; aborts this Comm on failure or when ``deadline``
        (``anyio.current_time()`` clock) passes. ``hold`` (the region) stays referenced until
        then, so that its tensor outlives NCCL's use of it. Never raises: failures are logged.
        """
        stream, nccl = self._stream, self.nccl
        try:
            with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                try:
                    self._raise_if_lost(what)  # aborted before this task ran: its stream is gone
                    await nccl.settled(accepted.first, what)
                    if accepted.direction is TransferOp.PUT:
                        slot = accepted.seq % ACK_SLOTS
                        with torch.cuda.stream(stream):
                            self._ack_dev[slot].fill_(accepted.seq)
                        ack = nccl.send(self._ack_dev[slot].data_ptr(), ACK_BYTES, self._other, stream.cuda_stream)
                        await nccl.settled(ack, what)
                    event = self._record()
                finally:
                    self._order.release()
                await self.wait(event, what)
        except NcclError as exc:
            log.warning("transport %s: %s", self._owner, self.abort(self.nccl_error(exc, what)))
        except TimeoutError:
            late = PeerLostError(f"{what} did not complete by the initiator's deadline on comm {self.cid}; aborted")
            log.warning("transport %s: %s", self._owner, late)
            self.abort(late)
        except TransportError as exc:
            log.info("transport %s: %s", self._owner, exc)
        except Exception as exc:  # noqa: BLE001 - e.g. a CUDA error from torch: this task must not take the Transport down
            err = TransportInternalError(f"{what} failed on comm {self.cid}: {type(exc).__name__}: {exc}")
            log.warning("transport %s: %s", self._owner, err)
            self.abort(err)
        del hold

    # -- to self (1 rank) ---------------------------------------------------------------------

    async def copy_self(self, send_ptr: int, recv_ptr: int, nbytes: int, ready: Any, timeout: float, what: str) -> Any:
        """Enqueues, after ``ready``, the grouped send and receive of ``nbytes`` on this 1-rank
        Comm; returns the event recorded after them (pass it to :meth:`watch`).

        Raises:
            TransportError: NCCL failed or did not finish enqueueing within ``timeout`` (aborted).
        """
        nccl, h = self.nccl, self._stream.cuda_stream
        self._stream.wait_event(ready)
        try:
            result = nccl.grouped(what, [lambda: nccl.send(send_ptr, nbytes, 0, h),
                                         lambda: nccl.recv(recv_ptr, nbytes, 0, h)])
            with anyio.fail_after(timeout):
                await nccl.settled(result, what)
        except (NcclError, TimeoutError) as exc:
            raise self.abort(self.nccl_error(exc, what)) from exc
        return self._record()


def _free_pinned(buf: _cuda.PinnedBuffer, cid: str) -> None:
    try:
        buf.free()
    except Exception as exc:  # noqa: BLE001 - releasing must not fail an abort; say it happened
        log.warning("nccl: unlocking the ack buffer of comm %s failed: %s", cid, exc)


def _destroy_stream(handle: int, device: int, cid: str) -> None:
    try:
        with torch.cuda.device(device):
            _cuda.stream_destroy(handle, device)
    except Exception as exc:  # noqa: BLE001 - releasing must not fail an abort; say it happened
        log.warning("nccl: destroying the stream of comm %s failed: %s", cid, exc)
