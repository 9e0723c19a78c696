"""What stalled, idle, name-flooding and departing peers cost a real target process.

``python -m tests.peers.resource_probe [SCENARIO|all] [--n N]`` prints one JSON line per scenario:
the target's resident memory (``VmRSS``, and ``RssShmem`` for shared mappings) before and after,
read from ``/proc/<pid>/status`` from outside the target, plus what the scenario saw.
``tests/faults/test_resource_bounds.py`` and ``tests/faults/test_announced_sizes.py`` run the same
scenarios at smaller counts and assert the growth is bounded. Everything is real: target processes
(tests/peers/hostile_target.py, tests/peers/churn_peer.py), real sockets speaking the agent's wire
format, a file store.

Scenarios (each against a fresh target; no token, as any local process could do it, except ``idle``):

* ``stalled``: N connections say HELLO, then start a PUT to an unknown key announcing 64 MiB of
  payload, send 1 KiB of it and stall (the agent refuses the put and drains the payload);
* ``meta``: N connections say HELLO, then announce a frame with 1 MiB - 1 of metadata and stall;
* ``signals``: one connection sets N signals with distinct 16 KiB names;
* ``departed``: N peers in one long-lived process each open a Transport with a 256 KiB region,
  take one ipc put from the target, and close cleanly (their process lives on);
* ``runs``: N connections say HELLO, then start a PUTR announcing 65,536 runs (a 1 MiB run
  table), send 16 bytes of the table and stall;
* ``tables``: N connections send a whole PUTR run table of 65,536 one-byte runs (1 MiB, every run
  valid, not staged), then stall before the data;
* ``replies``: N connections (4 KiB receive buffers) ask a target whose socket buffers are the
  Linux default size for a staged GETR of 4 MiB (64 runs of 64 KiB over the region) and never
  read the reply;
* ``idle``: a target with a token and its cap of connections lowered to N; N connections say a
  valid HELLO (one name each) and stay idle, then a legitimate Transport puts and gets 64 KiB
  (its latency, from its first look-up, is in the line).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import torch

import transport
from transport._auth import Authenticator
from transport._channel import hello
from transport._wire import FRAME_HEADER, FRAME_MAGIC, FrameKind, encode_frame
from transport.backends.tcp._frames import RUN_ROW, TcpFrame

ROOT = Path(__file__).resolve().parents[2]
STALL_PAYLOAD = 64 << 20
META_ANNOUNCED = (1 << 20) - 1
SIGNAL_NAME_BYTES = 16 << 10
REGION_BYTES = 256 << 10
TARGET_NUMEL = 1 << 16  # the target's region "w" (uint8)
RUNS_ANNOUNCED = 65536  # the most one PUTR / GETR frame may carry
REPLY_RUN = 64 << 10
REPLY_RUNS = 64  # a staged GETR of 4 MiB, the most one frame may ask for
TOKEN = "probe-token"
SMALL_SOCK_BUF = 212_992  # Linux's default net.core.wmem_max / rmem_max: what the agent's 4 MiB request gets there


def memory_of(pid: int) -> dict[str, float]:
    """``VmRSS`` and ``RssShmem`` of process ``pid``, in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssShmem"):
            out[key] = int(value.split()[0]) / 1024
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _wait_file(path: Path, proc: subprocess.Popen, log: Path, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[2:4]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:g}s")
        time.sleep(0.05)
    return json.loads(path.read_text())


class Target:
    """A running tests/peers/hostile_target.py (a Transport serving region ``w`` over tcp)."""

    def __init__(self, tmp: Path, store: str, env: dict[str, str] | None = None, token: str | None = None,
                 sock_buf: int | None = None, nofile_headroom: int | None = None) -> None:
        self.name = f"target-{uuid.uuid4().hex[:6]}"
        self.out = tmp / f"{self.name}.json"
        self.log = tmp / f"{self.name}.log"
        self.token = token
        spec = {"name": self.name, "store": store, "backends": ["tcp"], "numel": TARGET_NUMEL, "out": str(self.out),
                "env": env or {}, "token": token, **({"sock_buf": sock_buf} if sock_buf else {}),
                **({"nofile_headroom": nofile_headroom} if nofile_headroom is not None else {})}
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.peers.hostile_target", json.dumps(spec)],
                                         env=_env(), cwd=ROOT, stderr=err)
        self.pid = _wait_file(Path(str(self.out) + ".ready"), self.proc, self.log, 90)["pid"]
        self.store = store

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


