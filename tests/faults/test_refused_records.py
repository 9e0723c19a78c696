"""Waiting for a peer whose record is refused ends with the reason, not with the timeout.

A record that does not decode (garbage, a newer format version, a region whose size does not fit
its shape), that names another peer, or that is too large to be read is what the store holds:
records are written whole, so reading it again gives the same. ``t.peer()`` reads it again for a
moment (a restart may replace a leftover record) and then raises PeerNotFoundError naming why,
as it raises AuthenticationError for a record that fails authentication. Before, it waited for
its whole timeout. The waiter is a real process (tests/peers/record_waiter.py) whose timeout is
an hour; the records are planted in its file store by this process, as a bystander could.
"""

from __future__ import annotations

import json
import sys

import anyio
import pytest

from tests._support import ROOT, python_env
from transport._rendezvous import FileStore
from transport._wire import HostId, PeerRecord, RegionRecord

HOUR = 3600.0


def _record(name: str, **region: object) -> bytes:
    w = {"key": "w", "dtype": "float32", "shape": (4,), "nbytes": 16, "writable": True, **region}
    return PeerRecord(name=name, incarnation="i" * 16, seq=1, pid=1, pid_start=1, host=HostId("h", "b", 1),
                      agent=("127.0.0.1", 1), backends={}, regions={"w": RegionRecord(**w)}).encode()  # type: ignore[arg-type]


def _future(name: str) -> bytes:
    doc = json.loads(_record(name))
    doc["v"] = 99
    return json.dumps(doc).encode()


BAD = {  # name -> (what the store holds under it, what the error must say, its cause)
    "garbage": (lambda name: b"\xff\xfe not a record", "not valid JSON", "WireError"),
    "future": (_future, "version 99 is not supported", "WireError"),
    "lying": (lambda name: _record(name, nbytes=1 << 40), "1099511627776 bytes for shape (4,)", "WireError"),
    "misplaced": (lambda name: _record("someone-else"), "names 'someone-else', not 'misplaced'", "WireError"),
    "huge": (None, "too large", "RecordTooLargeError"),
}


async def _wait_in_a_process(store: str, names: list[str], token: str | None = None) -> dict[str, dict]:
    spec = {"store": store, "names": names, "timeout": HOUR, "token": token}
    with anyio.fail_after(120):  # (a hang guard: the waiter's own timeout is an hour)
        done = await anyio.run_process([sys.executable, "-m", "tests.peers.record_waiter", json.dumps(spec)],
                                       cwd=ROOT, env=python_env(), check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(done.stdout.decode().splitlines()[-1])


async def test_waiting_for_a_malformed_record_ends_with_why(tmp_path):
    store_dir = tmp_path / "store"
    store = FileStore(store_dir)
    for name, (make, _, _) in BAD.items():
        if make is not None:
            store.set(f"peer/{name}", make(name))
    store.set("peer/huge", b"{}")
    path = next(p for p in store_dir.iterdir() if "huge" in p.name)
    with open(path, "r+b") as f:
        f.truncate(17 << 20)  # past what any record is read (sparse: it costs no disk)

    outcomes = await _wait_in_a_process(f"file://{store_dir}", list(BAD))
    for name, (_, says, cause) in BAD.items():
        got = outcomes[name]
        print(f"{name}: {got['outcome']} after {got['seconds']:.2f}s")
        assert got["outcome"] == "PeerNotFoundError", got
        assert "rejected" in got["message"] and says in got["message"], got
        assert got["cause"] == cause, got


@pytest.mark.parametrize("token", ["s3cret"])
async def test_an_unsigned_record_ends_the_wait_as_before(tmp_path, token):
    store_dir = tmp_path / "store"
    FileStore(store_dir).set("peer/unsigned", _record("unsigned"))
    got = (await _wait_in_a_process(f"file://{store_dir}", ["unsigned"], token))["unsigned"]
    print(f"unsigned: {got['outcome']} after {got['seconds']:.2f}s")
    assert got["outcome"] == "AuthenticationError" and "not signed" in got["message"], got

