"""The wire: versioned encodings of everything that crosses a process boundary (never pickle).
The socket reads and writes that frames travel by are in :mod:`transport._sockets`.

* Peer records (what a peer publishes in the rendezvous store): JSON with a format tag and a
  version number, validated field by field into frozen dataclasses. Backend descriptors are
  opaque bytes (base64 in the JSON).
* Agent frames (the control / ``tcp`` data connection): a fixed binary header, a small JSON
  metadata part and a raw payload.

Everything here decodes bytes that another process (or anyone who can reach a port or write to
the store) chose, so every decoder is bounded before it parses: :func:`loads_bounded` refuses
JSON larger than a size cap or nested deeper than a depth cap without handing it to ``json``,
and every way decoding can fail (including RecursionError and MemoryError) is a
:class:`WireError`.
"""

from __future__ import annotations

import base64
import enum
import ipaddress
import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._errors import (
    AuthenticationError,
    BoundsError,
    DTypeMismatchError,
    PeerLostError,
    ReadOnlyRegionError,
    RegistrationError,
    TransportError,
    TransportInternalError,
    WireError,
)


class TransferOp(enum.Enum):
    """The direction of a transfer: ``PUT`` writes into the peer, ``GET`` reads from it.

    The one spelling of direction in the library (backends, staging, wire and flight records).
    """

    PUT = "put"
    GET = "get"


RECORD_FORMAT = "transport.peer"
RECORD_VERSION = 1


MAX_RECORD_BYTES = 16 << 20  # a peer record larger than this is refused unread (stores check it too)
MAX_RECORD_DEPTH = 16  # a record nests 4 levels (record, regions, region, descriptors)
MAX_AGENT_ADDRESSES = 16  # addresses one agent listens on (one per NIC) and a record may list
MAX_META_DEPTH = 32  # frame metadata is flat; backends' requests nest a little


# -- bounded JSON ---------------------------------------------------------------------------------

_STRING = re.compile(rb'"[^"]*"')  # once escapes are gone, a string is quote, no quote, quote
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_DEPTH_CHUNK = 1 << 20


def json_depth_exceeds(data: bytes, max_depth: int) -> bool:
    """Whether the JSON text ``data`` nests arrays and objects deeper than ``max_depth``.

    Brackets inside strings do not count. Linear in ``len(data)`` and done in C (bytes methods,
    one regex without backtracking, numpy for the running depth), so it is cheap to run on
    hostile input. Exact for valid JSON; for invalid JSON it may over-count, never under-count up
    to the point where ``json`` would stop, so what it passes cannot make ``json`` recurse deeper.
    """
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return False  # the common case: fewer openings than the cap
    # A backslash run starts an escape at its first byte: drop escaped backslashes, then escaped
    # quotes; what remains of each string has no quote inside.
    text = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = _STRING.sub(b"", text).translate(_BRACKETS, _NOT_BRACKETS)
    if brackets.count(b"[") <= max_depth:
        return False
    import numpy as np  # already loaded by torch; only hostile or huge documents get here

    opens, depth = np.frombuffer(brackets, dtype=np.uint8) == ord("["), 0
    for start in range(0, len(opens), _DEPTH_CHUNK):  # in chunks: small temporaries, cache-warm
        steps = opens[start : start + _DEPTH_CHUNK].astype(np.int32) * 2 - 1
        running = np.cumsum(steps) + depth
        if int(running.max()) > max_depth:
            return True
        depth = int(running[-1])
    return False


def loads_bounded(data: bytes, *, max_bytes: int, max_depth: int, what: str) -> Any:
    """``json.loads`` for bytes from another process: UTF-8 JSON of at most ``max_bytes`` bytes
    nesting at most ``max_depth`` arrays/objects; both checked before parsing.

    Raises:
        WireError: too large, too deep, not UTF-8, or not JSON (``what`` names the thing in the
            message). Nothing else: RecursionError and MemoryError from parsing become WireError.
    """
    if len(data) > max_bytes:
        raise WireError(f"{what} of {len(data)} bytes exceeds the limit of {max_bytes}")
    if json_depth_exceeds(data, max_depth):
        raise WireError(f"{what} nests deeper than {max_depth} levels")
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError, MemoryError) as exc:
        raise WireError(f"{what} is not valid JSON ({len(data)} bytes): {exc}") from exc