async def agent_of(store: str, name: str, token: str | None = None) -> tuple[tuple[str, int], str]:
    """A peer's agent address and incarnation, from its published record."""
    async with transport.Transport(f"scout-{uuid.uuid4().hex[:8]}", store=store, backends=("tcp",), timeout=30,
                                   token=token) as t:
        peer = await t.peer(name, regions=["w"])
        return tuple(peer._record.agent), peer.incarnation  # type: ignore[return-value]


def hello_frame(to: str, incarnation: str, who: str = "intruder", token: str | None = None,
                lane: str = "control") -> bytes:
    """A HELLO from ``who`` to ``to`` (valid for ``token``), asking for ``lane``."""
    meta = {**hello(who, "0" * 16, lane), "to": to, "to_incarnation": incarnation}
    meta.update(Authenticator(token).hello_fields(who, "0" * 16, to, incarnation) if token else {})
    return encode_frame(FrameKind.HELLO, 1, meta, 0)


def greeted(addr: tuple[str, int], to: str, incarnation: str, who: str = "intruder",
            token: str | None = None, lane: str = "control") -> socket.socket:
    """A connection that said HELLO (valid for ``token``, asking for ``lane``) and read the
    agent's OK (raises ConnectionError if it was refused)."""
    s = socket.create_connection(addr, timeout=10)
    s.sendall(hello_frame(to, incarnation, who, token, lane))
    head = s.recv(FRAME_HEADER.size, socket.MSG_WAITALL)
    _, kind, _, _, _, meta_len, plen = FRAME_HEADER.unpack(head)
    s.recv(meta_len + plen, socket.MSG_WAITALL)
    if kind != FrameKind.OK:
        s.close()
        raise ConnectionError(f"HELLO refused ({FrameKind(kind).name})")
    return s


def grew(doc: dict[str, Any]) -> float:
    """How much a scenario's target grew (``VmRSS``, MiB)."""
    return doc["after"]["VmRSS"] - doc["before"]["VmRSS"]


def _settle(pid: int, seconds: float = 1.0) -> dict[str, float]:
    time.sleep(seconds)
    return memory_of(pid)


def _stall(scenario: str, first: bytes, addr: tuple[str, int], to: str, incarnation: str, n: int,
           pid: int, rcvbuf: int = 0) -> dict[str, Any]:
    """``n`` connections (one name each: past the cap per peer) say HELLO, send ``first`` and
    stall (with ``rcvbuf``, a receive buffer that small, set before the HELLO's reply is read);
    the target's memory before and with them open, and the bytes they sent."""
    before = _settle(pid)
    socks, refused = [], 0
    for i in range(n):
        try:
            s = greeted(addr, to, incarnation, f"intruder-{i}")
            if rcvbuf:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            s.sendall(first)
            socks.append(s)
        except OSError:
            refused += 1
    after = _settle(pid, 2.0)
    for s in socks:
        s.close()
    sent = n * (len(hello_frame(to, incarnation, "intruder-0000")) + len(first))
    return {"scenario": scenario, "connections": n, "refused": refused, "sent_mib": sent / (1 << 20),
            "before": before, "after": after}


def stalled(addr: tuple[str, int], to: str, incarnation: str, n: int, pid: int) -> dict[str, Any]:
    meta = {"key": "no-such-key", "dtype": "uint8", "offset": 0, "nbytes": STALL_PAYLOAD}
    first = encode_frame(TcpFrame.PUT, 2, meta, STALL_PAYLOAD) + bytes(1024)
    return _stall("stalled", first, addr, to, incarnation, n, pid)


def meta_stall(addr: tuple[str, int], to: str, incarnation: str, n: int, pid: int) -> dict[str, Any]:
    first = FRAME_HEADER.pack(FRAME_MAGIC, FrameKind.SIGNAL, 0, 0, 2, META_ANNOUNCED, 0) + b'{"name": "'
    return _stall("meta", first, addr, to, incarnation, n, pid)


