"""Peers as one Transport sees them: its own record in the store, lookup, waiting, liveness,
loss and exclusion.

:class:`PeerDirectory` owns every piece of peer state (the records seen, the incarnations
declared lost, the heartbeat and the leases). Parts that hold per-peer state (backends,
connection pools, the transfer engine) subscribe to it and are told when a peer restarts or is
lost; one peer's loss only ever touches that peer's state.

Size: one concept, the directory; liveness is already its own module (``_liveness``), and what
is left (records, waiting, loss, exclusion) changes one state together.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import time
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import anyio
from anyio.abc import TaskGroup

from ._auth import Authenticator
from ._channel import Channel, hello
from ._errors import (
    AuthenticationError,
    PeerLostError,
    PeerNotFoundError,
    RecordTooLargeError,
    RegistrationError,
    TransportError,
    WireError,
)
from ._flight import FlightRecorder
from ._host import ProcessWatch
from ._liveness import HEARTBEAT_PREFIX, Heartbeat, Leases, LostTable
from ._rendezvous import Store
from ._sockets import connect
from ._wire import HostId, PeerRecord, RegionRecord

log = logging.getLogger(__name__)

PEER_PREFIX = "peer/"
_POLL_MIN_S, _POLL_MAX_S = 0.005, 0.2
_WATCH_CONNECT_TIMEOUT_S = 10.0
# How long a peer's record may keep being refused (failing authentication, malformed, misplaced
# or too large) before waiting for it gives up: long enough for a legitimate restart to replace a
# leftover record, well under a second. Records are written whole (file rename, one store set),
# so a refused one is never half-written: it is what is there.
_REFUSED_GRACE_S = 0.3
_DECODED_MAX = 4096  # peer names whose last decoded record is kept (see PeerDirectory._decoded)
MAX_NAME_BYTES = 255


class Peer:
    """What a peer has published: its identity, backends and registered regions.

    Attributes:
        name: the peer's name.
        incarnation: changes every time a process takes the name anew (a restart).
        backends: the backends the peer speaks.
        regions: key -> region description (dtype, shape, nbytes, writable).
    """

    def __init__(self, record: PeerRecord) -> None:
        self._record = record

    @property
    def name(self) -> str:
        return self._record.name

    @property
    def incarnation(self) -> str:
        return self._record.incarnation

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self._record.backends)

    @property
    def regions(self) -> Mapping[str, RegionRecord]:
        return self._record.regions

    @property
    def host(self) -> str:
        """Names the peer's host (and PID namespace): peers with equal ``host`` may reach each
        other's memory without the network (``ipc``). Opaque; compare it, do not parse it."""
        return host_key(self._record.host)

    def __repr__(self) -> str:
        return (
            f"Peer({self.name!r}, incarnation={self.incarnation!r}, backends={self.backends}, "
            f"regions={len(self.regions)})"
        )


def host_key(host: HostId) -> str:
    """The opaque text :attr:`Peer.host` names ``host`` by."""
    return f"{host.hostname}/{host.boot_id}/{host.pid_ns}"


_GOOD_NAMES: set[str] = set()  # names that passed check_name (bounded: cleared when full)
_GOOD_NAMES_MAX = 4096


def check_name(name: object, what: str = "name") -> str:
    """``name`` if it can name a peer: a non-empty str of at most :data:`MAX_NAME_BYTES` UTF-8
    bytes, without "/" or control characters (every store can then hold it under a key).

    Raises:
        ValueError: it cannot (the message says why).
    """
    if not isinstance(name, str):
        raise ValueError(f"{what} must be a str, got {type(name).__name__}")
    if name in _GOOD_NAMES:  # checked before (a put names its peer every time)
        return name
    if not name:
        raise ValueError(f"{what} must not be empty")
    if "/" in name:
        raise ValueError(f"{what} must not contain '/', got {name[:80]!r}")
    bad = next((c for c in name if unicodedata.category(c) in ("Cc", "Cs")), None)
    if bad is not None:
        raise ValueError(f"{what} must not contain control characters (found {bad!r}), got {name[:80]!r}")
    size = len(name.encode("utf-8"))
    if size > MAX_NAME_BYTES:
        raise ValueError(f"{what} is {size} bytes long in UTF-8; at most {MAX_NAME_BYTES} are allowed "
                         f"(it starts {name[:40]!r})")
    if len(_GOOD_NAMES) >= _GOOD_NAMES_MAX:
        _GOOD_NAMES.clear()
    _GOOD_NAMES.add(name)
    return name


