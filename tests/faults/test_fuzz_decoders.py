"""Seeded, time-bounded mutation fuzzing of every decoder of bytes another process wrote.

Each decoder gets valid inputs made by its own encoder (or, for UCX, by libucp itself), then
mutated: bit flips, byte overwrites, insertions, deletions, truncations, splices of two inputs,
and, for JSON, numbers replaced by extremes (-1, 0, 2**31, 2**63, 2**200, floats, bools,
strings). Every input must decode or raise the decoder's typed error: nothing else escapes,
nothing hangs (each input is also timed against a generous bound), nothing crashes the process.

``$TRANSPORT_FUZZ_INPUTS`` inputs per decoder (default 1500: the slice CI runs) and
``$TRANSPORT_FUZZ_SECONDS`` at most per decoder (default 20), seed ``$TRANSPORT_FUZZ_SEED``
(default 0). The count each decoder ran is printed (``-s`` shows it).
"""

from __future__ import annotations

import json
import os
import random
import re
import struct
import time
from collections.abc import Callable

import pytest
import torch

import transport
from tests.plan._cases import random_case
from transport._errors import MeshLayoutError, WireError
from transport._native.ucx_format import check_rkey, check_worker_address
from transport._wire import HostId, PeerRecord, RegionRecord, decode_meta
from transport.backends._ucx_descriptors import decode_endpoint as _decode_endpoint
from transport.backends._ucx_descriptors import decode_region as _decode_region
from transport.plan._codec import RankLayout, decode_rank, decode_trainer, encode_rank, encode_trainer
from transport.weights._control import decode_front, publisher_latest
from transport.weights._layout import Layout, build_layout

INPUTS = int(os.environ.get("TRANSPORT_FUZZ_INPUTS", "1500"))
SECONDS = float(os.environ.get("TRANSPORT_FUZZ_SECONDS", "20"))
SEED = int(os.environ.get("TRANSPORT_FUZZ_SEED", "0"))
_SLOW_S = 5.0  # one input taking this long is a hang for these purposes (they take microseconds)

_EXTREMES = [b"-1", b"0", b"1", b"2147483648", b"9223372036854775808", b"-9223372036854775809",
             str(2**200).encode(), b"1e308", b"-0.5", b"true", b"null", b'"x"', b"[]", b"{}"]
_NUMBER = re.compile(rb"-?\d+")


def _mutate(rng: random.Random, data: bytes, corpus: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        op = rng.randrange(8)
        if op == 0 and b:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 2:
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randrange(1, 9))
        elif op == 3 and b:
            i = rng.randrange(len(b))
            del b[i : i + rng.randrange(1, 9)]
        elif op == 4:
            del b[rng.randrange(len(b) + 1):]
        elif op == 5:
            other = rng.choice(corpus)
            i, j = rng.randrange(len(b) + 1), rng.randrange(len(other) + 1)
            b = b[:i] + bytearray(other[j:])
        elif op == 6:
            numbers = list(_NUMBER.finditer(bytes(b)))
            if numbers:
                m = rng.choice(numbers)
                b[m.start() : m.end()] = rng.choice(_EXTREMES)
        else:
            b = bytearray(rng.randbytes(rng.randrange(0, 64)))
    return bytes(b)


def _fuzz(name: str, corpus: list[bytes], decode: Callable[[bytes], object],
          typed: tuple[type[BaseException], ...]) -> None:
    rng = random.Random(f"{SEED}:{name}")
    for valid in corpus:
        decode(valid)  # the seeds themselves decode
    n, t0 = 0, time.monotonic()
    while n < INPUTS and time.monotonic() - t0 < SECONDS:
        data = _mutate(rng, rng.choice(corpus), corpus)
        started = time.monotonic()
        try:
            decode(data)
        except typed:
            pass
        except Exception as exc:
            raise AssertionError(f"{name}: {type(exc).__name__}: {exc} for input {data[:200]!r}") from exc
        assert time.monotonic() - started < _SLOW_S, f"{name}: {data[:200]!r} took too long"
        n += 1
    print(f"fuzz {name}: {n} inputs in {time.monotonic() - t0:.1f}s (seed {SEED})")
    assert n >= min(INPUTS, 100), f"{name}: only {n} inputs in {SECONDS}s"


# --- corpora ------------------------------------------------------------------------------------


def _records() -> list[bytes]:
    regions = {"w": RegionRecord("w", "float32", (4, 4), 64, True, {"ipc": b"\x00" * 40, "tcp": b""}),
               "e": RegionRecord("e", "uint8", (0,), 0, False, {})}
    return [PeerRecord("p", "i" * 16, 7, 1234, 99, HostId("h", "boot", 4026531836), ("127.0.0.1", 5555),
                       {"ipc": b"\x01" * 24, "tcp": b""}, regions).encode(),
            PeerRecord("q", "j", 1, 1, 1, HostId("h", "b", 1), ("::1", 1), {}, {}).encode()]


