"""What code a refusal travels under, and what the initiator makes of it.

Every error a target's routes raise to refuse a request reaches the initiator as an ERR frame's
code (``error_to_frame``) and comes back as an error class (``frame_to_error``). A request that
does not decode is BAD_REQUEST (it was INTERNAL) and an authentication failure AUTH; a failure
of the target's own (a lost peer of its own, a timeout) stays INTERNAL, as by type it would make
the initiator drop a peer that is alive, and so does a backend the target does not run (no code
of its own). The frames go to a real target process (tests/peers/hostile_target.py).
"""

from __future__ import annotations

import json
import socket

import anyio
import anyio.to_thread
import pytest

from tests.peers import resource_probe as probe
from transport import (
    AuthenticationError,
    BackendUnavailableError,
    BoundsError,
    ClosedError,
    DTypeMismatchError,
    PeerLostError,
    ReadOnlyRegionError,
    RegistrationError,
    StoreError,
    TransferAbortedError,
    TransferTimeoutError,
    TransportError,
    TransportInternalError,
    WireError,
)
from transport._wire import FRAME_HEADER, ErrCode, FrameKind, encode_frame, error_to_frame, frame_to_error
from transport.backends.tcp._frames import TcpFrame


@pytest.mark.parametrize(("error", "code", "seen_as"), [
    (ReadOnlyRegionError("x"), ErrCode.READ_ONLY, ReadOnlyRegionError),
    (DTypeMismatchError("x"), ErrCode.DTYPE, DTypeMismatchError),
    (BoundsError("x"), ErrCode.BOUNDS, BoundsError),
    (RegistrationError("x"), ErrCode.UNKNOWN_KEY, RegistrationError),
    (WireError("x"), ErrCode.BAD_REQUEST, TransportInternalError),
    (AuthenticationError("x"), ErrCode.AUTH, AuthenticationError),
    (BackendUnavailableError("x"), ErrCode.INTERNAL, TransportInternalError),
    (TransportInternalError("x"), ErrCode.INTERNAL, TransportInternalError),
    (PeerLostError("x"), ErrCode.INTERNAL, TransportInternalError),
    (TransferTimeoutError("x"), ErrCode.INTERNAL, TransportInternalError),
    (TransferAbortedError("x", partial=True), ErrCode.INTERNAL, TransportInternalError),
    (ClosedError("x"), ErrCode.INTERNAL, TransportInternalError),
    (StoreError("x"), ErrCode.INTERNAL, TransportInternalError),
], ids=lambda v: type(v).__name__ if isinstance(v, Exception) else "")
def test_every_refusal_travels_under_its_code(error: TransportError, code: ErrCode, seen_as: type):
    sent, message = error_to_frame(error)
    assert (sent, message) == (code, "x")
    back = frame_to_error({"code": int(sent), "message": message}, "target")
    assert type(back) is seen_as, back


def _putr(rid: int, groups: object, rows: list[tuple[int, int]], data: bytes,
          kind: int = TcpFrame.PUTR) -> bytes:
    table = b"".join(o.to_bytes(8, "little", signed=True) + n.to_bytes(8, "little", signed=True) for o, n in rows)
    return encode_frame(kind, rid, {"groups": groups}, len(table) + len(data)) + table + data


REQUESTS = [  # (what, frame, the code it must be refused with)
    ("a PUTR without groups", _putr(2, [], [(0, 4)], bytes(4)), ErrCode.BAD_REQUEST),
    ("a PUTR group short of a field", _putr(3, [["w", "uint8"]], [(0, 4)], bytes(4)), ErrCode.BAD_REQUEST),
    ("a PUTR whose table wants more data", _putr(4, [["w", "uint8", 2]], [(0, 4), (8, 4)], bytes(4)),
     ErrCode.BAD_REQUEST),
    ("a GETR with data", _putr(5, [["w", "uint8", 1]], [(0, 4)], bytes(4), TcpFrame.GETR), ErrCode.BAD_REQUEST),
    ("a PUT whose payload is not its size",
     encode_frame(TcpFrame.PUT, 6, {"key": "w", "dtype": "uint8", "offset": 0, "nbytes": 8}, 4) + bytes(4),
     ErrCode.BAD_REQUEST),
    ("a PUT without a key", encode_frame(TcpFrame.PUT, 7, {"dtype": "uint8", "offset": 0, "nbytes": 4}, 4) + bytes(4),
     ErrCode.BAD_REQUEST),
    ("a SIGNAL without a value", encode_frame(FrameKind.SIGNAL, 8, {"name": "s"}, 0), ErrCode.BAD_REQUEST),
    ("a backend's request for a backend not run here", encode_frame(FrameKind.BACKEND, 9, {"backend": "nosuch"}, 0),
     ErrCode.INTERNAL),
    ("a backend's data for a backend not run here",
     encode_frame(FrameKind.BACKEND_DATA, 10, {"backend": "nosuch"}, 4) + bytes(4), ErrCode.INTERNAL),
    ("a PUT into no such region",
     encode_frame(TcpFrame.PUT, 11, {"key": "nope", "dtype": "uint8", "offset": 0, "nbytes": 4}, 4) + bytes(4),
     ErrCode.UNKNOWN_KEY),
    ("a PUT of another dtype",
     encode_frame(TcpFrame.PUT, 12, {"key": "w", "dtype": "int32", "offset": 0, "nbytes": 4}, 4) + bytes(4),
     ErrCode.DTYPE),
    ("a PUTR run past the region", _putr(13, [["w", "uint8", 1]], [(probe.TARGET_NUMEL, 4)], bytes(4)),
     ErrCode.BOUNDS),
]


def _ask_all(addr: tuple[str, int], to: str, incarnation: str) -> list[tuple[FrameKind, int, dict]]:
    """Sends every request of REQUESTS on one connection; the answers, in order."""
    answers = []
    with probe.greeted(addr, to, incarnation, "asker") as s:
        for _, frame, _ in REQUESTS:
            s.sendall(frame)
            _, kind, _, _, rid, meta_len, plen = FRAME_HEADER.unpack(s.recv(FRAME_HEADER.size, socket.MSG_WAITALL))
            meta = json.loads(s.recv(meta_len, socket.MSG_WAITALL))
            if plen:
                s.recv(plen, socket.MSG_WAITALL)
            answers.append((FrameKind(kind), rid, meta))
    return answers


async def test_a_target_refuses_each_bad_request_under_its_code(tmp_path):
    target = probe.Target(tmp_path, f"file://{tmp_path / 'store'}")
    try:
        addr, inc = await probe.agent_of(target.store, target.name)
        answers = await anyio.to_thread.run_sync(_ask_all, addr, target.name, inc)
        got = {what: (kind, meta.get("code")) for (what, _, _), (kind, _, meta) in zip(REQUESTS, answers, strict=True)}
        assert got == {what: (FrameKind.ERR, int(code)) for what, _, code in REQUESTS}, answers
        assert [rid for _, rid, _ in answers] == [2 + i for i in range(len(REQUESTS))]  # one answer each, in step
        await probe.legit_put_timed(target.store, target.name, None)  # and the target serves on
        assert target.alive()
    finally:
        target.close()
