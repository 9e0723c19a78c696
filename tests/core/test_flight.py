"""The flight recorder (transport/_flight.py): the ring behind ``Transport.flight_record()``, the
dump files it writes (on demand, at a transfer timeout, on peer loss) and
``python -m transport flight DIR``, the reader that says which peer and which operation stalled.

Real Transports and real target processes (tests/peers/peer_target.py); the reader runs as a
real process over the dumps the recorder wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import torch

import transport
from tests._support import PYTHON, ROOT, python_env, serving_target
from transport._flight import FLIGHT_DIR_ENV, FLIGHT_FORMAT, FLIGHT_VERSION, analyze, load_dumps

BIG = 64 << 20  # enough that a put to a SIGSTOPped tcp target fills the socket buffers and stays open


def flight_cli(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "transport", "flight", str(directory)], env=python_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def dumps_in(directory: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


def transfer_records(t: transport.Transport, peer: str) -> list[dict]:
    return [r for r in t.flight_record()["records"] if r["peer"] == peer and r["op"] in ("put", "get")]


@contextlib.asynccontextmanager
async def stopped_server(t: transport.Transport, targets, file_store) -> AsyncIterator[None]:
    """A tcp target "server" with a BIG region "w", connected, then SIGSTOPped (SIGCONT on exit):
    a BIG put to it stays open."""
    target = await serving_target(t, targets, file_store, "tcp", [{"key": "w", "numel": BIG, "dtype": "uint8"}])
    await t.put(torch.zeros(4096, dtype=torch.uint8), "server", key="w")  # the connection is up
    os.kill(target.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(target.proc.pid, signal.SIGCONT)


def states(record: dict) -> list[str]:
    return [state for state, _ in record["transitions"]]


# -- the ring ----------------------------------------------------------------------------------


async def test_completed_transfers_and_signals_are_recorded_whole(memory_store):
    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=20) as a, \
            transport.Transport("b", store=memory_store, backends=("tcp",), timeout=20) as b:
        dst = torch.zeros(BIG, dtype=torch.uint8)
        b.register("w", dst)
        await a.peer("b", regions=["w"])
        small = torch.full((4096,), 3, dtype=torch.uint8)
        big = torch.randint(0, 256, (BIG,), dtype=torch.uint8)
        await a.put(small, "b", key="w")  # small: may complete inside put()
        await a.put(big, "b", key="w")
        back = torch.empty(4096, dtype=torch.uint8)
        await a.get(back, "b", key="w", offset=100)
        await a.signal("b", "step", 7)
        assert torch.equal(dst, big) and torch.equal(back, big[100:4196])

        ops = transfer_records(a, "b")
        assert [(r["op"], r["key"], r["nbytes"]) for r in ops] == [("put", "w", 4096), ("put", "w", BIG),
                                                                    ("get", "w", 4096)]
        for r in ops:
            assert r["state"] == "done" and r["backend"] == "tcp", r
            assert r["error"] is None and r["error_type"] is None
            assert states(r)[0] == "started" and states(r)[-1] == "done" and "moving" in states(r), r
            times = [when for _, when in r["transitions"]]
            assert times == sorted(times) and r["started"] <= times[0] + 1e-6
        [sig] = [r for r in a.flight_record()["records"] if r["op"] == "signal"]
        assert (sig["peer"], sig["key"], sig["state"], sig["backend"]) == ("b", "step", "done", "control")
        seqs = [r["seq"] for r in a.flight_record()["records"]]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert not [r for r in b.flight_record()["records"] if r["op"] in ("put", "get")]  # one-sided


async def test_the_ring_keeps_the_newest_records_and_counts_the_dropped(memory_store):
    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=20, flight_capacity=8) as a, \
            transport.Transport("b", store=memory_store, backends=("tcp",), timeout=20) as b:
        b.register("w", torch.zeros(64, dtype=torch.uint8))
        await a.peer("b", regions=["w"])
        for i in range(20):
            await a.put(torch.full((64,), i, dtype=torch.uint8), "b", key="w")
        record = a.flight_record()
        assert record["capacity"] == 8
        assert len(record["records"]) == 8 and record["dropped"] == 12
        seqs = [r["seq"] for r in record["records"]]
        assert seqs == list(range(seqs[0], seqs[0] + 8)), "the ring must keep the newest, in order"
        assert all(r["state"] == "done" for r in record["records"])


# -- dumps ---------------------------------------------------------------------------------------


async def test_a_dump_is_the_versioned_ring_of_one_incarnation(tmp_path, memory_store):
    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=20) as plain:
        assert plain.dump_flight_record("nowhere to write") is None  # no flight_dir, no env
    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=20,
                                   flight_dir=tmp_path / "flight") as a, \
            transport.Transport("b", store=memory_store, backends=("tcp",), timeout=20) as b:
        b.register("w", torch.zeros(16, dtype=torch.uint8))
        await a.peer("b", regions=["w"])
        await a.put(torch.ones(16, dtype=torch.uint8), "b", key="w")
        path = Path(a.dump_flight_record("on purpose"))
        assert path.parent == tmp_path / "flight"
        assert path.name.startswith(f"a-{a.incarnation}-{os.getpid()}-") and path.suffix == ".json"
        assert not list(path.parent.glob("*.tmp")), "a dump is written atomically"
        doc = json.loads(path.read_text())
        assert (doc["format"], doc["v"]) == (FLIGHT_FORMAT, FLIGHT_VERSION)
        assert (doc["name"], doc["incarnation"], doc["pid"], doc["reason"]) == ("a", a.incarnation, os.getpid(),
                                                                               "on purpose")
        assert doc["records"] == a.flight_record()["records"] and doc["dropped"] == 0
        second = Path(a.dump_flight_record("again"))
        assert second != path
        [newest] = load_dumps([path, second])  # one per (name, incarnation): the newest
        assert newest["reason"] == "again"


async def test_the_environment_names_the_dump_directory(tmp_path, memory_store, monkeypatch):
    monkeypatch.setenv(FLIGHT_DIR_ENV, str(tmp_path / "env"))
    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=20) as a:
        path = a.dump_flight_record("via the environment")
    assert path is not None and Path(path).parent == tmp_path / "env"


async def test_a_timed_out_put_is_stalled_while_open_then_aborted_and_dumped(targets, file_store, tmp_path):
    flight = tmp_path / "flight"
    async with transport.Transport("init", store=file_store, backends=("tcp",), timeout=30, flight_dir=flight) as t:
        async with stopped_server(t, targets, file_store):
            stuck = t.put(torch.ones(BIG, dtype=torch.uint8), "server", key="w", timeout=4)
            await anyio.sleep(1.5)  # past STALL_S: open this long is "stalled"
            while_open = Path(t.dump_flight_record("while stuck"))
            with pytest.raises(transport.TransferTimeoutError):
                await stuck

        [open_] = [r for r in load_dumps([while_open])[0]["records"] if r["nbytes"] == BIG]
        assert open_["state"] in ("started", "moving") and open_["error"] is None
        report = analyze(load_dumps([while_open]))
        assert "init -> server: STALLED" in report and f"{BIG} B via" in report, report

        [ended] = [r for r in transfer_records(t, "server") if r["nbytes"] == BIG]
        assert ended["state"] == "aborted" and ended["error_type"] == "TransferTimeoutError", ended
        assert states(ended)[0] == "started" and states(ended)[-1] == "aborted"
    timeouts = [d for d in dumps_in(flight) if d["reason"].startswith("timeout:")]
    assert timeouts, f"no dump at the timeout: {[d['reason'] for d in dumps_in(flight)]}"
    run = flight_cli(flight)
    assert run.returncode == 0, run.stderr
    assert "init -> server: ERRORS" in run.stdout and "TransferTimeoutError" in run.stdout, run.stdout


async def test_a_peer_loss_is_dumped_by_itself_and_read_back_by_the_cli(targets, file_store, tmp_path):
    flight = tmp_path / "flight"
    async with transport.Transport("init", store=file_store, backends=("tcp",), timeout=20, flight_dir=flight) as t:
        target = await serving_target(t, targets, file_store, "tcp", [{"key": "w", "numel": 1 << 20, "dtype": "uint8"}])
        await t.put(torch.ones(1 << 20, dtype=torch.uint8), "server", key="w")
        incarnation = (await t.peer("server")).incarnation
        target.proc.kill()
        target.proc.wait(timeout=30)
        with pytest.raises(transport.PeerLostError):
            await t.put(torch.ones(1 << 20, dtype=torch.uint8), "server", key="w")
        with anyio.fail_after(10):  # written by the recorder itself, nobody asked for it
            while not [d for d in dumps_in(flight) if d["reason"].startswith("peer lost")]:
                await anyio.sleep(0.05)
        [lost] = [d for d in dumps_in(flight) if d["reason"].startswith("peer lost")]
        assert "server" in lost["reason"]
        assert any(e["event"] == "peer-lost" and e["peer"] == "server" and incarnation in e["detail"]
                   for e in lost["events"]), lost["events"]
        first = next(r for r in lost["records"] if r["peer"] == "server" and r["op"] == "put")
        assert first["state"] == "done"
    # The loss is dumped before the put it failed has settled (that put's record may still be
    # in flight there); closing dumps again when a record changed since, so the newest dump
    # shows how the put ended.
    [newest] = load_dumps(sorted(flight.glob("*.json")))
    rest = [r for r in newest["records"] if r["peer"] == "server" and r["op"] == "put" and r["seq"] != first["seq"]]
    failed = [r for r in rest if r["state"] == "failed"]
    assert failed and failed[-1]["error_type"] == "PeerLostError", rest

    run = flight_cli(flight)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "1 dump(s): init (pid" in out and newest["reason"] in out, out
    assert f"event  init: peer-lost server: incarnation {incarnation}" in out, out
    assert "init -> server: ERRORS" in out and "PeerLostError" in out, out
    assert f"last completed: #{first['seq']} put 'w' {1 << 20} B via tcp" in out, out


async def test_the_last_dump_shows_how_what_a_loss_caught_in_flight_ended(targets, file_store, tmp_path):
    """A dump at a peer's loss is written before the transfers it aborts have settled (it once
    made a test read the loss without the aborted put's error); closing dumps again, so the
    newest dump of the process shows how each ended."""
    flight = tmp_path / "flight"
    async with transport.Transport("init", store=file_store, backends=("tcp",), timeout=30, flight_dir=flight) as t:
        async with stopped_server(t, targets, file_store):
            stuck = t.put(torch.ones(BIG, dtype=torch.uint8), "server", key="w", timeout=30)
            t.exclude("server")  # dumps right here, the put still in flight
            with pytest.raises(transport.TransferAbortedError):
                await stuck
        [excluded] = [d for d in dumps_in(flight) if d["reason"].startswith("excluded")]
        [caught] = [r for r in excluded["records"] if r["nbytes"] == BIG]
        assert caught["state"] in ("started", "moving") and caught["error"] is None, caught
    [newest] = load_dumps(sorted(flight.glob("*.json")))
    assert newest["reason"] == "closing"
    [ended] = [r for r in newest["records"] if r["nbytes"] == BIG]
    assert ended["state"] == "aborted" and ended["error_type"] == "TransferAbortedError", ended


def test_a_process_that_never_dumped_does_not_dump_at_close(tmp_path):
    from transport._flight import FlightRecorder

    rec = FlightRecorder("quiet", "i0", dump_dir=tmp_path)
    rec.completed("put", "p", "k", 8, "ipc", 0.0)
    assert rec.dump_if_changed("closing") is None and not list(tmp_path.iterdir())
    assert rec.dump("asked") is not None
    assert rec.dump_if_changed("closing") is None  # nothing changed since
    rec.event("peer-lost", "p", "gone")
    assert rec.dump_if_changed("closing") is not None


# -- the reader ----------------------------------------------------------------------------------


def test_flight_cli_skips_malformed_dumps(tmp_path):
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "nested.json").write_text("[" * 100000)
    (tmp_path / "wrong.json").write_text(json.dumps({"format": "transport.flight", "v": 1, "name": 3}))
    (tmp_path / "records.json").write_text(json.dumps({
        "format": "transport.flight", "v": 1, "name": "x", "incarnation": "i", "pid": 1, "reason": "r",
        "dropped": 0, "time": 1.0, "records": [{"seq": "one"}]}))
    run = flight_cli(tmp_path)
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    assert run.stderr.count("skipped") == 4, run.stderr
    assert "records" in run.stderr or "record field" in run.stderr


async def test_flight_cli_reads_good_dumps_beside_bad_ones(tmp_path, memory_store):
    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=10,
                                   flight_dir=tmp_path) as a:
        assert a.dump_flight_record("test") is not None
    (tmp_path / "garbage.json").write_text("[1, 2")
    run = flight_cli(tmp_path)
    assert run.returncode == 0, run.stderr
    assert "1 dump(s)" in run.stdout and "skipped" in run.stderr


def test_flight_cli_says_when_there_is_nothing_to_read(tmp_path):
    run = flight_cli(tmp_path)
    assert run.returncode == 1 and "no flight-recorder dumps" in run.stderr, run
