"""Faults with real processes: dead, stopped, restarted, excluded and unauthenticated peers,
corrupt control messages and records. Each asserts the typed error within the timeout, that
other peers are unaffected, and what the flight recorder says."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time

import anyio
import pytest
import torch

import transport
from tests._support import PYTHON, put_to_fake_agent, python_env, sha
from transport._flight import analyze, load_dumps
from transport._liveness import Heartbeat
from transport._rendezvous import FileStore, open_store

N = 64 << 20


def spec(name: str, store: str, backends: list[str], numel: int = N, mode: str = "serve") -> dict:
    return {"name": name, "store": store, "backends": backends, "initiator": "init", "mode": mode,
            "regions": [{"key": "w", "dtype": "uint8", "numel": numel}]}


def flight_report(directory) -> str:
    dumps = load_dumps(sorted(directory.glob("*.json")))
    assert dumps, f"no flight-recorder dump in {directory}"
    return analyze(dumps)


@pytest.mark.parametrize("backend", ["ipc", "tcp"])
async def test_kill_9_during_a_256mib_put_loop(targets, file_store, tmp_path, backend):
    flight = tmp_path / "flight"
    n = 256 << 20
    async with transport.Transport("init", store=file_store, backends=(backend,), timeout=20, flight_dir=flight) as t:
        victim = targets(spec("victim", file_store, [backend], n))
        other = targets(spec("other", file_store, [backend], n))
        for _ in range(2):
            await t.wait_signal("ready", timeout=60)
        await t.peer("victim", regions=["w"])
        await t.peer("other", regions=["w"])
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        errors: list[BaseException] = []

        async def loop() -> None:
            for _ in range(50):
                try:
                    await t.put(src, "victim", key="w")
                except transport.TransportError as exc:
                    errors.append(exc)
                    return

        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(loop)
            await anyio.sleep(0.3)
            victim.proc.send_signal(signal.SIGKILL)
            # The other peer keeps receiving meanwhile, completely and correctly.
            for _ in range(3):
                await t.put(src, "other", key="w")
        assert time.monotonic() - t0 < 20
        assert len(errors) == 1 and isinstance(errors[0], transport.PeerLostError), errors
        assert "victim" in str(errors[0])
        back = torch.empty_like(src)
        await t.get(back, "other", key="w")
        assert torch.equal(back, src)
        await t.signal("other", "done", 1)
        assert (await other.result())["sha256"]["w"] == sha(src)
        assert t.dump_flight_record("test end") is not None
    report = flight_report(flight)
    assert "peer-lost victim" in report and "init -> victim: ERRORS" in report and "PeerLostError" in report
    assert "init -> other: ok" in report


async def test_sigstop_straggler_over_tcp_times_out_others_continue(targets, file_store, tmp_path):
    flight = tmp_path / "flight"
    async with transport.Transport("init", store=file_store, backends=("tcp",), timeout=30, flight_dir=flight) as t:
        ps = {n: targets(spec(n, file_store, ["tcp"])) for n in ("t0", "t1", "t2")}
        for _ in ps:
            await t.wait_signal("ready", timeout=60)
        for n in ps:
            await t.peer(n, regions=["w"])
        src = torch.randint(0, 256, (N,), dtype=torch.uint8)
        os.kill(ps["t1"].proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            stuck = t.put(src, "t1", key="w", timeout=2.0)
            for _ in range(3):  # the others keep receiving while t1 is stopped
                await transport.gather(t.put(src, "t0", key="w"), t.put(src, "t2", key="w"))
            with pytest.raises(transport.TransferTimeoutError, match="t1"):
                await stuck
            assert time.monotonic() - t0 < 15
            report = flight_report(flight)  # dumped at the timeout, while t1 is still stopped
        finally:
            os.kill(ps["t1"].proc.pid, signal.SIGCONT)
        assert "init -> t1" in report and "TransferTimeoutError" in report
        assert "init -> t0: ok" in report and "init -> t2: ok" in report
        for n in ("t0", "t2"):
            await t.signal(n, "done", 1)
            assert (await ps[n].result())["sha256"]["w"] == sha(src)


async def test_restarted_target_is_resumed_with_its_new_incarnation(targets, file_store, tmp_path):
    flight = tmp_path / "flight"
    async with transport.Transport("init", store=file_store, backends=("ipc", "tcp"), timeout=20,
                                   flight_dir=flight) as t:
        first = targets(spec("gen", file_store, ["ipc", "tcp"], 1 << 20))
        await t.wait_signal("ready", at_least=first.proc.pid, timeout=60)
        old = await t.peer("gen", regions=["w"])
        await t.put(torch.ones(1 << 20, dtype=torch.uint8), "gen", key="w")
        first.proc.kill()
        first.proc.wait(timeout=30)
        with pytest.raises(transport.PeerLostError):
            await t.put(torch.ones(1 << 20, dtype=torch.uint8), "gen", key="w")
        second = targets(spec("gen", file_store, ["ipc", "tcp"], 1 << 20))
        new = await t.peer("gen", regions=["w"], timeout=60)  # waits for the replacement
        assert new.incarnation != old.incarnation
        await t.wait_signal("ready", at_least=second.proc.pid, timeout=60)
        src = torch.full((1 << 20,), 7, dtype=torch.uint8)
        await t.put(src, "gen", key="w")
        await t.signal("gen", "done", 1)
        assert (await second.result())["sha256"]["w"] == sha(src)
    report = flight_report(flight)
    assert f"peer-lost gen: incarnation {old.incarnation}" in report and "PeerLostError" in report


async def test_heartbeat_lease_declares_a_stopped_remote_peer_lost(tmp_path, file_store):
    """A peer in another PID namespace counts as another host: no pid check, only heartbeats.
    SIGSTOP freezes its heartbeat thread; after the lease it is lost and operations fail fast."""
    flight = tmp_path / "flight"
    async with transport.Transport("init", store=file_store, backends=("tcp",), timeout=30, heartbeat=0.2, lease=1.5,
                                   flight_dir=flight) as t:
        child = subprocess.Popen(
            ["unshare", "--pid", "--fork", PYTHON, "-m", "tests.peers.peer_target",
             json.dumps({**spec("remote", file_store, ["tcp"], 1024), "out": str(tmp_path / "remote.json")})],
            env=python_env(), start_new_session=True,
        )
        try:
            await t.wait_signal("ready", timeout=60)
            peer = await t.peer("remote", regions=["w"])
            assert peer._record.host != t._directory.me.host  # really treated as remote
            await t.put(torch.ones(1024, dtype=torch.uint8), "remote", key="w")
            os.killpg(child.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with anyio.fail_after(15):
                while True:  # transfers started before the lease expires are aborted with it
                    try:
                        await t.put(torch.ones(1024, dtype=torch.uint8), "remote", key="w", timeout=10)
                    except transport.PeerLostError as exc:
                        assert "heartbeat" in str(exc)
                        break
                    await anyio.sleep(0.05)
            assert time.monotonic() - t0 < 10
            with pytest.raises(transport.PeerLostError, match="lost"):
                await t.put(torch.ones(1024, dtype=torch.uint8), "remote", key="w")
        finally:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
    assert "no heartbeat from remote" in flight_report(flight)


async def test_exclude_aborts_in_flight_and_refuses_later(targets, file_store):
    async with transport.Transport("init", store=file_store, backends=("tcp",), timeout=30) as t:
        slow = targets(spec("slow", file_store, ["tcp"]))
        fine = targets(spec("fine", file_store, ["tcp"]))
        for _ in range(2):
            await t.wait_signal("ready", timeout=60)
        await t.peer("slow", regions=["w"])
        await t.peer("fine", regions=["w"])
        os.kill(slow.proc.pid, signal.SIGSTOP)
        try:
            src = torch.randint(0, 256, (N,), dtype=torch.uint8)
            h = t.put(src, "slow", key="w")
            await anyio.sleep(0.2)
            t.exclude("slow")
            with pytest.raises(transport.TransferAbortedError, match="excluded"):
                await h
            with pytest.raises(transport.PeerLostError, match="excluded"):
                await t.put(src, "slow", key="w")
            await t.put(src, "fine", key="w")
            await t.signal("fine", "done", 1)
            assert (await fine.result())["sha256"]["w"] == sha(src)
        finally:
            os.kill(slow.proc.pid, signal.SIGCONT)
        with pytest.raises(transport.PeerNotFoundError):
            t.exclude("never-seen")


async def test_token_protects_records_and_connections(memory_store):
    async with transport.Transport("a", store=memory_store, backends=("tcp",), token="s3cret") as a, \
            transport.Transport("b", store=memory_store, backends=("tcp",), token="s3cret") as b, \
            transport.Transport("wrong", store=memory_store, backends=("tcp",), token="guess") as wrong, \
            transport.Transport("none", store=memory_store, backends=("tcp",)) as none:
        w = torch.zeros(16)
        a.register("w", w)
        await b.peer("a", regions=["w"])
        await b.put(torch.ones(16), "a", key="w")  # same token: fine
        assert w.sum() == 16
        # A record signed with another token is ignored, and said so.
        with pytest.raises(transport.AuthenticationError, match="another token"):
            await wrong.peer("a", timeout=0.3)
        # Without a token one can read the record, but the agent refuses the connection.
        await none.peer("a", regions=["w"])
        with pytest.raises(transport.AuthenticationError, match="token"):
            await none.put(torch.full((16,), 5.0), "a", key="w")
        assert w.sum() == 16  # nothing written
        # And a token holder does not trust an unsigned record.
        with pytest.raises(transport.AuthenticationError, match="not signed"):
            await a.peer("none", timeout=0.3)
        dump = json.dumps(a.flight_record())
        assert "s3cret" not in dump


async def test_corrupt_control_messages_do_not_hurt_the_agent(pair):
    a, b = pair
    dst = torch.zeros(1024)
    b.register("w", dst)
    await a.peer("b", regions=["w"])
    host, port = b._agent.address
    garbage = [b"\x00" * 64, b"TXP1" + os.urandom(200), b"GET / HTTP/1.1\r\n\r\n", b"TXP1\x01"]

    def send_garbage(g: bytes) -> None:  # in a thread: the agent runs on this test's event loop
        with socket.create_connection((host, port), timeout=10) as s:
            try:
                s.sendall(g)
                s.shutdown(socket.SHUT_WR)
                while s.recv(4096):  # until the agent closes the connection
                    pass
            except OSError:
                pass  # it may reset the connection instead

    for g in garbage:
        with anyio.fail_after(20):
            await anyio.to_thread.run_sync(send_garbage, g)
    await a.put(torch.ones(1024), "b", key="w")  # still serving
    assert dst.sum() == 1024


async def test_a_garbled_agent_reply_is_a_peer_lost_error(memory_store, tmp_path):
    """A fake agent that answers HELLO with junk: the initiator gets PeerLostError, no hang."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    port = lsock.getsockname()[1]

    def serve() -> None:
        conn, _ = lsock.accept()
        conn.recv(65536)
        conn.sendall(b"TXP1\x10" + b"\xff" * 40)
        time.sleep(1)
        conn.close()

    async with transport.Transport("a", store=memory_store, backends=("tcp",), timeout=10, flight_dir=tmp_path) as a, \
            transport.Transport("b", store=memory_store, backends=("tcp",), timeout=10) as b:
        b.register("w", torch.zeros(4))
        await put_to_fake_agent(a, b, port, serve, timeout=10)
    lsock.close()
    report = flight_report(tmp_path)
    assert "peer-lost b" in report and "a -> b: ERRORS" in report


