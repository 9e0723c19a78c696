"""Optional shared-token authentication of peer records and agent connections.

With a token (``Transport(token=...)`` or ``$TRANSPORT_TOKEN``) every peer record is published
with an HMAC-SHA256 tag and records without a valid tag are ignored, and every agent connection
starts with a mutual challenge: the client's HELLO carries a fresh nonce, a timestamp and a tag
over both ends' names and incarnations; the server checks it (constant-time compare, bounded
clock skew, no nonce reuse) and answers with a tag over the nonce that the client checks.
Data frames are not encrypted: the token proves membership, it does not hide bytes. The token
itself never appears in records, frames, logs or flight-recorder dumps.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Mapping
from typing import Any

from ._errors import AuthenticationError

TOKEN_ENV = "TRANSPORT_TOKEN"
_SIGNED_PREFIX = b"TXSIG1 "
_MAX_SKEW_S = 300.0


class Authenticator:
    """Signs and checks with one shared token; with no token every check passes."""

    def __init__(self, token: str | bytes | None) -> None:
        if token is None:
            token = os.environ.get(TOKEN_ENV) or None
        self._key = token.encode() if isinstance(token, str) else token
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def _tag(self, *parts: object) -> str:
        assert self._key is not None
        msg = "\x1f".join(str(p) for p in parts).encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def _check(self, tag: object, *parts: object) -> bool:
        return isinstance(tag, str) and hmac.compare_digest(tag.encode(), self._tag(*parts).encode())

    # -- records ----------------------------------------------------------------------------

    def sign_record(self, data: bytes) -> bytes:
        if not self.enabled:
            return data
        return _SIGNED_PREFIX + self._tag("record", data.hex()).encode() + b" " + data

    def open_record(self, data: bytes, peer: str) -> bytes:
        """The record inside ``data``. Raises AuthenticationError when a token is set and the
        tag is missing or wrong."""
        signed = data.startswith(_SIGNED_PREFIX)
        start = len(_SIGNED_PREFIX)
        tag, body = (data[start : start + 64], data[start + 65 :]) if signed else (b"", data)
        if self.enabled and not (signed and self._check(tag.decode("ascii", "replace"), "record", body.hex())):
            how = "signed with another token" if signed else "not signed"
            raise AuthenticationError(f"the record of {peer!r} is {how}; ignoring it")
        return body

    # -- connections ------------------------------------------------------------------------

    def hello_fields(self, client: str, client_inc: str, server: str, server_inc: str) -> dict[str, Any]:
        if not self.enabled:
            return {}
        nonce, ts = secrets.token_hex(16), time.time()
        return {"nonce": nonce, "ts": ts, "mac": self._tag("hello", client, client_inc, server, server_inc, nonce, ts)}

    def check_hello(self, meta: Mapping[str, Any], server: str, server_inc: str) -> None:
        if not self.enabled:
            return
        nonce, ts = meta.get("nonce"), meta.get("ts")
        ok = isinstance(nonce, str) and isinstance(ts, (int, float)) and self._check(
            meta.get("mac"), "hello", meta.get("from"), meta.get("from_incarnation"), server, server_inc, nonce, ts)
        if not ok or not isinstance(nonce, str) or not isinstance(ts, (int, float)):
            raise AuthenticationError(f"connection from {meta.get('from')!r} presented no valid token")
        now = time.time()
        if abs(now - float(ts)) > _MAX_SKEW_S or nonce in self._seen:
            raise AuthenticationError(f"connection from {meta.get('from')!r} replayed an old handshake")
        self._seen[nonce] = now
        while self._seen and next(iter(self._seen.values())) < now - 2 * _MAX_SKEW_S:
            self._seen.popitem(last=False)

    def ok_fields(self, hello: Mapping[str, Any], server_inc: str) -> dict[str, Any]:
        return {"mac": self._tag("ok", hello.get("nonce"), server_inc)} if self.enabled else {}

    def check_ok(self, reply: Mapping[str, Any], hello: Mapping[str, Any], server: str, server_inc: str) -> None:
        if self.enabled and not self._check(reply.get("mac"), "ok", hello.get("nonce"), server_inc):
            raise AuthenticationError(f"{server} did not prove it holds the token")
