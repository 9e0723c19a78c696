"""The multi-host test fabric (tests/_support/netns.py): hosts as network namespaces with shaped
veth links through per-NIC switches. Real processes and sockets: a stream between two hosts
arrives whole over a shaped link, each NIC of a two-NIC host is its own path, a cut link fails a
transfer and a connect while the other NIC still carries one, every host has its own hostname,
and nothing is left behind. Needs root (ip netns)."""

from __future__ import annotations

import hashlib
import json
import select
import subprocess

import pytest

from tests._support import PYTHON, ROOT, python_env
from tests._support.netns import Fabric, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

PORT = 5301
WAIT_S = 60

# Receiver: listens on argv[1], prints READY, then the sha256 and size of what one connection sent.
RECEIVER = """
import hashlib, json, socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(1)
s.settimeout(60)
print("READY " + socket.gethostname(), flush=True)
c, peer = s.accept()
c.settimeout(60)
h, n = hashlib.sha256(), 0
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    h.update(b)
    n += len(b)
print(json.dumps({"sha": h.hexdigest(), "bytes": n, "peer": peer[0]}), flush=True)
"""

# Sender: sends argv[3] bytes (a fixed pattern) to argv[1]:argv[2], or until a send fails (3 s
# without progress); prints DONE, or ERROR and the exception's class; STARTED after the first MiB.
SENDER = """
import socket, sys
addr, port, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    c = socket.create_connection((addr, port), timeout=3)
    block = bytes(range(256)) * 4096
    sent = 0
    while sent < total:
        c.sendall(block[: min(len(block), total - sent)])
        sent += min(len(block), total - sent)
        if sent == len(block):
            print("STARTED", flush=True)
    c.close()
    print("DONE", flush=True)
except OSError as exc:
    print("ERROR " + type(exc).__name__ + " " + str(exc), flush=True)
"""


def pattern_sha(total: int) -> str:
    block = bytes(range(256)) * 4096
    h = hashlib.sha256()
    for pos in range(0, total, len(block)):
        h.update(block[: min(len(block), total - pos)])
    return h.hexdigest()


def readline(p: subprocess.Popen, timeout: float = WAIT_S) -> str:
    """The next line ``p`` prints ("" when it wrote none within ``timeout`` or exited)."""
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    return p.stdout.readline() if ready else ""


def start_receiver(fab: Fabric, host: str, nic: int) -> tuple[subprocess.Popen, str]:
    p = fab.popen(host, [PYTHON, "-c", RECEIVER, fab.addr(host, nic), str(PORT)], env=python_env(), cwd=ROOT,
                  stdout=subprocess.PIPE, text=True)
    line = readline(p)  # READY <hostname>, or "" if it died (then the assert says so)
    assert line.startswith("READY"), (line, p.poll())
    return p, line.split()[1]


def send(fab: Fabric, host: str, to: str, total: int) -> subprocess.Popen:
    return fab.popen(host, [PYTHON, "-c", SENDER, to, str(PORT), str(total)], env=python_env(), cwd=ROOT,
                     stdout=subprocess.PIPE, text=True)


def outcome(p: subprocess.Popen) -> str:
    out, _ = p.communicate(timeout=WAIT_S)
    return out.strip().splitlines()[-1] if out.strip() else f"(no output, exit {p.returncode})"


def test_stream_arrives_whole_and_hosts_are_distinct():
    total = 8 << 20
    with Fabric({"T": 2, "A": 2}, rate_mbit=200) as fab:
        assert fab.addr("T", 0) != fab.addr("T", 1)
        for host in ("T", "A"):  # each direction of each link is shaped, both ends
            qdisc = fab.run(host, ["tc", "qdisc", "show", "dev", fab.dev(host, 0)])
            assert "tbf" in qdisc and "200Mbit" in qdisc, qdisc
        switch = subprocess.run(["tc", "-n", fab.switch_ns, "qdisc", "show"], capture_output=True, text=True,
                                timeout=WAIT_S, check=True).stdout
        assert switch.count("tbf") == 4 and switch.count("rate 200Mbit") == 4, switch  # the 4 switch ports
        receiver, a_name = start_receiver(fab, "A", 0)
        sender = send(fab, "T", fab.addr("A", 0), total)
        assert outcome(sender) == "DONE"
        got = json.loads(receiver.communicate(timeout=WAIT_S)[0])
        assert got == {"sha": pattern_sha(total), "bytes": total, "peer": fab.addr("T", 0)}
        # NIC 1 is a path of its own: T's second address reaches A's second one.
        receiver, _ = start_receiver(fab, "A", 1)
        assert outcome(send(fab, "T", fab.addr("A", 1), 1 << 20)) == "DONE"
        assert json.loads(receiver.communicate(timeout=WAIT_S)[0])["peer"] == fab.addr("T", 1)
        t_name = subprocess.run(fab.command("T", ["hostname"]), capture_output=True, text=True, timeout=WAIT_S,
                                check=True).stdout.strip()
        assert {a_name, t_name} == {fab.hostname("A"), fab.hostname("T")} and a_name != t_name
        names = [fab.ns(h) for h in ("T", "A")] + [fab.switch_ns]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=WAIT_S).stdout
    assert not any(n in left for n in names), left


def test_cut_link_fails_transfer_and_connect_other_nic_still_carries():
    with Fabric({"T": 2, "A": 2}, rate_mbit=100) as fab:
        receiver, _ = start_receiver(fab, "A", 0)
        sender = send(fab, "T", fab.addr("A", 0), 1 << 30)  # ~86 s at 100 Mbit: cut long before
        assert readline(sender).strip() == "STARTED"
        fab.link("T", 0, up=False)
        assert outcome(sender).startswith("ERROR")  # no progress for 3 s: the send times out
        receiver.kill()
        receiver.wait(timeout=WAIT_S)
        assert outcome(send(fab, "T", fab.addr("A", 0), 1 << 20)).startswith("ERROR")  # no route, or no answer
        # NIC 1 is untouched.
        receiver, _ = start_receiver(fab, "A", 1)
        assert outcome(send(fab, "T", fab.addr("A", 1), 1 << 20)) == "DONE"
        assert json.loads(receiver.communicate(timeout=WAIT_S)[0])["bytes"] == 1 << 20
        # Up again: NIC 0 carries again.
        fab.link("T", 0, up=True)
        receiver, _ = start_receiver(fab, "A", 0)
        assert outcome(send(fab, "T", fab.addr("A", 0), 1 << 20)) == "DONE"
        assert json.loads(receiver.communicate(timeout=WAIT_S)[0])["bytes"] == 1 << 20


def test_cleanup_after_a_failure_removes_everything():
    fab = Fabric({"T": 1, "A": 1}, rate_mbit=100)
    with pytest.raises(RuntimeError, match="boom"):
        with fab:
            p = fab.popen("A", ["sleep", "600"])
            raise RuntimeError("boom")
    assert p.returncode is not None  # killed and reaped
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=WAIT_S).stdout
    assert fab.tag not in left, left
