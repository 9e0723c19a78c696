"""Optional shared-token authentication of peer records and agent connections.

With a token (``Transport(token=...)`` or ``$TRANSPORT_TOKEN``) every peer record is published
with an HMAC-SHA256 tag that binds the record to the store key it is written under, the peer
name and the incarnation, so a signed record copied to another key (or name) no longer opens;
records without a valid tag are refused with AuthenticationError. Every agent connection
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
# TXSIG2 <64 hex tag> <hex of the incarnation> <body>: version 2 binds the key, name and incarnation.
_SIGNED_PREFIX = b"TXSIG2 "
_MAX_SKEW_S = 300.0


class Authenticator:
    """Signs and checks with one shared token; with no token every check passes.

    Args:
        token: the shared secret; None reads ``$TRANSPORT_TOKEN`` (unset or empty: no token).

    Raises:
        ValueError: an explicit empty token (it would authenticate nothing).
        TypeError: a token that is neither str nor bytes.
    """

    def __init__(self, token: str | bytes | None) -> None:
        if token is None:
            token = os.environ.get(TOKEN_ENV) or None
        elif not isinstance(token, (str, bytes)):
            raise TypeError(f"token must be str or bytes, got {type(token).__name__}")
        elif not token:
            raise ValueError("token must not be empty: an empty token authenticates nothing "
                             "(pass token=None, or nothing, for no authentication)")
        self._key = token.encode() if isinstance(token, str) else token
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def _tag(self, *parts: object) -> str:
        assert self._key is not None
        # Each part is length-prefixed, so no choice of names can shift bytes from one part to the next.
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            raw = part if isinstance(part, bytes) else str(part).encode("utf-8", "surrogatepass")
            mac.update(len(raw).to_bytes(8, "big"))
            mac.update(raw)
        return mac.hexdigest()

    def _check(self, tag: object, *parts: object) -> bool:
        return isinstance(tag, str) and hmac.compare_digest(tag.encode(), self._tag(*parts).encode())

    # -- records ----------------------------------------------------------------------------

    def sign_record(self, data: bytes, *, key: str = "", name: str = "", incarnation: str = "") -> bytes:
        """``data`` with a tag over it and what it is: the store ``key`` it is written under, the
        ``name`` of its publisher and its ``incarnation``. Unchanged without a token."""
        if not self.enabled:
            return data
        tag = self._tag("record", key, name, incarnation, data)
        return _SIGNED_PREFIX + tag.encode() + b" " + incarnation.encode().hex().encode() + b" " + data

    def open_record(self, data: bytes, peer: str, *, key: str = "", name: str = "") -> bytes:
        """The record inside ``data``, read from store key ``key`` and published by ``name``
        (both as given to :meth:`sign_record`; ``peer`` names it in errors).

        Raises:
            AuthenticationError: a token is set and the tag is missing, made with another
                token, or made for another key, name or incarnation.
        """
        return self.open_bound(data, peer, key=key, name=name)[0]

    def open_bound(self, data: bytes, peer: str, *, key: str, name: str) -> tuple[bytes, str | None]:
        """Like :meth:`open_record`, and also the incarnation the tag binds (None without a
        token: nothing is checked then, and a signed record's tag is only stripped)."""
        parsed = _split_signed(data)
        if not self.enabled:
            return (data if parsed is None else parsed[2]), None
        if parsed is None:
            raise AuthenticationError(f"the record of {peer!r} under {key!r} is not signed (this process has a "
                                      "token; every process of the namespace needs the same one)")
        tag, incarnation, body = parsed
        if not self._check(tag, "record", key, name, incarnation, body):
            raise AuthenticationError(f"the record of {peer!r} under {key!r} is signed with another token, or "
                                      "for another key or name (a copied record); ignoring it")
        return body, incarnation

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


def _split_signed(data: bytes) -> tuple[str, str, bytes] | None:
    """(tag, incarnation, body) of a signed record, or None when ``data`` is not one."""
    if not data.startswith(_SIGNED_PREFIX):
        return None
    start = len(_SIGNED_PREFIX)
    tag, sep = data[start : start + 64], data[start + 64 : start + 65]
    end = data.find(b" ", start + 65)
    if sep != b" " or end < 0:
        return None
    try:
        return tag.decode("ascii"), bytes.fromhex(data[start + 65 : end].decode("ascii")).decode(), data[end + 1 :]
    except ValueError:  # not hex, not ascii, not utf-8 (UnicodeDecodeError is a ValueError)
        return None
