"""Flight recorder: a fixed-size ring of operation records, dumped when something goes wrong.

Every Transport records each operation it starts (put, get, signal) with its peer, key, byte
count, backend and every state change with a timestamp, plus notable events (a peer lost,
excluded or restarted). The ring keeps the newest ``capacity`` records and counts the ones it
dropped. It is written as versioned JSON to a directory (``flight_dir=`` or
``$TRANSPORT_FLIGHT_DIR``) on a transfer timeout, on peer loss, on ``SIGUSR1`` and on demand;
``python -m transport flight DIR`` reads the dumps of many processes and says which peer and
which operation stalled (see :func:`analyze`).
"""

from __future__ import annotations

import collections
import contextvars
import enum
import itertools
import json
import logging
import os
import signal
import socket
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FLIGHT_FORMAT = "transport.flight"
FLIGHT_VERSION = 1
FLIGHT_DIR_ENV = "TRANSPORT_FLIGHT_DIR"
_MIN_AUTO_DUMP_INTERVAL_S = 1.0
STALL_S = 1.0  # an operation open this long at dump time is reported as stalled


class OpState(enum.Enum):
    STARTED = "started"  # accepted; resolving the peer, validating, choosing a backend
    MOVING = "moving"  # bytes may be moving
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"  # cancelled, timed out or aborted by close/exclusion

    @property
    def terminal(self) -> bool:
        return self in (OpState.DONE, OpState.FAILED, OpState.ABORTED)


@dataclass
class OpRecord:
    seq: int
    op: str
    peer: str
    key: str
    nbytes: int
    started: float  # wall clock (time.time()), comparable across processes of one host
    backend: str | None = None
    state: OpState = OpState.STARTED
    transitions: list[tuple[str, float]] = field(default_factory=list)
    error_type: str | None = None
    error: str | None = None
    # The lanes that carried it, where a backend spread it over several (tcp striping over
    # NICs): lane ("local address>remote address:port") -> bytes it delivered.
    lanes: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq, "op": self.op, "peer": self.peer, "key": self.key, "nbytes": self.nbytes,
            "backend": self.backend, "state": self.state.value, "started": self.started,
            "transitions": [[s, round(t, 6)] for s, t in self.transitions],
            "error_type": self.error_type, "error": self.error,
            **({"lanes": dict(self.lanes)} if self.lanes else {}),
        }


# The operation the running task moves bytes for (the transfer engine sets it in each
# transfer's task): a backend notes on it what only the backend knows (carried_by).
current_op: contextvars.ContextVar[OpRecord | None] = contextvars.ContextVar("transport_flight_op", default=None)


def carried_by(lane: str, nbytes: int) -> None:
    """Notes on the running task's operation record (if any) that ``lane`` delivered ``nbytes``
    more of it."""
    rec = current_op.get()
    if rec is not None:
        rec.lanes[lane] = rec.lanes.get(lane, 0) + nbytes


_Done = tuple[int, str, str, str, int, str, float, float]  # seq, op, peer, key, nbytes, backend, started, ended


def _done_record(d: _Done) -> OpRecord:
    seq, op, peer, key, nbytes, backend, started, ended = d
    return OpRecord(seq, op, peer, key, nbytes, started, backend, OpState.DONE,
                    [(OpState.STARTED.value, started), (OpState.MOVING.value, started), (OpState.DONE.value, ended)])


