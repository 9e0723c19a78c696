"""Warming the pushes into subscribers' slots ahead of the first version, the same way for the
stream :class:`~transport.weights.Publisher` and the :class:`~transport.weights.MeshPublisher`:
each finds what is new (its own roster), and this readies it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from .._errors import TransportError

if TYPE_CHECKING:
    from .. import PreparedTransfer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmTarget:
    """One subscriber (or generator rank) whose slots were not pushed to or warmed yet.

    Attributes:
        label: how the log names it.
        slots: the slot indices to warm, in order.
        prepare: the prepared push into a slot (made and kept by the publisher).
        drop: forgets the prepared push into a slot (its warm failed: the next publish makes it anew).
        ready: reads to make first, within the same deadline (e.g. the first control-word read), or None.
    """

    label: str
    slots: Sequence[int]
    prepare: Callable[[int], PreparedTransfer]
    drop: Callable[[int], object]
    ready: Callable[[], Awaitable[None]] | None = None


async def warm_pushes(targets: Sequence[WarmTarget], deadline: float, errors: tuple[type[Exception], ...],
                      who: str) -> int:
    """Warms each target's slots (:meth:`PreparedTransfer.warm`), each target within ``deadline``
    seconds. A target that fails with one of ``errors`` (or ``TransportError`` / a timeout) is
    skipped and logged, and the prepared push of the slot that failed is dropped; the others go on.

    Returns:
        The slots warmed.

    Cancellation: safe; what was warmed stays warm.
    """
    caught: tuple[type[Exception], ...] = (TransportError, TimeoutError, *errors)
    warmed = 0
    for target in targets:
        slot = target.slots[0]
        try:
            with anyio.fail_after(deadline):
                if target.ready is not None:
                    await target.ready()
                for slot in target.slots:
                    await target.prepare(slot).warm(timeout=deadline)
                    warmed += 1
        except caught as exc:
            target.drop(slot)
            log.info("%s: cannot warm the pushes to %s: %s", who, target.label, exc)
    return warmed
