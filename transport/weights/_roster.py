"""Who a publisher serves: the stream publisher's subscribers listed now (:class:`Roster`), and,
for it and the mesh publisher alike, those served before that have left or died since, each
reported once (:class:`Departures`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._errors import PeerLostError

if TYPE_CHECKING:
    from .. import Peer, Transport
    from ._control import StreamKeys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scan:
    """One look at the store.

    Attributes:
        serve: the subscribers to serve now, by name.
        listed: every peer listed, as looked up now (None: its record is unusable, i.e. left by
            an exited process, or unreadable).
        left: subscribers served before that left on their own since (they unsubscribed, closed
            their Transport, or a new incarnation took the name), sorted.
        dead: subscribers served before whose process died since: (name, incarnation) -> why.
    """

    serve: dict[str, Peer]
    listed: dict[str, Peer | None]
    left: tuple[str, ...]
    dead: dict[tuple[str, str], str]


class Departures:
    """Whom a publisher served, and which of them have gone since: each reported once.

    One that was served and is no longer served is reported by the next :meth:`since` (left,
    or dead: its record is left by an exited process) and, once the publish that reported it
    completes (:meth:`served`), never again. A dead incarnation, and one lost during a publish
    (:meth:`lost`), is not served again while its record is listed (a restart under the name is
    a new incarnation). The stream publisher's :class:`Roster` and the mesh publisher keep one
    each.

    Args:
        who: the publisher's Transport name (in the logs).
        what: what it serves, for the logs ("subscriber", "generator rank").
    """

    def __init__(self, who: str, what: str) -> None:
        self.who, self.what = who, what
        self._served: dict[str, str] = {}  # name -> incarnation, until reported left or dead
        self._gone: set[tuple[str, str]] = set()  # (name, incarnation)s dead or lost: served no more

    def excluded(self, peer: Peer) -> bool:
        """Whether ``peer``'s incarnation is not to be served (dead, or lost)."""
        return (peer.name, peer.incarnation) in self._gone

    def since(self, serve: Mapping[str, Peer],
              listed: Mapping[str, Peer | None]) -> tuple[tuple[str, ...], dict[tuple[str, str], str]]:
        """Those served before that are not in ``serve`` now (``listed``: every peer as looked
        up now, None for a record left by an exited process or unreadable): (left, sorted;
        dead: (name, incarnation) -> why). Changes nothing (see :meth:`served`)."""
        left, dead = [], {}
        for name, incarnation in self._served.items():
            if name in serve:  # still served, or a restarted process under its name is (served as new)
                continue
            if name in listed and listed[name] is None:
                why = (f"{name} (incarnation {incarnation}) died: its record in the store is left by an exited "
                       f"process, or unreadable")
                dead[(name, incarnation)] = f"{PeerLostError.__name__}: {why}"
                log.warning("publisher %s: %s %s", self.who, self.what, why)
            else:  # no record (its Transport closed), not taking part any more, or a new incarnation
                left.append(name)
                log.info("publisher %s: %s %s (incarnation %s) left", self.who, self.what, name, incarnation)
        return tuple(sorted(left)), dead

    def lost(self, name: str, incarnation: str) -> None:
        """That incarnation is gone for good (a transfer to it found it lost): served no more."""
        self._gone.add((name, incarnation))

    def served(self, serve: Mapping[str, Peer], listed: Mapping[str, Peer | None],
               dead: Mapping[tuple[str, str], str]) -> set[tuple[str, str]]:
        """After the publish that served ``serve`` and reported ``dead`` (from one look at the
        store, ``listed``): who was served, for the next one's departures. Returns the (name,
        incarnation)s still served, whose prepared transfers are worth keeping."""
        self._gone.update(dead)
        still = {n: None if p is None else p.incarnation for n, p in listed.items()}  # None: stale record
        self._gone = {(n, i) for n, i in self._gone if n in still and still[n] in (None, i)}
        for name in [n for n in self._served if n not in serve]:
            del self._served[name]
        for name, peer in serve.items():
            if (name, peer.incarnation) in self._gone:
                self._served.pop(name, None)
            else:
                self._served[name] = peer.incarnation
        return {(n, p.incarnation) for n, p in serve.items() if (n, p.incarnation) not in self._gone}


class Roster:
    """The subscribers of one stream publisher, seen from its Transport: whom it serves, and
    whom it served before (:class:`Departures`).

    A subscriber is a listed peer with the stream's slots and control block.

    Args:
        transport: the publisher's Transport.
        keys: the stream's region names.
    """

    def __init__(self, transport: Transport, keys: StreamKeys) -> None:
        self.t, self._keys = transport, keys
        self._departures = Departures(transport.name, "subscriber")

    async def scan(self) -> Scan:
        """The subscribers now, and those served before that are gone. Changes no state: the
        publish that acts on it calls :meth:`served` once it completes (a cancelled publish
        leaves the departures to the next).

        Raises:
            ClosedError: the Transport is closed.
        """
        listed: dict[str, Peer | None] = {}
        serve = {}
        for n in await self.t.peers():
            if n == self.t.name:
                continue
            peer = listed[n] = await self.t.lookup(n)
            if peer is None or self._departures.excluded(peer):
                continue
            if self._keys.slots[1] in peer.regions and self._keys.ctl in peer.regions:
                serve[n] = peer
        left, dead = self._departures.since(serve, listed)
        return Scan(serve, listed, left, dead)

    def lost(self, name: str, incarnation: str) -> None:
        """That incarnation is gone for good (a transfer to it found it lost): served no more."""
        self._departures.lost(name, incarnation)

    def served(self, scan: Scan) -> set[tuple[str, str]]:
        """After the publish that acted on ``scan``: who was served, for the next one's
        departures. Returns the (name, incarnation)s still served, whose prepared transfers
        are worth keeping."""
        return self._departures.served(scan.serve, scan.listed, scan.dead)
