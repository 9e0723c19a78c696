"""Signals: small named integers a peer sets here, ordered after its earlier puts.

:class:`Signals` owns this endpoint's signal values and the event its waiters sleep on, and
sends signals to peers over the control connection (after fencing earlier transfers to them).
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from ._channel import ChannelPool
from ._errors import TransferTimeoutError, TransportError
from ._flight import FlightRecorder, OpState
from ._peers import PeerDirectory
from ._transfers import TransferEngine
from ._wire import FrameKind, SignalRequest


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
        self._values: dict[str, int] = {}
        self._event = anyio.Event()

    # -- receiving ------------------------------------------------------------------------

    def deliver(self, request: SignalRequest) -> None:
        """A peer set signal ``request.name`` here (called by the agent)."""
        self._values[request.name] = request.value
        self.wake()

    def wake(self) -> None:
        """Wakes every waiter (a value changed, or the Transport closed)."""
        event, self._event = self._event, anyio.Event()
        event.set()

    def value(self, name: str) -> int | None:
        return self._values.get(name)

    async def wait(self, name: str, at_least: int, timeout: float, check_open: Callable[[], None]) -> int:
        """See ``Transport.wait_signal``."""
        with anyio.move_on_after(timeout):
            while True:
                check_open()
                value = self._values.get(name)
                if value is not None and value >= at_least:
                    return value
                await self._event.wait()
        raise TransferTimeoutError(
            f"{self.name}: signal {name!r} did not reach {at_least} within {timeout:g}s (now {self._values.get(name)})"
        )

    # -- sending --------------------------------------------------------------------------

    async def send(self, peer: str, name: str, value: int, timeout: float) -> None:
        """See ``Transport.signal``."""
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
