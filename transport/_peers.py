"""Peers as one Transport sees them: lookup, waiting, liveness, loss and exclusion.

``PeerDirectory`` is a mixin of :class:`transport.Transport`; it uses the Transport's store,
backends, control connections, flight recorder and in-flight transfers. One peer's loss or
exclusion only ever touches that peer's state.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

import anyio

from ._errors import PeerLostError, PeerNotFoundError, TransferAbortedError, TransportError
from ._host import process_alive
from ._liveness import HEARTBEAT_PREFIX
from ._regions import Peer
from ._wire import PeerRecord

if TYPE_CHECKING:
    from ._transport import Transport

log = logging.getLogger("transport._transport")

_PEER_PREFIX = "peer/"
_POLL_MIN_S, _POLL_MAX_S = 0.005, 0.2


class PeerDirectory:
    """Peer lookup and liveness for a Transport (see the module docstring)."""

    def _adopt(self: Transport, record: PeerRecord) -> PeerRecord:
        old = self._peers.get(record.name)
        if old is not None and old.incarnation != record.incarnation:
            log.info("transport %s: %s restarted (incarnation %s -> %s)", self.name, record.name, old.incarnation, record.incarnation)
            for b in self._backends:
                b.forget_peer(record.name)
            self._control.forget(record.name)
        self._peers[record.name] = record
        return record

    def _stale(self: Transport, record: PeerRecord) -> bool:
        return record.host == self._host and not process_alive(record.pid, record.pid_start)

    async def _fetch(self: Transport, name: str) -> PeerRecord | None:
        data = await self._store.aget(_PEER_PREFIX + name)
        return PeerRecord.decode(self._auth.open_record(data, name)) if data is not None else None

    def _is_lost(self: Transport, record: PeerRecord) -> bool:
        return (record.name, record.incarnation) in self._lost

    async def peer(self: Transport, name: str, *, regions: Sequence[str] = (), timeout: float | None = None) -> Peer:
        """Waits until a live peer called ``name`` is visible, and returns what it published.

        A record left by a dead process on this host is ignored (a replacement is awaited).

        Args:
            name: the peer's name.
            regions: also wait until the peer has registered every one of these keys.
            timeout: seconds to wait (default: the Transport's timeout).

        Returns:
            A :class:`Peer` (its incarnation, backends and regions).

        Raises:
            PeerNotFoundError: no live peer of that name appeared in time.
            ClosedError: the Transport is closed.

        Cancellation: safe at any point; nothing is changed.
        """
        self._check_open()
        timeout = self.timeout if timeout is None else timeout
        delay, stale, bad = _POLL_MIN_S, False, None
        with anyio.move_on_after(timeout):
            while True:
                self._check_open()
                try:
                    record = await self._fetch(name)
                except TransportError as exc:  # malformed, foreign or unauthenticated: keep waiting
                    record, bad = None, exc
                if record is not None and not self._stale(record) and not self._is_lost(record):
                    self._adopt(record)
                    if all(k in record.regions for k in regions):
                        return Peer(record)
                else:
                    stale = stale or record is not None
                await anyio.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)
        hint = " (only a stale record of an exited or lost process was found)" if stale else ""
        if bad is not None:
            hint = f" (its record was rejected: {bad})"
        if name in self._peers and not stale:
            missing = [k for k in regions if k not in self._peers[name].regions]
            hint = f" with regions {missing}"
        raise PeerNotFoundError(f"no peer named {name!r} appeared in {self._store.url} within {timeout:g}s{hint}")

    async def _lookup(self: Transport, name: str) -> PeerRecord | None:
        """The live record of ``name`` now, or None (no waiting). For in-package layers."""
        try:
            record = await self._fetch(name)
        except TransportError:
            return None
        if record is None or self._stale(record):
            return None
        return self._adopt(record)

    async def peers(self: Transport) -> list[str]:
        """Names of the peers currently published in the store (this one included)."""
        self._check_open()
        return [k[len(_PEER_PREFIX):] for k in await self._store.akeys(_PEER_PREFIX)]

    async def _resolve(self: Transport, name: str, *, refresh: bool = False) -> PeerRecord:
        record = None if refresh else self._peers.get(name)
        if record is None:
            record = await self._fetch(name)
            if record is None:
                raise PeerNotFoundError(
                    f"no peer named {name!r} in {self._store.url} (await transport.peer({name!r}) to wait for it)"
                )
            if self._stale(record):
                raise PeerLostError(f"{name} (pid {record.pid}) has exited; its record in {self._store.url} is stale")
            record = self._adopt(record)
        if self._is_lost(record):
            fresh = await self._fetch(name)
            if fresh is None or self._is_lost(fresh) or self._stale(fresh):
                raise PeerLostError(f"{name} is lost: {self._lost[(record.name, record.incarnation)]}")
            record = self._adopt(fresh)  # a replacement (new incarnation) took the name
        return record

    def _declare_lost(self: Transport, name: str, incarnation: str, why: BaseException, *, excluded: bool = False) -> None:
        """Marks one incarnation of a peer lost: aborts transfers to it, drops its connections,
        mappings and keys, records and dumps. Idempotent. Other peers are untouched."""
        if (name, incarnation) in self._lost:
            return
        self._lost[(name, incarnation)] = why
        log.warning("transport %s: peer %s (incarnation %s) %s: %s", self.name, name, incarnation,
                    "excluded" if excluded else "lost", why)
        for xfer in list(self._inflight.get(name, ())):
            if xfer._incarnation in (None, incarnation) and not xfer.done():
                what = f"{xfer.op.value} of {xfer.nbytes} bytes to {name}:{xfer.key!r}"
                if excluded:
                    xfer._abort_error = TransferAbortedError(f"{what} aborted: {name} was excluded", partial=xfer._moving)
                else:
                    xfer._abort_error = PeerLostError(f"{what} aborted: {why}")
                    xfer._abort_error.__cause__ = why
                if xfer._scope is not None:
                    xfer._scope.cancel()
                else:
                    xfer.cancel()
        for b in self._backends:
            b.forget_peer(name)
        self._control.forget(name)
        self._leases.forget(name)
        self._flight.event("excluded" if excluded else "peer-lost", name, f"incarnation {incarnation}: {why}")
        self._flight.dump(f"{'excluded' if excluded else 'peer lost'}: {name}: {why}")

    def exclude(self: Transport, name: str) -> None:
        """Drops ``name`` on purpose (e.g. a straggler): its in-flight transfers are aborted
        with TransferAbortedError and later ones fail with PeerLostError, until it comes back
        as a new incarnation (a restart). Other peers are untouched.

        Raises:
            PeerNotFoundError: this Transport has never seen ``name``.
        """
        self._check_open()
        record = self._peers.get(name)
        if record is None:
            raise PeerNotFoundError(f"{self.name} has no peer {name!r} to exclude")
        self._declare_lost(name, record.incarnation, PeerLostError(f"{name} was excluded by {self.name}"), excluded=True)

    async def _watch_peers(self: Transport) -> None:
        while True:
            await anyio.sleep(self._heartbeat_s)
            for name, record in list(self._peers.items()):
                if self._is_lost(record):
                    continue
                if record.host == self._host:
                    why = None if process_alive(record.pid, record.pid_start) else f"{name} (pid {record.pid}) exited"
                else:
                    try:
                        beat = await self._store.aget(HEARTBEAT_PREFIX + name)
                    except TransportError as exc:
                        log.warning("transport %s: cannot read heartbeats: %s", self.name, exc)
                        continue
                    why = self._leases.expired(name, record.incarnation, beat)
                if why is not None:
                    self._declare_lost(name, record.incarnation, PeerLostError(why))
