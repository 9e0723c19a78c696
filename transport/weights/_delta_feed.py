"""A delta version of a stream while the publisher makes it: the parts of its encodings as the
diff hands them out (:class:`DeltaFeed`), which the pushes to subscribers holding the base send
while the rest is diffed. A part is runs of two sources (:data:`._codec.parts.Part`): the
encoder's staging buffer and the new snapshot."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.from_thread
import anyio.lowlevel

from .._errors import TransportInternalError
from ._codec.encode import DeltaVersion
from ._codec.parts import Part


class DeltaFeed:
    """The encodings of one delta version, part by part as its diff finishes them (in order),
    then the whole version (:attr:`dv`) once the diff is done. Lives on
    the event loop's thread; :meth:`ready` is what the diff calls from its threads.

    Args:
        base: the version the delta is made against (a subscriber that holds it can follow the
            parts before the diff is done).
        fraction: the changed fraction the sample of the version found (a subscriber whose
            crossover is below it gets the version dense).
    """

    def __init__(self, base: int, fraction: float = 0.0) -> None:
        self.base = base
        self.fraction = fraction
        self.dv: DeltaVersion | None = None
        self._parts: list[Part] = []
        self._closed = False
        self._more = anyio.Event()

    def ready(self) -> Callable[[Part], None]:
        """What the diff calls, from any thread, with each part: it hands the part to this
        feed on the event loop's thread (and waits until it has). Call on that thread."""
        token = anyio.lowlevel.current_token()

        def hand(part: Part) -> None:
            anyio.from_thread.run_sync(self._add, part, token=token)

        return hand

    def _add(self, part: Part) -> None:
        self._parts.append(part)
        self._wake()

    def close(self, dv: DeltaVersion) -> None:
        """The diff is done: ``dv`` is the version, its parts all handed out."""
        self.dv = dv
        self._closed = True
        self._wake()

    def fail(self) -> None:
        """The diff failed: no more parts, and no version."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        more, self._more = self._more, anyio.Event()
        more.set()

    async def part(self, index: int) -> Part | None:
        """Part ``index`` (from 0), once handed out; None once the diff is done and there is
        no such part.

        Raises:
            TransportInternalError: the diff failed (the publish raises what it raised).
        """
        while index >= len(self._parts):
            if self._closed:
                self._version_or_raise()
                return None
            await self._more.wait()
        return self._parts[index]

    async def done(self) -> DeltaVersion:
        """The version, once the diff is done.

        Raises:
            TransportInternalError: the diff failed.
        """
        while not self._closed:
            await self._more.wait()
        return self._version_or_raise()

    def _version_or_raise(self) -> DeltaVersion:
        if self.dv is None:
            raise TransportInternalError("the diff of this version failed")
        return self.dv