def _layouts() -> list[bytes]:
    tensors = {"a": torch.zeros(3, 5), "b": torch.zeros(0), "c": torch.zeros(300),
               "d": torch.zeros(7, dtype=torch.int8)}
    return [build_layout("policy", tensors, bucket_bytes=256).encode(),
            build_layout("policy", tensors, bucket_bytes=4096, fp8=lambda n, t: n in ("a", "c")).encode()]


def _mesh() -> tuple[list[bytes], list[bytes]]:
    trainers, ranks = [], []
    for seed in range(3):
        trainer, replicas = random_case(seed)
        trainers.append(encode_trainer(trainer))
        for rep in replicas[:1]:
            for k, g in enumerate(rep.ranks):
                ranks.append(encode_rank(RankLayout(rep.id, k, len(rep.ranks), g)))
    return trainers, ranks


def _ucx_bytes() -> tuple[list[bytes], list[bytes]]:
    """Worker addresses and rkeys as libucp packs them (captured from libucp 1.22 when it is not
    installed here: address versions 1 and 2, with and without debug info, tcp and sm)."""
    from transport.backends import REGISTRY

    if REGISTRY["ucx"].unavailable_reason() is None:
        import ctypes

        from transport._native.ucx import UcxEngine, library

        engine = UcxEngine(library()[0], "fuzz", lanes=1)
        try:
            buf = ctypes.create_string_buffer(1 << 16)
            _mem, rkey = engine.mem_map(ctypes.addressof(buf), 1 << 16)
            return [engine.worker_address(0)], [rkey, b"\x00" * 9]
        finally:
            engine.close()
    return [bytes.fromhex("00ff")], [bytes.fromhex("01000000000000000000ff"), b"\x00" * 9]


def _ucx_endpoints(addresses: list[bytes], rkeys: list[bytes]) -> list[bytes]:
    out = []
    for a in addresses:
        head = struct.pack("<4sHHQiQI", b"UCXE", 2, 2, 0x7F0000001000, 5, 77, len(rkeys[0]))
        out.append(head + rkeys[0] + b"".join(struct.pack("<I", len(a)) + a for _ in range(2)))
    return out


# --- the decoders -------------------------------------------------------------------------------


def test_fuzz_peer_records():
    _fuzz("PeerRecord.decode", _records(), PeerRecord.decode, (WireError,))


def test_fuzz_weights_layouts():
    _fuzz("Layout.decode", _layouts(), Layout.decode, (WireError,))


def test_fuzz_mesh_layouts():
    trainers, ranks = _mesh()
    _fuzz("decode_trainer", trainers, decode_trainer, (MeshLayoutError, transport.TransportError))
    _fuzz("decode_rank", ranks, decode_rank, (MeshLayoutError, transport.TransportError))


def test_fuzz_frame_meta():
    corpus = [json.dumps({"op": "put", "key": "w", "offset": 0, "nbytes": 64, "dtype": "float32"}).encode(),
              json.dumps({"segs": [["w", "float32", 0, 64], ["w", "float32", 64, 64]]}).encode()]
    _fuzz("decode_meta", corpus, decode_meta, (WireError,))


def test_fuzz_ucx_descriptors():
    addresses, rkeys = _ucx_bytes()
    _fuzz("check_worker_address", addresses, check_worker_address, (WireError,))
    _fuzz("check_rkey", rkeys, check_rkey, (WireError,))
    _fuzz("ucx endpoint descriptor", _ucx_endpoints(addresses, rkeys), lambda d: _decode_endpoint(d, "p"),
          (WireError,))
    regions = [struct.pack("<4sQQ", b"UCXR", 0x7F0000002000, 1 << 16) + r for r in rkeys]
    _fuzz("ucx region descriptor", regions, lambda d: _decode_region(d, "p:w"), (WireError,))


def test_fuzz_control_words():
    """Front words and a publisher's control block as any peer may write them: decoded to a
    slot this side has, or to nothing; never an exception."""
    rng = random.Random(SEED)
    words = [0, -1, 1, 2**63 - 1, -(2**63)] + [rng.randrange(-(2**63), 2**63) for _ in range(INPUTS)]
    for w in words:
        front = decode_front(w, 2)
        assert front is None or (0 <= front[1] < 2 and front[0] >= 0)
        block = torch.tensor([w, rng.randrange(-(2**63), 2**63), w, w, 0, 0, 0, 0], dtype=torch.int64)
        assert isinstance(publisher_latest(block), int)


@pytest.mark.parametrize("name", ["PeerRecord.decode", "Layout.decode"])
def test_fuzz_is_reproducible(name):
    """The same seed gives the same inputs (a failure can be replayed)."""
    corpus = _records() if name == "PeerRecord.decode" else _layouts()
    a = [_mutate(random.Random("s"), corpus[0], corpus) for _ in range(5)]
    b = [_mutate(random.Random("s"), corpus[0], corpus) for _ in range(5)]
    assert a == b
