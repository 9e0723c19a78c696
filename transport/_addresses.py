"""Which of a peer's addresses a connection goes to, for a peer whose agent listens on several
(one per NIC, ``PeerRecord.addresses``): the policy that :class:`~._channel.ChannelPool` (the
control connections, the ``tcp`` checked path) and the ``tcp`` direct lanes follow. No I/O here.

* **Watched connections.** A connection to such a peer is watched by its kernel
  (``_sockets.watch_link``): one that hears nothing from the peer for ``ADDRESS_STALL_S`` (bytes
  unacknowledged, or keepalive probes unanswered while idle) is ended, so a cut link breaks it
  within seconds instead of leaving it open and dead. One that is idle and heard nothing for
  ``ADDRESS_SILENT_S`` (keepalive answers come every ``_sockets.KEEPALIVE_S`` while the link
  works) is not used again. A stopped or busy peer process is not mistaken for a cut link: its
  kernel still answers.
* **Failed addresses.** An address whose connection the link ended, that went silent, or that
  could not be connected to within ``ADDRESS_CONNECT_S`` (refused, unreachable, no answer)
  failed: the next connection goes elsewhere.
* **Order.** A new connection goes to the first address, in the peer's order, that has not
  failed in the last ``ADDRESS_RETRY_S``, else to the one that failed longest ago, trying the
  next when one fails. A connection stays where it works; after a failover, the first address
  is used again by the next connection made once its retry time has passed (the connection in
  use broke, or was closed for idleness).

The state is one :class:`Route` per peer with several addresses: its addresses (at most
``MAX_AGENT_ADDRESSES``, checked when its record was read) and when each failed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

ADDRESS_STALL_S = 3.0
ADDRESS_SILENT_S = 2.0
ADDRESS_RETRY_S = 30.0
ADDRESS_CONNECT_S = 5.0

Address = tuple[str, int]


@dataclasses.dataclass(eq=False)
class Route:
    """Which of one peer incarnation's addresses its connection goes to, and when each failed."""

    incarnation: str
    addresses: tuple[Address, ...]
    failed: list[float]  # per address: when it last failed (time.monotonic(); -inf: never)
    at: int = 0  # the address the connection uses (or the next one will)
    _last: object = None  # the connection whose failure was recorded last

    def order(self, now: float) -> list[int]:
        """The addresses to try, best first (see the module docstring)."""
        fresh = [i for i, t in enumerate(self.failed) if now - t > ADDRESS_RETRY_S]
        return fresh + sorted((i for i in range(len(self.addresses)) if i not in fresh), key=lambda i: self.failed[i])

    @property
    def address(self) -> Address:
        """Where the connection goes (see :attr:`at`)."""
        return self.addresses[self.at]

    def fail(self, address: Address, now: float, conn: object = None) -> bool:
        """Records that ``address`` failed (once per connection ``conn``: its other requests
        report the same), and moves :attr:`at` to the best other one. Returns whether it was
        recorded (False: already, or not one of this peer's addresses)."""
        if (conn is not None and conn is self._last) or address not in self.addresses:
            return False
        self._last = conn
        i = self.addresses.index(address)
        self.failed[i] = now
        self.at = self.order(now)[0]
        return True

    def connected(self, i: int) -> None:
        """A connection to address ``i`` was made: it is the one in use."""
        self.at = i


class Routes:
    """The :class:`Route` of every peer with several addresses (one per peer, its latest
    incarnation and address list)."""

    def __init__(self) -> None:
        self._routes: dict[str, Route] = {}

    def get(self, peer: str, incarnation: str, addresses: Sequence[Address]) -> Route | None:
        """``peer``'s route (made, or made anew for a new incarnation or address list); None
        for a peer with one address (nothing to choose)."""
        if len(addresses) < 2:
            return None
        route = self._routes.get(peer)
        if route is None or route.incarnation != incarnation or route.addresses != tuple(addresses):
            route = self._routes[peer] = Route(incarnation, tuple(addresses), [-math.inf] * len(addresses))
        return route

    def forget(self, peer: str) -> None:
        self._routes.pop(peer, None)

    def clear(self) -> None:
        self._routes.clear()