def _runs_frame(kind: FrameKind, runs: int, payload: int, staged: bool = False) -> bytes:
    return encode_frame(kind, 2, {"groups": [["w", "uint8", runs]], "staged": staged}, payload)


def runs_stall(addr: tuple[str, int], to: str, incarnation: str, n: int, pid: int) -> dict[str, Any]:
    """PUTR frames announcing the most runs a frame may carry, 16 bytes of their table sent."""
    first = _runs_frame(TcpFrame.PUTR, RUNS_ANNOUNCED, RUNS_ANNOUNCED * (RUN_ROW + 1)) + bytes(16)
    return _stall("runs", first, addr, to, incarnation, n, pid)


def tables_stall(addr: tuple[str, int], to: str, incarnation: str, n: int, pid: int) -> dict[str, Any]:
    """Whole run tables of one-byte runs (each valid: the agent checks them and waits for data)."""
    import numpy as np

    rows = np.zeros((RUNS_ANNOUNCED, 2), dtype="<i8")
    rows[:, 0] = np.arange(RUNS_ANNOUNCED) % TARGET_NUMEL
    rows[:, 1] = 1
    first = _runs_frame(TcpFrame.PUTR, RUNS_ANNOUNCED, RUNS_ANNOUNCED * (RUN_ROW + 1)) + rows.tobytes()
    return _stall("tables", first, addr, to, incarnation, n, pid)


def replies_stall(addr: tuple[str, int], to: str, incarnation: str, n: int, pid: int) -> dict[str, Any]:
    """Staged GETRs of 4 MiB whose replies are never read (4 KiB receive buffers)."""
    rows = [(i * 1024 % (TARGET_NUMEL - REPLY_RUN + 1), REPLY_RUN) for i in range(REPLY_RUNS)]
    table = b"".join(o.to_bytes(8, "little") + k.to_bytes(8, "little") for o, k in rows)
    first = _runs_frame(TcpFrame.GETR, REPLY_RUNS, len(table), staged=True) + table
    return _stall("replies", first, addr, to, incarnation, n, pid, rcvbuf=4096)