class FlightRecorder:
    """The ring of one Transport. Cheap enough to stay on in production (a dict per operation)."""

    def __init__(self, name: str, incarnation: str, *, capacity: int = 4096,
                 dump_dir: str | os.PathLike[str] | None = None) -> None:
        self.name = name
        self.incarnation = incarnation
        self.capacity = capacity
        env = os.environ.get(FLIGHT_DIR_ENV)
        self.dump_dir = Path(dump_dir) if dump_dir else (Path(env) if env else None)
        # An operation that completed synchronously is kept as a plain tuple (it costs far less
        # than an OpRecord) and becomes one only when the ring is dumped.
        self._records: collections.OrderedDict[int, OpRecord | _Done] = collections.OrderedDict()
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=512)
        self._seq = itertools.count(1)
        self._dumps = itertools.count(1)
        self.dropped = 0
        self._last_auto_dump = 0.0
        self._changes = 0  # records started, completed or moved on, and events, so far
        self._dumped_at: int | None = None  # _changes when the last dump was written (None: never)
        self._lock = threading.Lock()
        if self.dump_dir is not None:
            _install_sigusr1(self)

    def start(self, op: str, peer: str, key: str, nbytes: int) -> OpRecord:
        now = time.time()
        rec = OpRecord(next(self._seq), op, peer, key, nbytes, now, transitions=[(OpState.STARTED.value, now)])
        self._changes += 1
        with self._lock:
            self._records[rec.seq] = rec
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)
                self.dropped += 1
        return rec

    def completed(self, op: str, peer: str, key: str, nbytes: int, backend: str, started: float) -> None:
        """Records an operation that started at ``started`` (``time.time()``) and is already done."""
        seq = next(self._seq)
        self._changes += 1
        with self._lock:
            self._records[seq] = (seq, op, peer, key, nbytes, backend, started, time.time())
            if len(self._records) > self.capacity:
                self._records.popitem(last=False)
                self.dropped += 1

    def transition(self, rec: OpRecord, state: OpState, *, backend: str | None = None,
                   error: BaseException | None = None) -> None:
        rec.state = state
        rec.transitions.append((state.value, time.time()))
        self._changes += 1
        if backend is not None:
            rec.backend = backend
        if error is not None:
            rec.error_type, rec.error = type(error).__name__, str(error)

    def event(self, kind: str, peer: str, detail: str) -> None:
        self._events.append({"time": time.time(), "event": kind, "peer": peer, "detail": detail})
        self._changes += 1

    def snapshot(self, reason: str) -> dict[str, Any]:
        with self._lock:
            records = [(r if isinstance(r, OpRecord) else _done_record(r)).to_json() for r in self._records.values()]
        return {
            "format": FLIGHT_FORMAT, "v": FLIGHT_VERSION, "name": self.name, "incarnation": self.incarnation,
            "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "reason": reason,
            "capacity": self.capacity, "dropped": self.dropped, "records": records, "events": list(self._events),
        }

    def dump(self, reason: str, *, force: bool = True) -> Path | None:
        """Writes the ring to ``dump_dir`` (atomically); returns the file, or None when no
        directory is configured or an automatic dump came too soon after the previous one."""
        if self.dump_dir is None:
            return None
        now = time.monotonic()
        if not force and now - self._last_auto_dump < _MIN_AUTO_DUMP_INTERVAL_S:
            return None
        self._last_auto_dump = now
        self._dumped_at = self._changes
        path = self.dump_dir / f"{self.name}-{self.incarnation}-{os.getpid()}-{next(self._dumps):04d}.json"
        try:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.snapshot(reason)))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("flight recorder %s: cannot write %s: %s", self.name, path, exc)
            return None
        log.info("flight recorder %s: dumped %s (%s)", self.name, path, reason)
        return path


    def dump_if_changed(self, reason: str) -> Path | None:
        """Dumps again when a dump was written before and the ring changed since: at close, so
        that the last dump of a process shows how what an earlier dump caught in flight ended
        (a dump on a peer's loss is written before the transfers it aborts have settled)."""
        if self._dumped_at is None or self._dumped_at == self._changes:
            return None
        return self.dump(reason)


_recorders: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()
_sig_lock = threading.Lock()
_sig_installed = False


def _install_sigusr1(rec: FlightRecorder) -> None:
    """SIGUSR1 dumps every recorder of the process (only from the main thread, and only if
    the application has not installed its own handler)."""
    global _sig_installed
    _recorders.add(rec)
    with _sig_lock:
        if _sig_installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
            return
        signal.signal(signal.SIGUSR1, lambda *_: [r.dump("SIGUSR1") for r in list(_recorders)])
        _sig_installed = True


# ---------------------------------------------------------------------------------------------
# Analysis of many processes' dumps


_Fields = dict[str, type | tuple[type, ...]]
_DUMP_FIELDS: _Fields = {"name": str, "incarnation": str, "pid": int, "reason": str, "dropped": int,
                         "time": (int, float), "records": list}
_RECORD_FIELDS: _Fields = {"seq": int, "op": str, "peer": str, "key": str, "nbytes": int, "state": str,
                  "started": (int, float)}
_EVENT_FIELDS: _Fields = {"event": str, "peer": str, "detail": str}
_MAX_DUMP_BYTES = 64 << 20