@dataclass(frozen=True)
class RegionRecord:
    """A registered region as its owner publishes it."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    writable: bool
    descriptors: Mapping[str, bytes] = field(default_factory=dict)  # backend name -> opaque
    device: str = "cpu"  # "cpu" or "cuda:<uuid>" (the GPU's UUID: ordinals differ between processes)
    moved: str = ""  # why the owner's tensor no longer lives in the registered memory ("" if it does)


@dataclass(frozen=True)
class HostId:
    """Identifies a host and PID namespace: same HostId means same-host IPC may work."""

    hostname: str
    boot_id: str
    pid_ns: int


@dataclass(frozen=True)
class PeerRecord:
    """Everything a peer publishes about itself. ``seq`` grows with every re-publish.

    ``agent`` is where its agent listens (control connections, the ``tcp`` backend); an agent
    that listens on several addresses (one per NIC) lists them all in ``agents``, ``agent``
    first, and the ``tcp`` backend stripes large transfers over them. A record with one address
    (or from a version that knew only one) has ``agents == ()``: :attr:`addresses` is the one
    to use.
    """

    name: str
    incarnation: str
    seq: int
    pid: int
    pid_start: int
    host: HostId
    agent: tuple[str, int]
    backends: Mapping[str, bytes]
    regions: Mapping[str, RegionRecord]
    agents: tuple[tuple[str, int], ...] = ()

    @property
    def addresses(self) -> tuple[tuple[str, int], ...]:
        """Every address the peer's agent listens on, :attr:`agent` first."""
        return self.agents or (self.agent,)

    def encode(self) -> bytes:
        doc = {
            "format": RECORD_FORMAT,
            "v": RECORD_VERSION,
            "name": self.name,
            "incarnation": self.incarnation,
            "seq": self.seq,
            "pid": self.pid,
            "pid_start": self.pid_start,
            "host": [self.host.hostname, self.host.boot_id, self.host.pid_ns],
            "agent": [self.agent[0], self.agent[1]],
            **({"agents": [[h, p] for h, p in self.agents]} if len(self.agents) > 1 else {}),
            "backends": {k: _b64(v) for k, v in self.backends.items()},
            "regions": [
                {
                    "key": r.key,
                    "dtype": r.dtype,
                    "shape": list(r.shape),
                    "nbytes": r.nbytes,
                    "writable": r.writable,
                    "desc": {k: _b64(v) for k, v in r.descriptors.items()},
                    **({"device": r.device} if r.device != "cpu" else {}),
                    **({"moved": r.moved} if r.moved else {}),
                }
                for r in self.regions.values()
            ],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @staticmethod
    def decode(data: bytes) -> PeerRecord:
        """Raises WireError: too large (:data:`MAX_RECORD_BYTES`), too deep, or malformed."""
        doc = loads_bounded(data, max_bytes=MAX_RECORD_BYTES, max_depth=MAX_RECORD_DEPTH, what="peer record")
        if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT:
            raise WireError("not a transport peer record")
        if doc.get("v") != RECORD_VERSION:
            raise WireError(
                f"peer record version {doc.get('v')!r} is not supported (this library reads "
                f"version {RECORD_VERSION}); upgrade the older side"
            )
        try:
            regions = {}
            for r in _typed(doc, "regions", list):
                rec = RegionRecord(
                    key=_typed(r, "key", str),
                    dtype=_typed(r, "dtype", str),
                    shape=tuple(int(x) for x in _typed(r, "shape", list)),
                    nbytes=_typed(r, "nbytes", int),
                    writable=_typed(r, "writable", bool),
                    descriptors={k: _unb64(v) for k, v in _typed(r, "desc", dict).items()},
                    device=_typed(r, "device", str) if "device" in r else "cpu",
                    moved=_typed(r, "moved", str) if "moved" in r else "",
                )
                _check_region(rec)
                regions[rec.key] = rec
            host = _typed(doc, "host", list)
            agent = _typed(doc, "agent", list)
            return PeerRecord(
                name=_typed(doc, "name", str),
                incarnation=_typed(doc, "incarnation", str),
                seq=_typed(doc, "seq", int),
                pid=_typed(doc, "pid", int),
                pid_start=_typed(doc, "pid_start", int),
                host=HostId(str(host[0]), str(host[1]), int(host[2])),
                agent=(str(agent[0]), int(agent[1])),
                backends={k: _unb64(v) for k, v in _typed(doc, "backends", dict).items()},
                regions=regions,
                agents=_agent_addresses(doc["agents"], (str(agent[0]), int(agent[1]))) if "agents" in doc else (),
            )
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise WireError(f"malformed peer record: {exc}") from exc


_MAX_HOST_CHARS = 253  # a DNS name's longest spelling (an IP literal is shorter)
_HOST_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?")


def check_agent_address(host: object, port: object) -> tuple[str, int]:
    """``(host, port)`` if it can be an agent's address: an IP literal or a DNS name of at most
    253 characters, and a port in 1..65535; else raises ValueError (a record's field: the
    caller makes it a WireError)."""
    if not isinstance(host, str) or not 0 < len(host) <= _MAX_HOST_CHARS:
        raise ValueError(f"an agent address's host is a str of 1 to {_MAX_HOST_CHARS} characters, "
                         f"got {repr(host)[:80]}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOST_NAME.fullmatch(host):
            raise ValueError(f"an agent address's host is an IP address or a DNS name, got {host[:80]!r}") from None
    if type(port) is not int or not 0 < port < 65536:
        raise ValueError(f"an agent address's port is in 1..65535, got {repr(port)[:80]}")
    return host, port


def _agent_addresses(items: Any, agent: tuple[str, int]) -> tuple[tuple[str, int], ...]:
    """A record's ``agents``: a list of 2 to MAX_AGENT_ADDRESSES distinct ``[host, port]``,
    each checked (:func:`check_agent_address`), the first one the record's ``agent``."""
    if not isinstance(items, list) or not 1 < len(items) <= MAX_AGENT_ADDRESSES:
        raise ValueError(f"field 'agents' must list 2 to {MAX_AGENT_ADDRESSES} addresses, "
                         f"got {len(items) if isinstance(items, list) else type(items).__name__}")
    out = []
    for item in items:
        if not isinstance(item, list) or len(item) != 2:
            raise ValueError("an agent address is [host, port]")
        out.append(check_agent_address(item[0], item[1]))
    if len(set(out)) != len(out):
        raise ValueError("field 'agents' lists an address twice")
    if out[0] != agent:
        raise ValueError(f"field 'agents' must start with the record's agent {agent[0]}:{agent[1]}")
    return tuple(out)


_ITEMSIZES = (1, 2, 4, 8, 16)  # every torch dtype's (this module does not import torch)
_MAX_REGION_BYTES = 1 << 62


def _check_region(r: RegionRecord) -> None:
    """A region's size is its shape's element count times an itemsize, and fits a process."""
    numel = 1
    for d in r.shape:
        numel *= d if d >= 0 else -(1 << 64)  # a negative dimension fits no size
    fits = r.nbytes in {numel * i for i in _ITEMSIZES} or r.nbytes == numel == 0
    if not 0 <= r.nbytes <= _MAX_REGION_BYTES or not fits:
        raise ValueError(f"region {r.key!r}: {r.nbytes} bytes for shape {r.shape}")


def _typed(doc: Any, key: str, typ: type) -> Any:
    value = doc[key]
    if (typ is int and isinstance(value, bool)) or not isinstance(value, typ):
        raise TypeError(f"field {key!r} should be {typ.__name__}, got {type(value).__name__}")
    return value


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _unb64(s: str) -> bytes:
    if not isinstance(s, str):
        raise TypeError(f"expected base64 text, got {type(s).__name__}")
    return base64.b64decode(s.encode(), validate=True)


# ---------------------------------------------------------------------------------------------
# Agent frames

FRAME_MAGIC = b"TXP1"
# magic, kind, flags, reserved, request id, meta length, payload length
FRAME_HEADER = struct.Struct("<4sBBHQIQ")
MAX_META = 1 << 20  # frame metadata, after the HELLO
# A HELLO's metadata, read before the connection authenticated: names, incarnations, lane, nonce and
# tag take a few hundred bytes (JSON spells a non-ASCII character in 6).
PRE_AUTH_META = 8 << 10


class FrameKind(enum.IntEnum):
    """The frame kinds of the agent's own protocol. A backend may serve kinds of its own
    (``Backend.frames``, numbers in ``BACKEND_KINDS``): the tcp backend's PUT 2, GET 3, PUTR 8
    and GETR 9 (``transport.backends.tcp._frames.TcpFrame``); 6 and 7 were retired (never reused)."""

    HELLO = 1
    SIGNAL = 4
    BACKEND = 5  # a backend's own control request (meta["backend"] names it), e.g. nccl's recv
    BACKEND_DATA = 10  # a backend's own request with a payload (meta["backend"] names it): Backend.serve_frame
    OK = 16
    DATA = 17
    ERR = 18


class ErrCode(enum.IntEnum):
    """Why the agent refused a request; mapped back to the error tree by the initiator."""

    INTERNAL = 1
    UNKNOWN_KEY = 2
    DTYPE = 3
    BOUNDS = 4
    READ_ONLY = 5
    STALE = 6  # the request was meant for another incarnation of this peer
    BAD_REQUEST = 7  # the request did not decode as what it claims to be (a WireError here)
    AUTH = 8  # the connection (or what the request names) did not present the shared token
    # Not an answer (request id 0, which no request has): the agent closes this connection to make
    # room, and has processed nothing on it since its last reply. A request still unanswered may be
    # sent again on a new connection: it was not (and will not be) carried out.
    GOING_AWAY = 9


_ERROR_CLASSES: dict[int, type[TransportError]] = {
    ErrCode.DTYPE: DTypeMismatchError,
    ErrCode.BOUNDS: BoundsError,
    ErrCode.UNKNOWN_KEY: RegistrationError,
    ErrCode.READ_ONLY: ReadOnlyRegionError,
    ErrCode.STALE: PeerLostError,
    ErrCode.BAD_REQUEST: TransportInternalError,  # the peer could not decode what we sent: a bug or a version skew
    ErrCode.AUTH: AuthenticationError,
}

# The refusals a target sends by type, most specific first. Anything else a route raises is
# INTERNAL: a failure of the target's own (TransportInternalError, PeerLostError,
# TransferTimeoutError, TransferAbortedError, StoreError, ...), which the initiator cannot act
# on by its kind (a PeerLostError by type would make it drop a peer that is alive), and a
# BackendUnavailableError (a backend the target does not run, memory it cannot reach), which
# has no code of its own: the initiator sees a TransportInternalError with its message.
_REFUSALS: tuple[tuple[type[TransportError], ErrCode], ...] = (
    (ReadOnlyRegionError, ErrCode.READ_ONLY),
    (DTypeMismatchError, ErrCode.DTYPE),
    (BoundsError, ErrCode.BOUNDS),
    (RegistrationError, ErrCode.UNKNOWN_KEY),
    (WireError, ErrCode.BAD_REQUEST),
    (AuthenticationError, ErrCode.AUTH),
)


def error_to_frame(exc: TransportError) -> tuple[ErrCode, str]:
    """The ERR frame's code and message for a refusal the initiator should see as ``exc``
    (:func:`frame_to_error` maps the code back)."""
    for cls, code in _REFUSALS:
        if isinstance(exc, cls):
            return code, str(exc)
    return ErrCode.INTERNAL, str(exc)


def frame_to_error(meta: Mapping[str, Any], peer: str) -> TransportError:
    """The error an ERR frame's metadata from ``peer`` stands for (an unknown or mistyped code
    is a TransportInternalError; the message is cut to 1,000 characters)."""
    code = meta.get("code")
    cls = _ERROR_CLASSES.get(code, TransportInternalError) if type(code) is int else TransportInternalError
    return cls(f"{peer} refused: {str(meta.get('message', ''))[:1000]}")


RETIRED_KINDS = frozenset({6, 7})  # PUTV / GETV, once: never reused
# The kinds a backend may serve (Backend.frames): every other one-byte kind.
BACKEND_KINDS = frozenset(range(2, 256)) - frozenset(FrameKind) - RETIRED_KINDS


def kind_name(kind: int) -> str:
    """A frame kind as messages name it: the agent's by name, a backend's by number."""
    return kind.name if isinstance(kind, FrameKind) else f"kind-{kind}"


@dataclass(frozen=True)
class FrameHeader:
    kind: int  # a FrameKind, or a kind in BACKEND_KINDS (served by the backend that declares it)
    request_id: int
    meta_len: int
    payload_len: int


def encode_frame(kind: int, request_id: int, meta: Mapping[str, Any], payload_len: int) -> bytes:
    meta_b = json.dumps(meta, separators=(",", ":")).encode()
    return FRAME_HEADER.pack(FRAME_MAGIC, int(kind), 0, 0, request_id, len(meta_b), payload_len) + meta_b


def decode_header(data: bytes, max_meta: int = MAX_META) -> FrameHeader:
    """Raises WireError: not a frame header (an unknown or retired kind included), or metadata
    longer than ``max_meta`` announced."""
    if len(data) != FRAME_HEADER.size:
        raise WireError(f"frame header of {len(data)} bytes, expected {FRAME_HEADER.size}")
    magic, kind, _flags, _res, rid, meta_len, payload_len = FRAME_HEADER.unpack(data)
    if magic != FRAME_MAGIC:
        raise WireError(f"bad frame magic {magic!r}: not a transport agent connection")
    fk: int
    if kind in BACKEND_KINDS:
        fk = kind  # whether a backend here serves it is the agent's to say
    else:
        try:
            fk = FrameKind(kind)
        except ValueError:
            raise WireError(f"unknown frame kind {kind}") from None
    if meta_len > max_meta:
        raise WireError(f"{kind_name(fk)} frame announces {meta_len} bytes of metadata, more than {max_meta}")
    return FrameHeader(fk, rid, meta_len, payload_len)


def decode_meta(data: bytes) -> dict[str, Any]:
    """Raises WireError: not a JSON object of at most MAX_META bytes and MAX_META_DEPTH levels."""
    meta = loads_bounded(data, max_bytes=MAX_META, max_depth=MAX_META_DEPTH, what="frame metadata") if data else {}
    if not isinstance(meta, dict):
        raise WireError("frame metadata is not an object")
    return meta


# ---------------------------------------------------------------------------------------------
# Typed requests (the metadata of the frames the agent itself serves: SIGNAL), validated on arrival;
# backends define their own (the tcp backend's: transport/backends/tcp/_frames.py) with these fields


def field_int(meta: Mapping[str, Any], key: str) -> int:
    """``meta[key]`` as an int (not a bool). Raises WireError."""
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise WireError(f"request field {key!r} must be an integer, got {type(value).__name__}")
    return value


def field_str(meta: Mapping[str, Any], key: str) -> str:
    """``meta[key]`` as a str. Raises WireError."""
    value = meta.get(key)
    if not isinstance(value, str):
        raise WireError(f"request field {key!r} must be a string, got {type(value).__name__}")
    return value




@dataclass(frozen=True)
class SignalRequest:
    """Sets signal ``name`` to ``value`` at the receiving endpoint."""

    name: str
    value: int

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> SignalRequest:
        """Raises WireError for a missing or mistyped field, or a name longer than
        MAX_SIGNAL_NAME_BYTES."""
        return cls(check_signal_name(field_str(meta, "name"), WireError), field_int(meta, "value"))


MAX_SIGNAL_NAME_BYTES = 256


def check_signal_name(name: object, error: type[Exception] = ValueError) -> str:
    """``name`` if it can name a signal (a str of 1 to MAX_SIGNAL_NAME_BYTES bytes of UTF-8);
    else raises ``error``."""
    if not isinstance(name, str) or not 0 < len(name.encode(errors="surrogatepass")) <= MAX_SIGNAL_NAME_BYTES:
        shown = repr(name)[:80]
        raise error(f"a signal name is a str of 1 to {MAX_SIGNAL_NAME_BYTES} bytes, got {shown}")
    return name
