"""Versioned encodings of everything that crosses a process boundary (never pickle).

* Peer records (what a peer publishes in the rendezvous store): JSON with a format tag and a
  version number, validated field by field into frozen dataclasses. Backend descriptors are
  opaque bytes (base64 in the JSON).
* Agent frames (the control / ``tcp`` data connection): a fixed binary header, a small JSON
  metadata part and a raw payload.
"""

from __future__ import annotations

import base64
import enum
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._errors import TransportInternalError


class TransferOp(enum.Enum):
    """The direction of a transfer: ``PUT`` writes into the peer, ``GET`` reads from it.

    The one spelling of direction in the library (backends, staging, wire and flight records).
    """

    PUT = "put"
    GET = "get"


RECORD_FORMAT = "transport.peer"
RECORD_VERSION = 1


class WireError(TransportInternalError):
    """Bytes from another process that do not decode as what they claim to be."""


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


@dataclass(frozen=True)
class HostId:
    """Identifies a host and PID namespace: same HostId means same-host IPC may work."""

    hostname: str
    boot_id: str
    pid_ns: int


@dataclass(frozen=True)
class PeerRecord:
    """Everything a peer publishes about itself. ``seq`` grows with every re-publish."""

    name: str
    incarnation: str
    seq: int
    pid: int
    pid_start: int
    host: HostId
    agent: tuple[str, int]
    backends: Mapping[str, bytes]
    regions: Mapping[str, RegionRecord]

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
                }
                for r in self.regions.values()
            ],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @staticmethod
    def decode(data: bytes) -> PeerRecord:
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise WireError(f"peer record is not valid JSON ({len(data)} bytes)") from exc
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
                )
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
            )
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise WireError(f"malformed peer record: {exc}") from exc


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
MAX_META = 1 << 20


class FrameKind(enum.IntEnum):
    HELLO = 1
    PUT = 2
    GET = 3
    SIGNAL = 4
    BACKEND = 5  # a backend's own control request (meta["backend"] names it), e.g. nccl's recv
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
    BAD_REQUEST = 7
    AUTH = 8  # the connection did not present the shared token


@dataclass(frozen=True)
class FrameHeader:
    kind: FrameKind
    request_id: int
    meta_len: int
    payload_len: int


def encode_frame(kind: FrameKind, request_id: int, meta: Mapping[str, Any], payload_len: int) -> bytes:
    meta_b = json.dumps(meta, separators=(",", ":")).encode()
    return FRAME_HEADER.pack(FRAME_MAGIC, int(kind), 0, 0, request_id, len(meta_b), payload_len) + meta_b


def decode_header(data: bytes) -> FrameHeader:
    if len(data) != FRAME_HEADER.size:
        raise WireError(f"frame header of {len(data)} bytes, expected {FRAME_HEADER.size}")
    magic, kind, _flags, _res, rid, meta_len, payload_len = FRAME_HEADER.unpack(data)
    if magic != FRAME_MAGIC:
        raise WireError(f"bad frame magic {magic!r}: not a transport agent connection")
    try:
        fk = FrameKind(kind)
    except ValueError:
        raise WireError(f"unknown frame kind {kind}") from None
    if meta_len > MAX_META:
        raise WireError(f"frame metadata of {meta_len} bytes exceeds {MAX_META}")
    return FrameHeader(fk, rid, meta_len, payload_len)


def decode_meta(data: bytes) -> dict[str, Any]:
    try:
        meta = json.loads(data) if data else {}
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError("frame metadata is not valid JSON") from exc
    if not isinstance(meta, dict):
        raise WireError("frame metadata is not an object")
    return meta


# ---------------------------------------------------------------------------------------------
# Typed requests (the metadata of PUT / GET / SIGNAL frames), validated on arrival


def _int(meta: Mapping[str, Any], key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise WireError(f"request field {key!r} must be an integer, got {type(value).__name__}")
    return value


def _str(meta: Mapping[str, Any], key: str) -> str:
    value = meta.get(key)
    if not isinstance(value, str):
        raise WireError(f"request field {key!r} must be a string, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class RangeRequest:
    """A PUT or GET of ``nbytes`` ``dtype`` bytes at byte ``offset`` of region ``key``."""

    key: str
    dtype: str
    offset: int
    nbytes: int

    def to_meta(self) -> dict[str, Any]:
        return {"key": self.key, "dtype": self.dtype, "offset": self.offset, "nbytes": self.nbytes}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> RangeRequest:
        """Raises WireError for a missing or mistyped field."""
        return cls(_str(meta, "key"), _str(meta, "dtype"), _int(meta, "offset"), _int(meta, "nbytes"))


@dataclass(frozen=True)
class SignalRequest:
    """Sets signal ``name`` to ``value`` at the receiving endpoint."""

    name: str
    value: int

    def to_meta(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> SignalRequest:
        """Raises WireError for a missing or mistyped field."""
        return cls(_str(meta, "name"), _int(meta, "value"))
