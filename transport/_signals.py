"""Signals: small named integers a peer sets here, ordered after its earlier puts.

:class:`Signals` owns this endpoint's signal values and the event its waiters sleep on, and
sends signals to peers over the control connection (after fencing earlier transfers to them).

The table is bounded whatever peers send: names are at most MAX_SIGNAL_NAME_BYTES (longer ones
are refused on the wire), and it holds the MAX_SIGNALS most recently set names. Setting one more
forgets the least recently set name nobody is waiting for (``signal_value`` is None again).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import anyio

from ._channel import ChannelPool
from ._errors import TransferTimeoutError, TransportError
from ._flight import FlightRecorder, OpState
from ._peers import PeerDirectory
from ._transfers import TransferEngine
from ._wire import FrameKind, SignalRequest, check_signal_name

MAX_SIGNALS = 65_536


class Signals:
    """This endpoint's signal table, and the sending side.

    Args:
        name: the Transport's name (for messages).
        directory: resolves peers.
        transfers: fences earlier transfers before a signal goes out.
        control: the control connections to peers' agents.
        flight: the flight recorder.
    """

    def __init__(self, name: str, directory: PeerDirectory, transfers: TransferEngine, control: ChannelPool,
                 flight: FlightRecorder) -> None:
        self.name = name
        self._directory = directory
        self._transfers = transfers
        self._control = control
        self._flight = flight
        self._values: collections.OrderedDict[str, int] = collections.OrderedDict()  # least recently set first
        self._waited: dict[str, int] = {}  # name -> tasks waiting for it (never forgotten meanwhile)
        self._event = anyio.Event()

    # -- receiving ------------------------------------------------------------------------

    def deliver(self, request: SignalRequest) -> None:
        """A peer set signal ``request.name`` here (called by the agent)."""
        self._values[request.name] = request.value
        self._values.move_to_end(request.name)
        if len(self._values) > MAX_SIGNALS:
            for name in self._values:
                if name not in self._waited:
                    del self._values[name]
                    break
        self.wake()

    def wake(self) -> None:
        """Wakes every waiter (a value changed, or the Transport closed)."""
        event, self._event = self._event, anyio.Event()
        event.set()

    def value(self, name: str) -> int | None:
        return self._values.get(name)

    async def wait(self, name: str, at_least: int, timeout: float, check_open: Callable[[], None]) -> int:
        """See ``Transport.wait_signal``."""
        self._waited[name] = self._waited.get(name, 0) + 1
        try:
            with anyio.move_on_after(timeout):
                while True:
                    check_open()
                    value = self._values.get(name)
                    if value is not None and value >= at_least:
                        return value
                    await self._event.wait()
        finally:
            if (left := self._waited.pop(name) - 1) > 0:
                self._waited[name] = left
        raise TransferTimeoutError(
            f"{self.name}: signal {name!r} did not reach {at_least} within {timeout:g}s (now {self._values.get(name)})"
        )

    # -- sending --------------------------------------------------------------------------

    async def send(self, peer: str, name: str, value: int, timeout: float) -> None:
        """See ``Transport.signal``."""
        check_signal_name(name)
        rec = self._flight.start("signal", peer, name, 8)
        try:
            with anyio.fail_after(timeout):
                await self._transfers.fence(peer, timeout)
                record = await self._directory.resolve(peer)
                chan = await self._control.get(record.name, record.incarnation, record.agent)
                self._flight.transition(rec, OpState.MOVING, backend="control")
                await chan.request(FrameKind.SIGNAL, SignalRequest(name, value).to_meta())
        except TimeoutError:
            err = TransferTimeoutError(f"signal {name!r}={value} to {peer} not delivered within {timeout:g}s")
            self._flight.transition(rec, OpState.ABORTED, error=err)
            self._flight.dump(f"timeout: {err}", force=False)
            raise err from None
        except BaseException as exc:
            self._flight.transition(rec, OpState.FAILED if isinstance(exc, TransportError) else OpState.ABORTED,
                                    error=exc)
            raise
        self._flight.transition(rec, OpState.DONE)
