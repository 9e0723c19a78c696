"""Peer liveness: heartbeats published from a thread, leases checked by observers.

Same-host peers are checked exactly (their pid and start time). Peers on other hosts publish a
heartbeat counter in the rendezvous store every ``interval`` seconds from a native-free daemon
thread, so a peer whose event loop is busy (or blocked in ``time.sleep`` while it receives
one-sided puts) is still alive; an observer declares a peer lost when its counter has not moved
for ``lease`` seconds of the observer's own clock (no clock synchronisation needed).
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from ._errors import TransportError
from ._rendezvous import Store

log = logging.getLogger(__name__)

HEARTBEAT_PREFIX = "hb/"


class Heartbeat:
    """Writes ``hb/<name>`` = ``"<incarnation> <counter>"`` every ``interval`` seconds."""

    def __init__(self, store: Store, name: str, incarnation: str, interval: float) -> None:
        self._store, self._key, self._inc, self._interval = store, HEARTBEAT_PREFIX + name, incarnation, interval
        self._stop = threading.Event()
        self._failing = False  # the last beat failed: repeats are logged at debug level
        self._thread = threading.Thread(target=self._run, name=f"transport-heartbeat-{name}", daemon=True)

    def start(self) -> None:
        self._beat(0)
        self._thread.start()

    def _beat(self, n: int) -> None:
        """One beat. A store that stops answering is reported once (a warning), then at debug
        level every interval, and its recovery once: a gone store host is not log spam."""
        try:
            self._store.set(self._key, f"{self._inc} {n}".encode())
        except TransportError as exc:
            if self._failing:
                log.debug("heartbeat %s: still failing: %s", self._key, exc)
            else:
                log.warning("heartbeat %s: %s (peers on other hosts will declare this one lost if it persists; "
                            "repeats are logged at debug level)", self._key, exc)
                self._failing = True
            return
        if self._failing:
            log.info("heartbeat %s: the store answers again", self._key)
            self._failing = False

    def _run(self) -> None:
        n = 1
        while not self._stop.wait(self._interval):
            self._beat(n)
            n += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval + 5)
        try:
            self._store.delete(self._key)
        except TransportError:
            pass


class Leases:
    """Tracks when each observed peer's heartbeat last moved (one entry per peer name: a
    restart replaces its predecessor's entry, so the table does not grow with restarts)."""

    def __init__(self, lease: float) -> None:
        self.lease = lease
        self._seen: dict[str, tuple[str, bytes | None, float]] = {}  # name -> (incarnation, beat, when it moved)

    def expired(self, name: str, incarnation: str, beat: bytes | None) -> str | None:
        """None while the lease holds; else why it does not."""
        now = time.monotonic()
        if beat is not None:
            inc = beat.split(b" ", 1)[0].decode(errors="replace")
            if inc != incarnation:
                return f"{name} restarted (incarnation {incarnation} -> {inc})"
        last = self._seen.get(name)
        if last is None or last[0] != incarnation or last[1] != beat:
            self._seen[name] = (incarnation, beat, now)
            return None
        if now - last[2] > self.lease:
            return f"no heartbeat from {name} for {now - last[2]:.1f}s (lease {self.lease:g}s)"
        return None

    def forget(self, name: str) -> None:
        self._seen.pop(name, None)


class LostTable:
    """The incarnations an observer declared lost or excluded, and why; bounded.

    A restarting peer adds one entry per incarnation, so the table keeps only the most recent
    ``per_name`` lost incarnations of each name (an older one is long gone from the store:
    its successors have replaced its record since) and at most ``capacity`` entries in all,
    dropping the oldest first.
    """

    def __init__(self, per_name: int = 4, capacity: int = 4096) -> None:
        self._per_name, self._capacity = per_name, capacity
        self._why: collections.OrderedDict[tuple[str, str], BaseException] = collections.OrderedDict()
        self._by_name: dict[str, collections.OrderedDict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._why)

    def __contains__(self, key: object) -> bool:
        return key in self._why

    def why(self, name: str, incarnation: str) -> BaseException | None:
        return self._why.get((name, incarnation))

    def add(self, name: str, incarnation: str, why: BaseException) -> bool:
        """Records one lost incarnation; False when it already was."""
        if (name, incarnation) in self._why:
            return False
        self._why[(name, incarnation)] = why
        incs = self._by_name.setdefault(name, collections.OrderedDict())
        incs[incarnation] = None
        while len(incs) > self._per_name:
            self._drop(name, next(iter(incs)))
        while len(self._why) > self._capacity:
            self._drop(*next(iter(self._why)))
        return True

    def _drop(self, name: str, incarnation: str) -> None:
        self._why.pop((name, incarnation), None)
        incs = self._by_name.get(name)
        if incs is not None:
            incs.pop(incarnation, None)
            if not incs:
                del self._by_name[name]
