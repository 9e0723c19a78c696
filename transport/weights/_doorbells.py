"""The doorbells a stream publisher rings once a version is complete in a subscriber
(:class:`Doorbells`): in the background, at most one ring per subscriber in flight, always for
the newest version."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .._errors import TransportError

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from .. import Transport

log = logging.getLogger(__name__)


class Doorbells:
    """Rings each subscriber's doorbell signal with its newest complete version.

    A subscriber busy generating acknowledges a ring when it next yields, and nobody waits for
    that: the publisher has set its front already, so ``apply()``/``wait_version`` see the
    version without the ring. A ring that is not acknowledged within ``deadline`` is logged and
    dropped.

    Args:
        transport: the publisher's Transport.
        key: the doorbell signal's name.
        deadline: seconds one ring waits for its acknowledgement.
    """

    def __init__(self, transport: Transport, key: str, deadline: float) -> None:
        self.t, self.key, self.deadline = transport, key, deadline
        self._ringing: dict[tuple[str, str], int] = {}  # (subscriber, incarnation) -> newest version to ring
        self._tg: TaskGroup | None = None

    def open(self, tg: TaskGroup) -> None:
        """Rings from now on in tasks of ``tg`` (the publisher's, open from start to aclose)."""
        self._tg = tg

    def close(self) -> None:
        """Rings no more (the rings in flight end with their task group)."""
        self._tg = None

    @property
    def pending(self) -> bool:
        """Whether a ring is not acknowledged yet."""
        return bool(self._ringing)

    def ring(self, sub: str, incarnation: str, version: int) -> None:
        """Rings ``sub``'s doorbell with ``version`` in the background (or, when a ring to it is in
        flight, once that one ends). Does nothing once closed."""
        if self._tg is None:
            return
        key = (sub, incarnation)
        pending = key in self._ringing
        self._ringing[key] = version
        if not pending:
            self._tg.start_soon(self._loop, key)

    async def _loop(self, key: tuple[str, str]) -> None:
        sub = key[0]
        try:
            while True:
                version = self._ringing[key]
                try:
                    await self.t.signal(sub, self.key, version, timeout=self.deadline)
                except TransportError as exc:  # its front is set; apply()/wait_version poll it
                    log.info("publisher %s: doorbell %d to %s not acknowledged: %s", self.t.name, version, sub, exc)
                    return
                if self._ringing[key] == version:
                    return
        finally:
            self._ringing.pop(key, None)
