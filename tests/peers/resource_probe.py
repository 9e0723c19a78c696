"""What stalled, idle, name-flooding and departing peers cost a real target process.

``python -m tests.peers.resource_probe [stalled|meta|signals|departed|all] [--n N]`` prints one JSON
line per scenario: the target's resident memory (``VmRSS``, and ``RssShmem`` for shared
mappings) before and after, read from ``/proc/<pid>/status`` from outside the target, plus what
the scenario saw. ``tests/faults/test_resource_bounds.py`` runs the same scenarios at smaller counts
and asserts the growth is bounded. Everything is real: target processes (tests/peers/hostile_target.py,
tests/peers/churn_peer.py), real sockets speaking the agent's wire format, a file store.

Scenarios (each against a fresh target; no token, as any local process could do it):

* ``stalled``: N connections say HELLO, then start a PUT to an unknown key announcing 64 MiB of
  payload, send 1 KiB of it and stall (the agent refuses the put and drains the payload);
* ``meta``: N connections say HELLO, then announce a frame with 1 MiB - 1 of metadata and stall;
* ``signals``: one connection sets N signals with distinct 16 KiB names;
* ``departed``: N peers in one long-lived process each open a Transport with a 256 KiB region,
  take one ipc put from the target, and close cleanly (their process lives on).
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

import transport
from transport._channel import hello
from transport._wire import FRAME_HEADER, FRAME_MAGIC, FrameKind, encode_frame

ROOT = Path(__file__).resolve().parents[2]
STALL_PAYLOAD = 64 << 20
META_ANNOUNCED = (1 << 20) - 1
SIGNAL_NAME_BYTES = 16 << 10
REGION_BYTES = 256 << 10


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

    def __init__(self, tmp: Path, store: str, env: dict[str, str] | None = None) -> None:
        self.name = f"target-{uuid.uuid4().hex[:6]}"
        self.out = tmp / f"{self.name}.json"
        self.log = tmp / f"{self.name}.log"
        spec = {"name": self.name, "store": store, "backends": ["tcp"], "numel": 1 << 16, "out": str(self.out),
                "env": env or {}}
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


async def agent_of(store: str, name: str) -> tuple[tuple[str, int], str]:
    """A peer's agent address and incarnation, from its published record."""
    async with transport.Transport(f"scout-{uuid.uuid4().hex[:8]}", store=store, backends=("tcp",), timeout=30) as t:
        peer = await t.peer(name, regions=["w"])
        return tuple(peer._record.agent), peer.incarnation  # type: ignore[return-value]


def _hello(to: str, incarnation: str, who: str = "intruder") -> bytes:
    return encode_frame(FrameKind.HELLO, 1, {**hello(who, "0" * 16, "control"), "to": to,
                                             "to_incarnation": incarnation}, 0)


def greeted(addr: tuple[str, int], to: str, incarnation: str, who: str = "intruder") -> socket.socket:
    """A connection that said HELLO and read the agent's OK (raises if it was refused)."""
    s = socket.create_connection(addr, timeout=10)
    s.sendall(_hello(to, incarnation, who))
    head = s.recv(FRAME_HEADER.size, socket.MSG_WAITALL)
    _, kind, _, _, _, meta_len, plen = FRAME_HEADER.unpack(head)
    s.recv(meta_len + plen, socket.MSG_WAITALL)
    if kind != FrameKind.OK:
        s.close()
        raise ConnectionError(f"HELLO refused ({FrameKind(kind).name})")
    return s


def _settle(pid: int, seconds: float = 1.0) -> dict[str, float]:
    time.sleep(seconds)
    return memory_of(pid)


def _stall(scenario: str, first: bytes, addr: tuple[str, int], to: str, incarnation: str, n: int,
           pid: int) -> dict[str, Any]:
    """``n`` connections (one name each: past the cap per peer) say HELLO, send ``first`` and
    stall; the target's memory before and with them open."""
    before = _settle(pid)
    socks, refused = [], 0
    for i in range(n):
        try:
            s = greeted(addr, to, incarnation, f"intruder-{i}")
            s.sendall(first)
            socks.append(s)
        except OSError:
            refused += 1
    after = _settle(pid, 2.0)
    for s in socks:
        s.close()
    return {"scenario": scenario, "connections": n, "refused": refused, "before": before, "after": after}


def stalled(addr: tuple[str, int], to: str, incarnation: str, n: int, pid: int) -> dict[str, Any]:
    meta = {"key": "no-such-key", "dtype": "uint8", "offset": 0, "nbytes": STALL_PAYLOAD}
    first = encode_frame(FrameKind.PUT, 2, meta, STALL_PAYLOAD) + bytes(1024)
    return _stall("stalled", first, addr, to, incarnation, n, pid)


def meta_stall(addr: tuple[str, int], to: str, incarnation: str, n: int, pid: int) -> dict[str, Any]:
    first = FRAME_HEADER.pack(FRAME_MAGIC, FrameKind.SIGNAL, 0, 0, 2, META_ANNOUNCED, 0) + b'{"name": "'
    return _stall("meta", first, addr, to, incarnation, n, pid)


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
    target = Target(tmp, store)
    try:
        (addr, incarnation) = anyio.run(agent_of, store, target.name)
        attack = {"stalled": stalled, "meta": meta_stall, "signals": signal_flood}[scenario]
        doc = attack(addr, target.name, incarnation, n, target.pid)
        doc["target_alive"] = target.alive()
        return doc
    finally:
        target.close()


DEFAULT_N = {"stalled": 200, "meta": 200, "signals": 10_000, "departed": 1000}


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