def peer_name(peer: object) -> str:
    """The name a ``peer`` argument (a name or a :class:`Peer`) stands for.

    Raises:
        PeerNotFoundError: it is neither.
        ValueError: a str that cannot be a peer name (see :func:`check_name`).
    """
    name = peer.name if isinstance(peer, Peer) else peer
    if not isinstance(name, str):
        raise PeerNotFoundError(f"peer must be a name or a Peer, got {peer!r}")
    return check_name(name, "peer name")


@dataclass(frozen=True)
class Me:
    """This process's identity as its peer record carries it."""

    name: str
    incarnation: str
    pid: int
    pid_start: int
    host: HostId


# Told when a peer's state must go: forget(name) on a restart or a loss.
Forget = Callable[[str], None]
# Told when one incarnation of a peer is lost or excluded: lost(name, incarnation, why, excluded).
Lost = Callable[[str, str, BaseException, bool], None]


class PeerDirectory:
    """Peer lookup and liveness for one Transport (see the module docstring).

    Args:
        me: this endpoint's identity.
        store: the rendezvous store.
        auth: signs our record and opens peers' records.
        flight: where losses are recorded (and dumped).
        heartbeat_s: seconds between our heartbeats and between liveness checks of peers.
        lease_s: seconds without a heartbeat after which a peer on another host is lost.
    """

    def __init__(self, me: Me, store: Store, auth: Authenticator, flight: FlightRecorder,
                 heartbeat_s: float, lease_s: float) -> None:
        self.me = me
        self._store = store
        self._auth = auth
        self._flight = flight
        self._heartbeat_s = heartbeat_s
        self._leases = Leases(lease_s)
        self._peers: dict[str, PeerRecord] = {}
        # name -> the last record bytes read under it that decoded, and what they decoded to:
        # the same bytes verify and decode alike (no clock in either), so a publisher that looks
        # its subscribers up every version decodes each record once (1-2 ms each otherwise, for
        # a subscriber of ten streams). Bounded by _DECODED_MAX names.
        self._decoded: dict[str, tuple[bytes, PeerRecord]] = {}
        self._lost = LostTable()  # (peer, incarnation) -> why; bounded (restarts add entries)
        self._procs = ProcessWatch()  # same-host peers' liveness by pidfd
        self._forget: list[Forget] = []
        self._on_lost: list[Lost] = []
        # Tells whether an adopted record is still the peer's latest without reading the store
        # (a backend's cheap view of the peer's record seq); set once the backends exist.
        self._current: Callable[[PeerRecord], bool] = lambda record: False
        # Tells, cheaply, that a same-host peer's Transport closed (its process may live on).
        self._withdrawn: Callable[[PeerRecord], bool] = lambda record: False
        self._heartbeat: Heartbeat | None = None
        self._tg: TaskGroup | None = None
        # (peer, incarnation) -> its watch connection, or the token of the attempt making it
        self._watchers: dict[tuple[str, str], Channel | object] = {}
        self.closed = False

    def subscribe(self, *, forget: Forget | None = None, lost: Lost | None = None,
                  current: Callable[[PeerRecord], bool] | None = None,
                  withdrawn: Callable[[PeerRecord], bool] | None = None) -> None:
        """Registers a part that holds per-peer state; ``current(record)``: True when that part
        can tell cheaply that ``record`` is still the peer's latest (see :meth:`lookup`);
        ``withdrawn(record)``: True when it can tell cheaply that the peer's Transport closed."""
        if forget is not None:
            self._forget.append(forget)
        if lost is not None:
            self._on_lost.append(lost)
        if current is not None:
            self._current = current
        if withdrawn is not None:
            self._withdrawn = withdrawn

    @property
    def store_url(self) -> str:
        return self._store.url

    # -- our own record -------------------------------------------------------------------

    async def claim(self) -> None:
        """Checks that no live process on this host holds our name.

        Raises:
            RegistrationError: one does.
        """
        try:
            data = await self._store.aget(PEER_PREFIX + self.me.name)
        except RecordTooLargeError:
            return  # junk under our name: overwrite
        if data is None:
            return
        try:
            old = self._decode(data, self.me.name)
        except TransportError:
            return  # unreadable or foreign leftovers: overwrite
        if old.host == self.me.host and self._procs.alive(old.pid, old.pid_start) and old.pid != self.me.pid:
            raise RegistrationError(
                f"name {self.me.name!r} is in use by a live process (pid {old.pid}) in {self._store.url}"
            )
        if old.host != self.me.host:
            log.warning("transport %s: replacing the record of %s on host %s (assumed restarted)",
                        self.me.name, old.name, old.host.hostname)

    def publish(self, seq: int, agent: tuple[str, int], backends: Mapping[str, bytes],
                regions: Mapping[str, RegionRecord], agents: Sequence[tuple[str, int]] = ()) -> None:
        """Signs and writes our record (revision ``seq``), bound to its key, our name and our
        incarnation. ``agents``: every address the agent listens on, ``agent`` first."""
        me = self.me
        record = PeerRecord(name=me.name, incarnation=me.incarnation, seq=seq, pid=me.pid, pid_start=me.pid_start,
                            host=me.host, agent=agent, backends=backends, regions=regions,
                            agents=tuple(agents) if len(agents) > 1 else ())
        key = PEER_PREFIX + me.name
        self._store.set(key, self._auth.sign_record(record.encode(), key=key, name=me.name,
                                                    incarnation=me.incarnation))

    async def withdraw(self) -> None:
        """Removes our record if it is still ours (not a successor's). Logs, never raises."""
        try:
            mine = await self._store.aget(PEER_PREFIX + self.me.name)
            if mine is not None and self._decode(mine, self.me.name).incarnation == self.me.incarnation:
                self._store.delete(PEER_PREFIX + self.me.name)
        except TransportError as exc:
            log.warning("transport %s: could not remove its peer record: %s", self.me.name, exc)

    def start(self, tg: TaskGroup, heartbeat_store: Store) -> None:
        """Starts publishing our heartbeat (from a thread, through ``heartbeat_store``) and
        checking peers' liveness (tasks in ``tg``)."""
        self._tg = tg
        self._heartbeat = Heartbeat(heartbeat_store, self.me.name, self.me.incarnation, self._heartbeat_s)
        self._heartbeat.start()
        tg.start_soon(self._check_loop)

    def close(self) -> None:
        self.closed = True
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        for key in list(self._watchers):
            self._unwatch(key)
        self._procs.close()

    # -- lookup ---------------------------------------------------------------------------

    def _decode(self, data: bytes, name: str) -> PeerRecord:
        """The record read from ``name``'s key, checked to be what it claims: signed (with a
        token) for this key, this name and its own incarnation, and naming ``name``.

        The one place where hostile store bytes are decoded: nothing but a TransportError leaves.

        Raises:
            AuthenticationError: a token is set and the record is unsigned, signed with another
                token, or signed for another key, name or incarnation (a copied record).
            WireError: it does not decode, or (without a token) it names another peer.
        """
        cached = self._decoded.get(name)
        if cached is not None and cached[0] == data:
            return cached[1]
        key = PEER_PREFIX + name
        body, incarnation = self._auth.open_bound(data, name, key=key, name=name)
        try:
            record = PeerRecord.decode(body)
        except TransportError:
            raise
        except Exception as exc:  # hostile bytes (RecursionError, MemoryError, ...): a bad record, not a crash
            raise WireError(f"the record under {key!r} does not decode: {type(exc).__name__}: {exc}") from exc
        if record.name != name:
            why = f"the record under {key!r} names {record.name!r}, not {name!r} (a copied or misplaced record)"
            raise AuthenticationError(why) if self._auth.enabled else WireError(why)
        if incarnation is not None and record.incarnation != incarnation:
            raise AuthenticationError(f"the record under {key!r} is signed for incarnation {incarnation!r} "
                                      f"but names {record.incarnation!r}")
        if record.host == self.me.host:  # our host object: later same-host checks are identity checks
            record = dataclasses.replace(record, host=self.me.host)
        if len(self._decoded) >= _DECODED_MAX and name not in self._decoded:
            self._decoded.clear()
        self._decoded[name] = (bytes(data), record)
        return record

    async def fetch(self, name: str) -> PeerRecord | None:
        """The record published under ``name`` now (not adopted), or None.

        Raises:
            AuthenticationError: it is not signed with our token for this name (see ``_decode``).
            TransportError: it is malformed, misplaced or too large, or the store failed.
        """
        data = await self._store.aget(PEER_PREFIX + name)
        return self._decode(data, name) if data is not None else None

    def stale(self, record: PeerRecord) -> bool:
        """Whether ``record`` was left by a process on this host that has exited."""
        host = record.host
        return (host is self.me.host or host == self.me.host) and not self._procs.alive(record.pid, record.pid_start)

    def is_lost(self, record: PeerRecord) -> bool:
        return (record.name, record.incarnation) in self._lost

    def known(self, name: str) -> PeerRecord | None:
        """The record of ``name`` this directory last adopted, or None."""
        return self._peers.get(name)

    def _adopt(self, record: PeerRecord) -> PeerRecord:
        old = self._peers.get(record.name)
        if old is not None and old.incarnation != record.incarnation:
            log.info("transport %s: %s restarted (incarnation %s -> %s)", self.me.name, record.name,
                     old.incarnation, record.incarnation)
            for forget in self._forget:
                forget(record.name)
            self._unwatch_peer(record.name)
        self._peers[record.name] = record
        return record

    async def lookup(self, name: str) -> PeerRecord | None:
        """The live record of ``name`` now, or None (no waiting; unreadable counts as none).

        Raises:
            ValueError: ``name`` cannot be a peer name.
        """
        check_name(name, "peer name")
        known = self._peers.get(name)
        if (known is not None and known.host is self.me.host and not self.is_lost(known) and not self.stale(known)
                and self._current(known)):
            return known  # same host, alive, and its latest record by its own word: no store read
        try:
            record = await self.fetch(name)
        except TransportError:
            return None
        if record is None or self.stale(record):
            return None
        return self._adopt(record)

    async def names(self) -> list[str]:
        return [k[len(PEER_PREFIX):] for k in await self._store.akeys(PEER_PREFIX)]

    async def wait(self, name: str, regions: Sequence[str], timeout: float,
                   check_open: Callable[[], None]) -> Peer:
        """Polls until a live peer ``name`` with every key in ``regions`` is published.

        A record that is refused (fails authentication: another token, unsigned, copied from
        another name; or malformed, misplaced or too large: e.g. written by another version of
        the library) is given :data:`_REFUSED_GRACE_S` to be replaced by a good one (a restart),
        then the wait ends with the reason, read again and again meanwhile, not the timeout.

        Raises:
            AuthenticationError: the record of ``name`` keeps failing authentication.
            PeerNotFoundError: none appeared within ``timeout``, or the record of ``name`` keeps
                being malformed, misplaced or too large (the message says how; ``__cause__`` is
                the WireError or RecordTooLargeError).
            ClosedError: (from ``check_open``) the Transport closed meanwhile.
            ValueError: ``name`` cannot be a peer name.
        """
        check_name(name, "peer name")
        delay, stale = _POLL_MIN_S, False
        bad: TransportError | None = None
        refused_since: float | None = None  # since when every read of the record was refused
        with anyio.move_on_after(timeout):
            while True:
                check_open()
                try:
                    record = await self.fetch(name)
                except (AuthenticationError, WireError, RecordTooLargeError) as exc:
                    record, bad = None, exc
                    now = time.monotonic()
                    refused_since = now if refused_since is None else refused_since
                    if now - refused_since >= _REFUSED_GRACE_S:
                        raise self._refused(name, exc) from exc
                except TransportError as exc:  # the store failed: keep waiting
                    record, bad, refused_since = None, exc, None
                else:
                    refused_since = None
                if record is not None and not self.stale(record) and not self.is_lost(record):
                    self._adopt(record)
                    if all(k in record.regions for k in regions):
                        return Peer(record)
                else:
                    stale = stale or record is not None
                await anyio.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)
        if refused_since is not None and bad is not None:
            raise self._refused(name, bad) from bad
        hint = " (only a stale record of an exited or lost process was found)" if stale else ""
        if bad is not None:
            hint = f" (its record was rejected: {bad})"
        if name in self._peers and not stale:
            missing = [k for k in regions if k not in self._peers[name].regions]
            hint = f" with regions {missing}"
        raise PeerNotFoundError(f"no peer named {name!r} appeared in {self._store.url} within {timeout:g}s{hint}")

    def _refused(self, name: str, exc: TransportError) -> TransportError:
        """Why waiting for ``name`` ends early: its record was refused as ``exc``, read after read."""
        if isinstance(exc, AuthenticationError):
            return AuthenticationError(f"peer {name!r} in {self._store.url}: {exc} (do all its peers use the same "
                                       "token?)")
        return PeerNotFoundError(f"peer {name!r} in {self._store.url}: its record was rejected, read after read for "
                                 f"{_REFUSED_GRACE_S:g}s: {exc} (written by another version of transport, copied "
                                 "from another name, or not by a Transport?)")

    async def resolve(self, name: str, *, refresh: bool = False) -> PeerRecord:
        """The record a transfer to ``name`` goes by: the adopted one, or a fresh one.

        Raises:
            PeerNotFoundError: nothing is published under ``name``.
            PeerLostError: its process has exited, or it was lost and not replaced.
            AuthenticationError: its record is not signed with our token for ``name``.
            TransportError: its record is malformed, misplaced or too large, or the store failed.
        """
        record = None if refresh else self._peers.get(name)
        if record is None:
            record = await self.fetch(name)
            if record is None:
                raise PeerNotFoundError(
                    f"no peer named {name!r} in {self._store.url} (await transport.peer({name!r}) to wait for it)"
                )
            if self.stale(record):
                raise PeerLostError(f"{name} (pid {record.pid}) has exited; its record in {self._store.url} is stale")
            record = self._adopt(record)
        if self.is_lost(record):
            fresh = await self.fetch(name)
            if fresh is None or self.is_lost(fresh) or self.stale(fresh):
                raise PeerLostError(f"{name} is lost: {self._lost.why(record.name, record.incarnation)}")
            record = self._adopt(fresh)  # a replacement (new incarnation) took the name
        return record

    # -- loss -----------------------------------------------------------------------------

    def declare_lost(self, name: str, incarnation: str, why: BaseException, *, excluded: bool = False) -> None:
        """Marks one incarnation of a peer lost: subscribers abort its transfers and drop its
        connections, mappings and keys; records and dumps. Idempotent. Other peers are untouched."""
        if not self._lost.add(name, incarnation, why):
            return
        log.warning("transport %s: peer %s (incarnation %s) %s: %s", self.me.name, name, incarnation,
                    "excluded" if excluded else "lost", why)
        self._let_go(name, incarnation, why, excluded)
        self._flight.event("excluded" if excluded else "peer-lost", name, f"incarnation {incarnation}: {why}")
        self._flight.dump(f"{'excluded' if excluded else 'peer lost'}: {name}: {why}")

    def depart(self, record: PeerRecord, why: str) -> None:
        """A peer closed its Transport (its process may live on): forgets everything held for
        that incarnation (mappings, routes, connections, its record) as a loss does, with no
        warning or dump; its transfers still in flight fail with PeerLostError. Idempotent."""
        name, incarnation = record.name, record.incarnation
        err = PeerLostError(f"{name} left ({why})")
        if not self._lost.add(name, incarnation, err):
            return
        log.info("transport %s: peer %s (incarnation %s) left: %s", self.me.name, name, incarnation, why)
        self._let_go(name, incarnation, err, False)
        if (known := self._peers.get(name)) is not None and known.incarnation == incarnation:
            del self._peers[name]
        self._flight.event("peer-left", name, f"incarnation {incarnation}: {why}")

    def _let_go(self, name: str, incarnation: str, why: BaseException, excluded: bool) -> None:
        """Tells every part holding state for ``name`` to abort its transfers and drop it."""
        for lost in self._on_lost:
            lost(name, incarnation, why, excluded)
        for forget in self._forget:
            forget(name)
        self._unwatch_peer(name)
        self._leases.forget(name)

    async def _left(self, record: PeerRecord) -> str | None:
        """Why ``record``'s Transport counts as closed (not dead): its control word says so
        (same host), or its record is gone from the store; None otherwise (a record replaced by a
        successor means the old incarnation died: that is a loss, not a departure)."""
        if record.host == self.me.host and self._withdrawn(record):
            return "its Transport closed"
        try:
            now = await self.fetch(record.name)
        except TransportError:
            return None
        return "its record was withdrawn" if now is None else None  # (a successor: the old one died)

    def exclude(self, name: str) -> None:
        """See ``Transport.exclude``.

        Raises:
            PeerNotFoundError: this directory has never seen ``name``.
        """
        record = self._peers.get(name)
        if record is None:
            raise PeerNotFoundError(f"{self.me.name} has no peer {name!r} to exclude")
        self.declare_lost(name, record.incarnation, PeerLostError(f"{name} was excluded by {self.me.name}"),
                          excluded=True)

    async def _check_loop(self) -> None:
        """Checks every adopted peer each heartbeat interval (pid on this host, heartbeat lease
        elsewhere) and declares the dead ones lost. Runs until cancelled."""
        while True:
            await anyio.sleep(self._heartbeat_s)
            for name, record in list(self._peers.items()):
                if self.is_lost(record):
                    continue
                if record.host == self.me.host:
                    alive = self._procs.alive(record.pid, record.pid_start)
                    why = None if alive else f"{name} (pid {record.pid}) exited"
                    if alive and self._withdrawn(record):
                        self.depart(record, "its Transport closed")
                        continue
                else:
                    try:
                        beat = await self._store.aget(HEARTBEAT_PREFIX + name)
                    except TransportError as exc:
                        log.warning("transport %s: cannot read heartbeats: %s", self.me.name, exc)
                        continue
                    if beat is None and (left := await self._left(record)) is not None:
                        self.depart(record, left)  # a closing Transport deletes its heartbeat, then its record
                        continue
                    why = self._leases.expired(name, record.incarnation, beat)
                if why is not None:
                    self.declare_lost(name, record.incarnation, PeerLostError(why))

    # -- watching a peer through its agent connection -------------------------------------

    def watch(self, record: PeerRecord) -> None:
        """Also watches ``record``'s process through a connection to its agent: the peer's
        kernel closes it the moment the process dies, which one-sided backends (ucx) need to
        learn quickly. Nothing is asked of the peer's Python, so a busy or sleeping peer is not
        mistaken for a dead one. Idempotent; a refusal (auth) only stops the watching."""
        key = (record.name, record.incarnation)
        if self._tg is None or self.closed or key in self._watchers or self.is_lost(record):
            return
        attempt = self._watchers[key] = object()
        self._tg.start_soon(self._watch_connection, record, attempt)

    async def _watch_connection(self, record: PeerRecord, attempt: object) -> None:
        key = (record.name, record.incarnation)
        assert self._tg is not None
        agent = f"{record.agent[0]}:{record.agent[1]}"
        why_not = None
        try:
            with anyio.fail_after(_WATCH_CONNECT_TIMEOUT_S):
                try:
                    sock = await connect(record.agent)
                except OSError as exc:
                    if exc.errno == errno.ECONNREFUSED:  # nothing listens there any more: it is gone
                        self._lost_by_watch(record, f"its agent at {agent} refused a connection: {exc}")
                        return
                    raise
                # From here on a broken connection, or another incarnation answering, is a loss.
                chan = await Channel.greet(self._tg, sock, peer=record.name, peer_incarnation=record.incarnation,
                                           hello=hello(self.me.name, self.me.incarnation, "watch"), auth=self._auth)
        except PeerLostError as exc:
            self._lost_by_watch(record, f"its agent at {agent}: {exc}")
            return
        except (OSError, TimeoutError, TransportError) as exc:  # unreachable, slow, or refused us (auth, ...)
            why_not = str(exc) or type(exc).__name__
        if why_not is not None:
            if self._watchers.get(key) is attempt:
                del self._watchers[key]
            log.info("transport %s: cannot watch %s through its agent at %s (%s); a failure of it will "
                     "surface through heartbeats or a timeout", self.me.name, record.name, agent, why_not)
            return
        if self._watchers.get(key) is not attempt:  # forgotten (or watched anew) meanwhile
            chan.close()
            return
        self._watchers[key] = chan
        why = await chan.wait_closed()
        if isinstance(why, PeerLostError) and self._watchers.get(key) is chan:
            with anyio.move_on_after(_WATCH_CONNECT_TIMEOUT_S):
                if (left := await self._left(record)) is not None:
                    self._watchers.pop(key, None)
                    if not self.closed:
                        self.depart(record, left)
                    return
            self._lost_by_watch(record, f"its agent at {agent} closed the connection ({why})")

    def _lost_by_watch(self, record: PeerRecord, why: str) -> None:
        self._watchers.pop((record.name, record.incarnation), None)
        if not self.closed:
            self.declare_lost(record.name, record.incarnation, PeerLostError(f"{record.name} is gone: {why}"))

    def _unwatch(self, key: tuple[str, str]) -> None:
        chan = self._watchers.pop(key, None)
        if isinstance(chan, Channel):
            chan.close()

    def _unwatch_peer(self, name: str) -> None:
        for key in [k for k in self._watchers if k[0] == name]:
            self._unwatch(key)


__all__ = ["MAX_NAME_BYTES", "PEER_PREFIX", "Me", "Peer", "PeerDirectory", "check_name", "peer_name"]