def _malformed(doc: Any) -> str | None:
    """Why ``doc`` is not a flight-recorder dump this version reads, or None."""
    if not isinstance(doc, dict) or doc.get("format") != FLIGHT_FORMAT:
        return "not a flight-recorder dump"
    if doc.get("v") != FLIGHT_VERSION:
        return f"dump version {doc.get('v')!r}, this reader reads {FLIGHT_VERSION}"
    for fields, items, what in ((_DUMP_FIELDS, [doc], "dump"), (_RECORD_FIELDS, doc.get("records"), "record"),
                                (_EVENT_FIELDS, doc.get("events", []), "event")):
        if not isinstance(items, list):
            return f"{what}s are not a list"
        for item in items:
            if not isinstance(item, dict):
                return f"a {what} is not an object"
            for name, typ in fields.items():
                value = item.get(name)
                if isinstance(value, bool) or not isinstance(value, typ):
                    return f"{what} field {name!r} is missing or mistyped"
            for name in ("backend", "error", "error_type"):
                if item.get(name) is not None and not isinstance(item.get(name), str):
                    return f"{what} field {name!r} is mistyped"
    return None


def load_dumps(paths: Iterable[Path], skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """The newest dump of every (name, incarnation) among ``paths``.

    Unreadable or malformed files are skipped; ``skipped``, if given, gets one line per file
    saying why.
    """
    newest: dict[tuple[str, str], dict[str, Any]] = {}
    for p in paths:
        try:
            if p.stat().st_size > _MAX_DUMP_BYTES:
                raise ValueError(f"larger than {_MAX_DUMP_BYTES} bytes")
            doc = json.loads(p.read_text())
            why = _malformed(doc)
        except (OSError, ValueError, RecursionError) as exc:
            why = f"unreadable: {type(exc).__name__}: {exc}"
        if why is not None:
            if skipped is not None:
                skipped.append(f"{p}: {why}")
            continue
        key = (doc["name"], doc["incarnation"])
        if key not in newest or doc["time"] > newest[key]["time"]:
            newest[key] = doc
    return sorted(newest.values(), key=lambda d: (d["name"], d["time"]))


def analyze(dumps: list[dict[str, Any]]) -> str:
    """A short human-readable report: per (initiator -> peer), the operations that never
    completed, the last completed one, which side looks stalled, and the errors."""
    lines: list[str] = []
    names = {d["name"] for d in dumps}
    heads = [f"{d['name']} (pid {d['pid']}, {d['reason']}, dropped {d['dropped']})" for d in dumps]
    lines.append(f"{len(dumps)} dump(s): " + ", ".join(heads))
    for d in dumps:
        for e in d.get("events", []):
            lines.append(f"  event  {d['name']}: {e['event']} {e['peer']}: {e['detail']}")
        by_peer: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        for r in d["records"]:
            by_peer[r["peer"]].append(r)
        for peer, recs in sorted(by_peer.items()):
            open_ = [r for r in recs if r["state"] in ("started", "moving")]
            done = [r for r in recs if r["state"] == "done"]
            failed = [r for r in recs if r["state"] in ("failed", "aborted")]
            stalled = [r for r in open_ if d["time"] - r["started"] >= STALL_S]
            status = "STALLED" if stalled else ("ERRORS" if failed else ("in flight" if open_ else "ok"))
            lines.append(f"{d['name']} -> {peer}: {status}  ({len(done)} done, {len(failed)} failed/aborted, "
                         f"{len(open_)} not completed at dump time)")
            for r in open_[:5]:
                age = d["time"] - r["started"]
                where = (f"{peer} (or the link) is not taking the bytes" if r["state"] == "moving"
                         else f"{d['name']} has not started moving bytes (peer lookup / validation / backend choice)")
                label = "STALLED" if age >= STALL_S else "in flight"
                lines.append(f"    {label}: #{r['seq']} {r['op']} {r['key']!r} {r['nbytes']} B via {r['backend']} — "
                             f"{r['state']} for {age:.2f}s: {where}{_lanes_said(r)}")
            if done:
                r = done[-1]
                lines.append(f"    last completed: #{r['seq']} {r['op']} {r['key']!r} {r['nbytes']} B "
                             f"via {r['backend']}")
            for r in failed[-3:]:
                lines.append(f"    error: #{r['seq']} {r['op']} {r['key']!r}: {r['error_type']}: {r['error']}"
                             f"{_lanes_said(r)}")
            if open_ and peer not in names:
                lines.append(f"    no dump from {peer}: it may be dead, stopped or on another host")
    return "\n".join(lines)


def _lanes_said(record: dict[str, Any]) -> str:
    """What the lanes that carried an operation had delivered, for a report line ("" if none)."""
    lanes = record.get("lanes")
    if not isinstance(lanes, dict) or not lanes:
        return ""
    return " (lanes: " + ", ".join(f"{k} {v} B" for k, v in list(lanes.items())[:16]) + ")"