async def legit_put_timed(store: str, name: str, token: str | None) -> dict[str, float]:
    """A fresh Transport's look-up, first put (new connections) and get of region ``w``, timed."""
    src = torch.randint(0, 256, (TARGET_NUMEL,), dtype=torch.uint8)
    back = torch.zeros_like(src)
    async with transport.Transport(f"legit-{uuid.uuid4().hex[:6]}", store=store, backends=("tcp",), timeout=30,
                                   token=token) as t:
        t0 = time.perf_counter()
        await t.peer(name, regions=["w"])
        t1 = time.perf_counter()
        await t.put(src, name, key="w")
        t2 = time.perf_counter()
        await t.get(back, name, key="w")
        t3 = time.perf_counter()
        again = []
        for _ in range(20):
            t4 = time.perf_counter()
            await t.put(src, name, key="w")
            again.append(time.perf_counter() - t4)
    if not torch.equal(back, src):
        raise AssertionError("the legitimate put did not land")
    return {"lookup_ms": 1e3 * (t1 - t0), "first_put_ms": 1e3 * (t2 - t1), "get_ms": 1e3 * (t3 - t2),
            "next_puts_median_ms": 1e3 * sorted(again)[len(again) // 2]}


def idle_flood(addr: tuple[str, int], to: str, incarnation: str, n: int, pid: int, store: str,
               token: str) -> dict[str, Any]:
    """``n`` idle authenticated connections (one name each), then a legitimate put, timed."""
    before = _settle(pid)
    socks, refused = [], 0
    for i in range(n):
        try:
            socks.append(greeted(addr, to, incarnation, f"idle-{i}", token))
        except OSError:
            refused += 1
    try:
        with_idle = _settle(pid)
        try:
            legit: dict[str, Any] = anyio.run(legit_put_timed, store, to, token)
        except transport.TransportError as exc:
            legit = {"error": f"{type(exc).__name__}: {exc}"}
        closed = sum(1 for s in socks if _closed_now(s))
    finally:
        for s in socks:
            s.close()
    return {"scenario": "idle", "connections": n, "refused": refused, "idle_closed": closed, "legit": legit,
            "before": before, "after": with_idle}


def _closed_now(s: socket.socket) -> bool:
    """Whether the agent has closed the idle connection ``s`` (it then sends its GOING_AWAY
    notice, or nothing, before the end of the stream; an idle connection gets nothing else)."""
    s.setblocking(False)
    try:
        s.recv(1, socket.MSG_PEEK)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def signal_flood(addr: tuple[str, int], to: str, incarnation: str, n: int, pid: int) -> dict[str, Any]:
    before = _settle(pid)
    answers: dict[str, int] = {}
    with greeted(addr, to, incarnation) as s:
        for i in range(n):
            name = f"{i:08d}".ljust(SIGNAL_NAME_BYTES, "x")
            s.sendall(encode_frame(FrameKind.SIGNAL, 2 + i, {"name": name, "value": 1}, 0))
            _, kind, _, _, _, meta_len, plen = FRAME_HEADER.unpack(s.recv(FRAME_HEADER.size, socket.MSG_WAITALL))
            s.recv(meta_len + plen, socket.MSG_WAITALL)
            answers[FrameKind(kind).name] = answers.get(FrameKind(kind).name, 0) + 1
    after = _settle(pid)
    return {"scenario": "signals", "names": n, "name_bytes": SIGNAL_NAME_BYTES, "answers": answers,
            "before": before, "after": after}


def departed(tmp: Path, store: str, n: int) -> dict[str, Any]:
    """The target (tests/peers/churn_peer.py ``initiator``) puts into ``n`` peers of one churning
    process (``churner``), each of which closes cleanly right after; it reports its own memory
    and what it still holds once it has noticed they left."""
    out = {role: tmp / f"{role}-{uuid.uuid4().hex[:6]}.json" for role in ("initiator", "churner")}
    procs, logs = {}, {}
    for role in ("initiator", "churner"):
        logs[role] = tmp / f"{out[role].stem}.log"
        spec = {"role": role, "store": store, "n": n, "region_bytes": REGION_BYTES, "out": str(out[role])}
        with open(logs[role], "wb") as err:
            procs[role] = subprocess.Popen([sys.executable, "-m", "tests.peers.churn_peer", json.dumps(spec)],
                                           env=_env(), cwd=ROOT, stderr=err)
    try:
        report = _wait_file(out["initiator"], procs["initiator"], logs["initiator"], 60 + 1.0 * n)
        _wait_file(out["churner"], procs["churner"], logs["churner"], 60)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
    return {"scenario": "departed", "peers": n, **report}


def run(scenario: str, n: int, tmp: Path) -> dict[str, Any]:
    store = f"file://{tmp / ('store-' + uuid.uuid4().hex[:6])}"
    if scenario == "departed":
        return departed(tmp, store, n)
    if scenario == "idle":
        target = Target(tmp, store, env={"TRANSPORT_AGENT_MAX_CONNS": str(n)}, token=TOKEN)
    elif scenario == "replies":
        target = Target(tmp, store, sock_buf=SMALL_SOCK_BUF)
    else:
        target = Target(tmp, store)
    try:
        (addr, incarnation) = anyio.run(agent_of, store, target.name, target.token)
        if scenario == "idle":
            doc = idle_flood(addr, target.name, incarnation, n, target.pid, store, TOKEN)
        else:
            attack = {"stalled": stalled, "meta": meta_stall, "signals": signal_flood, "runs": runs_stall,
                      "tables": tables_stall, "replies": replies_stall}[scenario]
            doc = attack(addr, target.name, incarnation, n, target.pid)
        doc["target_alive"] = target.alive()
        return doc
    finally:
        target.close()


DEFAULT_N = {"stalled": 200, "meta": 200, "signals": 10_000, "departed": 1000, "runs": 200, "tables": 50,
             "replies": 200, "idle": 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", choices=[*DEFAULT_N, "all"], nargs="?", default="all")
    ap.add_argument("--n", type=int, default=None, help="connections / names / peers (default per scenario)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in DEFAULT_N if args.scenario == "all" else [args.scenario]:
            print(json.dumps(run(scenario, args.n or DEFAULT_N[scenario], Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
