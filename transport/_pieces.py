"""A transfer moved in pieces: how it is cut, what each piece waits for, and the one schedule
that runs them.

Every path that moves a transfer part by part runs on :func:`run`: a backend's default runner
of a prepared transfer (one piece per run, ``Backend.prepare_runs``), the engine's staged runs
and a bounce buffer's chunks (``transport._staging``), the CUDA IPC copies of a prepared
transfer (one piece per device) and tcp's run frames. :func:`cut` cuts a byte range into pieces
of at most a given size; :func:`of_runs` makes one :class:`RunPiece` of each run of a prepared
transfer.

CUDA: a piece of CUDA memory waits for its device's ready event (:data:`Ready`), which the
transfer engine records on that device's current stream when the transfer starts. Nothing
below the engine records one: a CUDA piece reached without it is a bug, and
:func:`ready_on` / :func:`ready_of` raise ``TransportInternalError`` rather than move bytes the
caller's queued work may not have written yet.

This module sits below the backends and the engine (both use it) and knows neither.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

import anyio
import torch

from ._errors import TransportError, TransportInternalError
from ._tensors import LocalBuffer, MemoryKind, RemoteTarget, Runs, nbytes_of
from ._wire import PeerRecord, RegionRecord

# The ready events of one start of a transfer: device index -> the torch.cuda.Event recorded
# on that device's current stream when the transfer started (one per device it touches).
Ready = Mapping[int, Any]

NO_READY: Ready = MappingProxyType({})  # a transfer that touches no CUDA memory

_P = TypeVar("_P")


def cut(nbytes: int, most: int) -> list[tuple[int, int]]:
    """(offset, size) of the pieces ``nbytes`` bytes are moved in: in order, at most ``most``
    bytes each (a caller that needs whole elements passes a multiple of the element size)."""
    if most < 1:
        raise ValueError(f"a piece holds at least one byte, not {most}")
    return [(pos, min(most, nbytes - pos)) for pos in range(0, nbytes, most)]


async def run(pieces: Sequence[_P], move: Callable[[_P], Awaitable[None]], inflight: int | None) -> None:
    """Moves every piece with ``move``, started in order, at most ``inflight`` at once (None:
    all at once; 1: one after the other, on the caller's task).

    Raises:
        TransportError: the first one a piece raised. From then on no piece is started; the
            pieces already in flight run to their end (their own errors are dropped: the first
            is what happened). Any other exception is a bug: it cancels the pieces in flight and
            propagates (from the task group, as an exception group, when several ran at once).
        ValueError: ``inflight`` < 1.

    Cancellation: the pieces in flight are cancelled, and this returns (re-raising) only once
    each of them has returned; what a piece does when cancelled is its own (a device copy, which
    cannot be recalled, returns once it has ended). No piece is started after.
    """
    if inflight is not None and inflight < 1:
        raise ValueError(f"at least one piece must be in flight, not {inflight}")
    first: list[TransportError] = []
    todo = iter(pieces)

    async def mover() -> None:
        for piece in todo:
            if first:
                return
            try:
                await move(piece)
            except TransportError as exc:
                first.append(exc)
                return

    workers = min(len(pieces), inflight or len(pieces))
    if workers <= 1:
        await mover()
    else:
        async with anyio.create_task_group() as tg:
            for _ in range(workers):
                tg.start_soon(mover)
    if first:
        raise first[0]


def ready_on(ready: Ready, device: int) -> Any:
    """The ready event of CUDA ``device`` in ``ready``.

    Raises:
        TransportInternalError: there is none (the engine records one for every device a
            transfer touches: this is a bug, reported rather than moving unready bytes).
    """
    event = ready.get(device)
    if event is None:
        raise TransportInternalError(f"CUDA memory on device {device} was reached without the ready event its "
                                     "transfer records when it starts")
    return event


def ready_of(local: LocalBuffer) -> Any:
    """``local.ready``: for CUDA memory the event to wait for (see :func:`ready_on`), for host
    memory None.

    Raises:
        TransportInternalError: CUDA memory without one.
    """
    if local.kind != MemoryKind.CUDA:
        return None
    if local.ready is None:
        raise TransportInternalError(f"a CUDA tensor on {local.tensor.device} was reached without the ready event "
                                     "its transfer records when it starts")
    return local.ready


@dataclass(frozen=True)
class RunPiece:
    """One run of a prepared transfer, moved on its own (a backend's default runner, or the
    engine through a bounce buffer).

    Attributes:
        view: the run's bytes here (a view of its local base, with its dtype).
        kind: the memory they are in.
        remote: where they go (or come from) in the peer's region.
    """

    view: torch.Tensor
    kind: MemoryKind
    remote: RemoteTarget

    def local(self, ready: Ready) -> LocalBuffer:
        """The run's local side for one start, waiting for its device's event in ``ready``.

        Raises:
            TransportInternalError: CUDA memory on a device ``ready`` has no event for.
        """
        if self.kind != MemoryKind.CUDA:
            return LocalBuffer(self.view, self.kind)
        return LocalBuffer(self.view, self.kind, ready_on(ready, self.view.get_device()))


def of_runs(peer: PeerRecord, lists: Iterable[tuple[Runs, RegionRecord]]) -> list[RunPiece]:
    """One piece per run of ``lists`` (each with the region of ``peer``'s record it goes to)."""
    return [RunPiece(view, r.local.kind, RemoteTarget(peer, region, offset, nbytes_of(view)))
            for r, region in lists for view, offset in r.pieces()]