@pytest.mark.parametrize(
    "junk", [b"", b"{}", b"\xff\xfe", b'{"format":"transport.peer","v":1}', b'{"format":"transport.peer","v":99}']
)
async def test_corrupt_or_truncated_records_are_typed_errors(memory_store, junk):
    async with transport.Transport("a", store=memory_store, timeout=5) as a:
        open_store(memory_store).set("peer/bad", junk)
        with pytest.raises(transport.PeerNotFoundError, match="rejected"):
            await a.peer("bad", timeout=0.2)
        with pytest.raises(transport.TransportError):
            await a.put(torch.ones(4), "bad", key="w")


def test_heartbeat_reports_a_failing_store_once_and_its_recovery(tmp_path, caplog):
    """A store that stops answering gives one warning (not one per interval) and one recovery line."""
    store_dir = tmp_path / "parent" / "store"
    hb = Heartbeat(FileStore(store_dir), "p", "inc", 0.02)
    caplog.set_level(logging.DEBUG, logger="transport._liveness")
    hb.start()
    try:
        # The store's parent is gone (atomically): every beat fails (a deleted store directory
        # alone would be recreated by the next write).
        (tmp_path / "parent").rename(tmp_path / "away")
        time.sleep(0.3)
        (tmp_path / "away").rename(tmp_path / "parent")  # and back
        deadline = time.monotonic() + 10
        while not any("answers again" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        hb.stop()
    records = [r for r in caplog.records if r.name == "transport._liveness"]
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot write" in warnings[0].getMessage(), [r.getMessage() for r in records]
    assert sum(r.levelno == logging.DEBUG and "still failing" in r.getMessage() for r in records) >= 3
    assert sum("answers again" in r.getMessage() for r in records) == 1
