"""Waiting on control words another process writes: one poll loop and one seqlock read.

Weight sync never asks a peer to tell it something: the side that waits reads the other side's
control words one-sidedly (or its own, which the other side writes) until they say what it
waits for. :func:`poll` is that loop, with a backoff (a look costs a transfer, and a word that
is not ready now is often not ready for a while) capped so that a ready word is seen soon, and
a deadline that raises the library's timeout error naming what was waited for.

A snapshot that a writer rewrites in place is guarded by a generation counter (a seqlock): the
writer makes it odd before it writes and even again after, so a reader keeps a copy only if the
counter was even before its read and unchanged after it. :func:`seqlock_read` is one such read;
a torn one returns :data:`PENDING`, so it composes with :func:`poll`, which looks again.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import Final, Literal, TypeVar

import anyio

from .._errors import TransferTimeoutError

T = TypeVar("T")
S = TypeVar("S")


class _Pending(enum.Enum):
    PENDING = "pending"


PENDING: Final = _Pending.PENDING
"""What a probe returns to say "not yet: look again" (None can be a real result)."""
Pending = Literal[_Pending.PENDING]

FIRST_WAIT_S = 0.002  # the wait after the first look that found nothing
LONGEST_WAIT_S = 0.02  # the cap of the backoff: how late, at most, a ready word is seen


async def poll(probe: Callable[[], Awaitable[T | Pending]], *, timeout: float | None, what: str,
               why: Callable[[], str] | None = None, first: float = FIRST_WAIT_S,
               longest: float = LONGEST_WAIT_S) -> T:
    """Looks with ``probe`` until it has an answer, waiting ``first``, then twice as long after
    each look that found nothing, up to ``longest`` between two looks.

    Args:
        probe: one look (typically a one-sided ``get`` of a peer's control words and a check of
            them): returns the answer, or :data:`PENDING` to be called again. What it raises
            ends the poll and propagates as it is.
        timeout: seconds in all, looks included; None: no bound here (the caller's cancel
            scope bounds the wait, e.g. a deadline over a larger operation).
        what: what is waited for, as the error says it: ``"{what} within {timeout}s"``.
        why: called once the time is up; its text is appended after a colon (e.g. what the
            last look saw).
        first: the wait after the first look that found nothing (seconds).
        longest: the longest wait between two looks (seconds).

    Returns:
        The probe's first answer.

    Raises:
        TransferTimeoutError: no answer within ``timeout``; a look in flight at that moment is
            cancelled.

    Cancellation: the look in flight is cancelled with the caller; nothing is left behind here
    (whatever a probe changes, it must undo itself, e.g. in a ``finally``).
    """
    wait = first
    with anyio.move_on_after(timeout):
        while True:
            got = await probe()
            if got is not PENDING:
                return got
            await anyio.sleep(wait)
            wait = min(2 * wait, longest)
    detail = f": {why()}" if why is not None else ""
    raise TransferTimeoutError(f"{what} within {timeout:g}s{detail}")


async def seqlock_read(stamp: Callable[[], Awaitable[S]], read: Callable[[], Awaitable[T]], *,
                       stable: Callable[[S], bool], seen: S | None = None) -> T | Pending:
    """One read of data that its writer rewrites in place, guarded by a stamp (a seqlock).

    The stamp (typically a generation counter, odd while the data is written) is read before
    the data and again after it: the copy is kept only if the first stamp said the data was
    ``stable`` and the second equals it, i.e. no write began or ended while it was read.

    Args:
        stamp: reads the stamp now (e.g. a one-sided ``get`` of the writer's control words).
        read: reads the data (into the caller's buffer) and returns what the caller keeps.
        stable: whether a stamp says the data may be read (e.g. an even counter).
        seen: the stamp as the caller read it just before, with the words it chose the data
            by; None: it is read here first.

    Returns:
        What ``read`` returned, or :data:`PENDING` when the data was being written, or was
        rewritten while it was read (the copy is torn: the caller reads again, e.g. inside
        :func:`poll`, and must not use what ``read`` wrote into its buffer).

    Raises:
        Whatever ``stamp`` or ``read`` raise (e.g. ``TransportError`` when the writer is gone).

    Cancellation: propagates from the read in flight; the caller's buffer is then undefined.
    """
    before = await stamp() if seen is None else seen
    if not stable(before):
        return PENDING
    got = await read()
    if await stamp() != before:
        return PENDING
    return got


def even(generation: int) -> bool:
    """Whether a generation counter says its data is stable (even: no write in progress)."""
    return generation % 2 == 0
