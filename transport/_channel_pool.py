"""The client connections of one Transport lane, :class:`ChannelPool`: at most one
:class:`~._channel.Channel` per peer, failing over between the addresses of a peer that listens
on several (``_addresses``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
from anyio.abc import TaskGroup

from ._addresses import ADDRESS_CONNECT_S, ADDRESS_RETRY_S, ADDRESS_SILENT_S, ADDRESS_STALL_S, Route, Routes
from ._auth import Authenticator
from ._channel import Channel
from ._errors import PeerLostError

log = logging.getLogger(__name__)


class ChannelPool:
    """At most one open :class:`Channel` per peer (per incarnation), opened on first use.

    A peer that listens on several addresses (one per NIC) is reached at one of them at a time,
    as ``_addresses`` says: its channels are watched by the kernel, an idle one that went silent
    is reset, and the next channel goes to another address when the link under the last one
    failed or it could not connect; :meth:`request` sends a request again at the next address
    when the link under it failed (never after a refusal, or the peer ending the connection).
    As with one address, a peer whose every address refused or could not be reached gets
    :class:`PeerLostError`, and one whose addresses give no answer is waited for until the
    caller's deadline.
    """

    def __init__(self, tg: TaskGroup, hello: Mapping[str, Any], auth: Authenticator) -> None:
        self._tg = tg
        self._hello = dict(hello)
        self._auth = auth
        self._channels: dict[str, tuple[str, Channel]] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._routes = Routes()  # peers with several addresses

    def address(self, peer: str, incarnation: str, addresses: Sequence[tuple[str, int]]) -> tuple[str, int]:
        """Where a connection to ``peer`` should go now: the address its channel uses (or the
        next one will), the first of ``addresses`` until one failed. For the tcp direct
        lanes, which follow the channel."""
        route = self._routes.get(peer, incarnation, addresses)
        return addresses[0] if route is None else route.address

    def _usable(self, chan: Channel, route: Route | None) -> bool:
        """Whether ``chan`` (open, not idle for too long) may take a request; to a peer with
        several addresses, not if it is idle and heard nothing for ``ADDRESS_SILENT_S`` (its
        link is cut: it is reset and its address counts as failed)."""
        if route is None or chan.outstanding:
            return True
        silent = chan.silent_for()
        if silent is None or silent <= ADDRESS_SILENT_S:
            return True
        self._failed(route, chan, f"heard nothing for {silent:.1f}s")
        chan.abort(PeerLostError(f"connection to {chan.peer} silent for {silent:.1f}s"))
        return False

    def _failed(self, route: Route, chan: Channel, why: str) -> None:
        """``chan``'s address failed (recorded once per channel): the next channel goes elsewhere."""
        address = chan.address
        if address is not None and route.fail(address, time.monotonic(), chan):
            log.warning("%s connection to %s at %s:%d failed (%s); the next goes to %s:%d, and this address is "
                        "tried first again in %gs", self._hello.get("lane"), chan.peer, *address, why, *route.address,
                        ADDRESS_RETRY_S)

    async def get(self, peer: str, incarnation: str, *addresses: tuple[str, int]) -> Channel:
        """The open channel to ``peer``'s ``incarnation``, opened now (at one of ``addresses``,
        the peer's, first one first: see the class docstring) if there is none that works.

        Raises:
            PeerLostError: no address could be reached, or another incarnation answered.
            AuthenticationError, TransportError: as :meth:`Channel.open`.
        """
        chan = self._working(peer, incarnation, self._routes.get(peer, incarnation, addresses))
        if chan is not None:
            return chan
        lock = self._locks.setdefault(peer, anyio.Lock())
        async with lock:
            route = self._routes.get(peer, incarnation, addresses)
            chan = self._working(peer, incarnation, route)
            if chan is not None:
                return chan
            if route is None:
                chan = await Channel.open(self._tg, addresses[0], peer=peer, peer_incarnation=incarnation,
                                          hello=self._hello, auth=self._auth)
            else:
                chan = await self._open(peer, route)
            self._channels[peer] = (incarnation, chan)
            return chan

    def _working(self, peer: str, incarnation: str, route: Route | None) -> Channel | None:
        """The pooled channel to ``peer``'s ``incarnation`` (or the successor that took over
        from it) if it may take a request; else it is closed (its address failed, where its
        link ended it) and None returned."""
        cached = self._channels.get(peer)
        if cached is None:
            return None
        inc, chan = cached
        while inc == incarnation and chan.broken and (heir := chan.detach_successor()) is not None:
            chan.close()  # the agent went away from it: its successor took over
            chan = heir
            self._channels[peer] = (inc, chan)
        if inc == incarnation and not chan.broken and not chan.idle_expired and self._usable(chan, route):
            return chan
        if route is not None and inc == incarnation and chan.link_failed:
            self._failed(route, chan, f"the link failed: {chan._broken}")
        chan.close()
        return None

    async def _open(self, peer: str, route: Route) -> Channel:
        """A channel to the first of ``route``'s addresses, in its order, that answers. Those
        that give no answer within ``ADDRESS_CONNECT_S`` are tried again, in turn, until the
        caller's deadline, as a connection to a peer's only address waits for it.

        Raises:
            PeerLostError: every address refused, could not be reached, or had another
                incarnation answer (as :meth:`Channel.open` for one address).
        """
        while True:
            errors: list[str] = []
            silent = False  # an address gave no answer: try them all again
            last: BaseException | None = None
            for i in route.order(time.monotonic()):
                address = route.addresses[i]
                try:
                    with anyio.fail_after(ADDRESS_CONNECT_S):
                        chan = await Channel.open(self._tg, address, peer=peer, peer_incarnation=route.incarnation,
                                                  hello=self._hello, auth=self._auth, stall_s=ADDRESS_STALL_S)
                except TimeoutError:
                    route.failed[i], silent = time.monotonic(), True
                    errors.append(f"{address[0]}:{address[1]}: no answer within {ADDRESS_CONNECT_S:g}s")
                    continue
                except PeerLostError as exc:
                    route.failed[i], last = time.monotonic(), exc
                    errors.append(f"{address[0]}:{address[1]}: {exc}")
                    continue
                if errors:
                    log.warning("%s connection to %s goes to %s:%d (%s)", self._hello.get("lane"), peer, *address,
                                "; ".join(errors))
                route.connected(i)
                return chan
            if not silent:
                raise PeerLostError(f"cannot reach the agent of {peer} at any of its {len(route.addresses)} "
                                    f"addresses: {'; '.join(errors)}") from last

    async def request(
        self,
        peer: str,
        incarnation: str,
        addresses: Sequence[tuple[str, int]],
        kind: int,
        meta: Mapping[str, Any],
        payload: memoryview | Sequence[memoryview] | None = None,
        into: memoryview | Sequence[memoryview] | None = None,
    ) -> dict[str, Any]:
        """:meth:`get`, then :meth:`Channel.request`. To a peer with several addresses, a
        request whose connection was ended by its link (:attr:`Channel.link_failed`: our kernel
        dropped what it had not delivered, so nothing more of it can arrive) is sent again on
        the next channel, at another address, once per address at most: a put then writes the
        same bytes again (``payload`` is unchanged), a get's ``into`` is filled by the last
        try. Never after a refusal, a timeout, or the peer ending the connection.

        Raises:
            as :meth:`get` and :meth:`Channel.request` (the last try's error).
        """
        tries = len(addresses)
        while True:
            chan = await self.get(peer, incarnation, *addresses)
            try:
                return await chan.request(kind, meta, payload, into)
            except PeerLostError:
                tries -= 1
                route = self._routes.get(peer, incarnation, addresses)
                if route is None or tries <= 0 or not chan.link_failed:
                    raise
                self._failed(route, chan, f"the link failed under a request: {chan._broken}")

    def forget_peer(self, peer: str) -> None:
        """Drops the channel to ``peer`` (it left, or was lost or excluded): requests in flight
        on it still get replies already on their way (see :meth:`Channel.release`)."""
        self._routes.forget(peer)
        cached = self._channels.pop(peer, None)
        if cached is not None:
            cached[1].release(PeerLostError(f"connection to {peer} released: {peer} is gone"))

    def close(self) -> None:
        for _, chan in self._channels.values():
            chan.close()
        self._channels.clear()
        self._routes.clear()
