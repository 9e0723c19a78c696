"""The ``ucx`` backend beyond the conformance suite: real separate processes, a target whose
Python is blocked, two "hosts" (network namespaces joined by a veth pair, the remote one also in
its own PID namespace so that the Transport cannot use same-host shortcuts), a peer killed with
SIGKILL, and a machine without libucp.

The conformance suite (tests/backends/test_conformance.py) already runs every scenario on ``ucx``.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
import torch

import transport
from tests._support import PYTHON, ROOT, put_and_read_back, put_each_dtype, python_env, sha
from transport.backends.ucx import UcxBackend

needs_ucx = pytest.mark.skipif(
    UcxBackend.unavailable_reason() is not None, reason=f"ucx unavailable: {UcxBackend.unavailable_reason()}"
)

INSTALL_HINT = "pip install 'transport[ucx]'"


def default_transports_env() -> dict[str, str]:
    """The test environment without UCX transport selection: UCX picks its defaults."""
    env = python_env()
    for k in ("UCX_TLS", "UCX_NET_DEVICES"):
        env.pop(k, None)
    return env


class Proc:
    """A child process with its output in a file; always reaped (killed if still running)."""

    def __init__(self, tmp: Path, name: str, cmd: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.log = tmp / f"{name}.log"
        self._logf = open(self.log, "wb")  # closed in close()
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self._logf,
                                     stderr=subprocess.STDOUT)

    async def wait(self, timeout: float) -> int:
        with anyio.fail_after(timeout):
            while self.proc.poll() is None:
                await anyio.sleep(0.05)
        return self.proc.returncode

    def tail(self) -> str:
        return f"--- {self.name} ---\n" + self.log.read_bytes()[-4000:].decode(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._logf.close()


@pytest.fixture
def procs(tmp_path):
    made: list[Proc] = []

    def start(name: str, cmd: list[str], env: dict[str, str] | None = None) -> Proc:
        made.append(Proc(tmp_path, name, cmd, env or default_transports_env()))
        return made[-1]

    yield start
    for p in made:
        p.close()


def role(spec: dict) -> list[str]:
    return [PYTHON, "-m", "tests.peers.ucx_peer", json.dumps(spec)]


def peer_target(spec: dict) -> list[str]:
    return [PYTHON, "-m", "tests.peers.peer_target", json.dumps(spec)]


# -- one host ----------------------------------------------------------------------------------


def test_without_libucp_the_backend_says_what_to_install(tmp_path):
    """A process that cannot load libucp reports ucx unavailable (with what to install), refuses
    an explicit request for it, and runs without it by default."""
    script = tmp_path / "no_ucx.py"
    script.write_text("""
import trio, torch, transport
from transport.backends import availability
print("REASON", availability()["ucx"])
async def main():
    try:
        async with transport.Transport("x", store="memory://n", backends=("ucx",)):
            pass
    except transport.BackendUnavailableError as exc:
        print("EXPLICIT", type(exc).__name__, exc)
    async with transport.Transport("y", store="memory://n") as t:
        print("DEFAULT", ",".join(t.backends))
trio.run(main)
""")
    env = python_env()
    env["TRANSPORT_UCX_LIB"] = str(tmp_path / "nowhere" / "libucp.so")
    proc = subprocess.run([PYTHON, str(script)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: line for line in proc.stdout.splitlines()}
    assert INSTALL_HINT in lines["REASON"], lines["REASON"]
    assert "BackendUnavailableError" in lines["EXPLICIT"] and INSTALL_HINT in lines["EXPLICIT"]
    assert "ucx" not in lines["DEFAULT"].split(" ", 1)[1].split(",")


@needs_ucx
async def test_the_environment_is_left_untouched(memory_store):
    before = dict(os.environ)
    async with transport.Transport("a", store=memory_store, backends=("ucx",)) as a, \
            transport.Transport("b", store=memory_store, backends=("ucx",)) as b:
        dst = torch.zeros(1 << 20)
        b.register("r", dst)
        await a.peer("b", regions=["r"])
        await a.put(torch.ones(1 << 20), "b", key="r")
        assert bool((dst == 1).all())
    assert dict(os.environ) == before


@needs_ucx
async def test_restarted_peer_gets_fresh_endpoints_and_keys(memory_store):
    async with transport.Transport("a", store=memory_store, backends=("ucx",)) as a:
        async with transport.Transport("b", store=memory_store, backends=("ucx",)) as b1:
            b1.register("r", torch.zeros(4096))
            first = await a.peer("b", regions=["r"])
            await a.put(torch.ones(4096), "b", key="r")
        async with transport.Transport("b", store=memory_store, backends=("ucx",)) as b2:
            dst = torch.zeros(4096)
            b2.register("r", dst)
            second = await a.peer("b", regions=["r"])
            assert second.incarnation != first.incarnation
            h = a.put(torch.full((4096,), 2.0), "b", key="r")
            await h
            assert h.backend == "ucx" and bool((dst == 2).all())


@needs_ucx
async def test_target_blocked_in_sleep_receives_over_ucx(procs, file_store, tmp_path):
    """Default UCX transports (cma here): the target's thread sits in time.sleep while bytes
    land in its memory and are read back; wire-up is served by its native progress threads."""
    n = 64 << 20
    out = str(tmp_path / "sleeper.json")
    async with transport.Transport("init", store=file_store, backends=("ucx",)) as t:
        target = procs("sleeper", peer_target({
            "name": "sleeper", "store": file_store, "backends": ["ucx"], "initiator": "init", "mode": "sleep",
            "out": out,
            "regions": [
                {"key": "plain", "dtype": "uint8", "numel": n},
                {"key": "shm", "dtype": "uint8", "numel": n, "shared": True},
            ],
        }))
        await t.wait_signal("ready", timeout=60)
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        await put_and_read_back(t, "sleeper", ("plain", "shm"), src, "ucx")  # the target sleeps meanwhile
        Path(out + ".go").touch()
        assert await target.wait(60) == 0, target.tail()
    info = json.loads(Path(out).read_text())
    assert info["woke_by_go"], "the target woke by its deadline, not after the transfers"
    assert info["sha256"] == {"plain": sha(src), "shm": sha(src)}


@needs_ucx
async def test_cross_process_conformance_over_ucx(procs, file_store, tmp_path):
    sizes = {"float32": 1_000_003, "bfloat16": 4097, "float16": 7, "int8": 1, "uint8": 0, "int64": 65536, "bool": 12345}
    out = str(tmp_path / "server.json")
    async with transport.Transport("init", store=file_store, backends=("ucx",)) as t:
        server = procs("server", peer_target({
            "name": "server", "store": file_store, "backends": ["ucx"], "initiator": "init", "mode": "serve",
            "out": out,
            "regions": [{"key": k, "dtype": k, "numel": n} for k, n in sizes.items()],
        }))
        await t.wait_signal("ready", timeout=60)
        expected = await put_each_dtype(t, "server", sizes, "ucx")
        await t.signal("server", "done", 1)
        assert await server.wait(60) == 0, server.tail()
    assert json.loads(Path(out).read_text())["sha256"] == expected


# -- two "hosts": network namespaces + a veth pair -----------------------------------------------

_ns_counter = itertools.count()
_STORE_PORT = 29517  # inside fresh namespaces: nothing else listens there


@dataclass(frozen=True)
class Hosts:
    """Two network namespaces joined by a veth pair: ``a`` is 10.77.0.1, ``b`` is 10.77.0.2."""

    a: str
    b: str
    addr_a: str = "10.77.0.1"
    addr_b: str = "10.77.0.2"

    def run_in(self, ns: str, cmd: list[str], *, own_pid_namespace: bool = False) -> list[str]:
        """``cmd`` inside ``ns``; with its own PID namespace (and /proc) the Transport sees it
        as another host: no /proc liveness checks, no same-host transfers."""
        pidns = ["unshare", "--pid", "--kill-child", "--mount-proc"] if own_pid_namespace else []
        return ["ip", "netns", "exec", ns, *pidns, *cmd]


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")


@pytest.fixture
def hosts():
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("network namespaces need Linux and root")
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool!r} (iproute2 / util-linux) is not installed")
    tag = f"{os.getpid() % 100000}{next(_ns_counter)}"
    h = Hosts(f"txua{tag}", f"txub{tag}")
    va, vb = f"txva{tag}", f"txvb{tag}"
    first = subprocess.run(["ip", "netns", "add", h.a], capture_output=True, text=True, timeout=30, check=False)
    if first.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {first.stderr.strip()}")
    made = [h.a]
    try:
        _ip("netns", "add", h.b)
        made.append(h.b)
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        for ns, dev, addr in ((h.a, va, h.addr_a), (h.b, vb, h.addr_b)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield h
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
        subprocess.run(["ip", "link", "del", va], capture_output=True, timeout=30, check=False)


def tcp_env() -> dict[str, str]:
    """UCX limited to TCP, in the children's environment only (never in the library)."""
    env = default_transports_env()
    env["UCX_TLS"] = "tcp"
    return env


@needs_ucx
async def test_two_hosts_move_data_over_ucx_tcp(hosts, procs, tmp_path):
    # Fixture order matters: `procs` is torn down (children reaped) before `hosts` is.
    store = f"tcp://{hosts.addr_a}:{_STORE_PORT}"
    common = {"timeout": 60}
    t_out, i_out = str(tmp_path / "target.json"), str(tmp_path / "initiator.json")
    target_cmd = role({**common, "role": "target", "name": "tgt", "peer": "ini", "store": store + "?host=1",
                       "out": t_out})
    target = procs("target", hosts.run_in(hosts.a, target_cmd, own_pid_namespace=True), tcp_env())
    initiator_cmd = role({**common, "role": "initiator", "name": "ini", "peer": "tgt", "store": store, "out": i_out})
    initiator = procs("initiator", hosts.run_in(hosts.b, initiator_cmd), tcp_env())
    assert await initiator.wait(180) == 0, initiator.tail() + target.tail()
    assert await target.wait(60) == 0, target.tail()
    tgt, ini = json.loads(Path(t_out).read_text()), json.loads(Path(i_out).read_text())
    assert tgt["pid_ns"] != ini["pid_ns"], "the two sides must look like different hosts"
    assert ini["backends"] == ["ucx"]
    assert all(ini["read_back"].values()), ini["read_back"]
    for key, digest in ini["sha256"].items():
        assert tgt["sha256"][key] == digest, f"{key}: target memory differs from what was put"
    # The initiator noticed the re-registration (over UCX, one-sidedly) before its second put.
    assert tgt["old_w"] == ini["w_first"]
    assert tgt["sha256"]["w"] == ini["w_second"]


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


@needs_ucx
async def test_dead_peer_on_another_host_raises_peer_lost(hosts, procs, tmp_path):
    """SIGKILL of a target on the other "host" while puts stream to it: the put in flight
    fails with PeerLostError (found by the control plane, not by a timeout), and so does the
    next one; the initiator then closes cleanly."""
    store = f"tcp://{hosts.addr_a}:{_STORE_PORT}"
    s_out, v_out = str(tmp_path / "streamer.json"), str(tmp_path / "victim.json")
    common = {"timeout": 20}
    streamer_cmd = role({**common, "role": "streamer", "name": "ini", "peer": "victim", "store": store + "?host=1",
                         "out": s_out})
    streamer = procs("streamer", hosts.run_in(hosts.a, streamer_cmd), tcp_env())
    victim_cmd = role({**common, "role": "victim", "name": "victim", "peer": "ini", "store": store, "out": v_out})
    victim = procs("victim", hosts.run_in(hosts.b, victim_cmd, own_pid_namespace=True), tcp_env())
    with anyio.fail_after(120):
        while not Path(s_out + ".streaming").exists():
            assert streamer.proc.poll() is None and victim.proc.poll() is None, streamer.tail() + victim.tail()
            await anyio.sleep(0.02)
    # The victim is the child of `unshare` (pid 1 in its namespace): kill -9 it directly.
    (victim_pid,) = _children(victim.proc.pid)
    os.kill(victim_pid, signal.SIGKILL)
    assert await streamer.wait(90) == 0, streamer.tail()
    res = json.loads(Path(s_out).read_text())
    assert res["error"] == "PeerLostError", res
    assert "victim" in res["message"] and res["cause"] != "NoneType", res
    assert res["puts"] >= 2 and res["backend"] == "ucx", res
    assert res["again"] == "PeerLostError", res
    await victim.wait(30)
    assert not Path(v_out).exists()


@needs_ucx
async def test_token_holders_watch_each_other(memory_store, caplog):
    """With a shared token the liveness watcher's connection is authenticated like any other
    agent connection (a refusal would be logged as "cannot watch")."""
    async with transport.Transport("a", store=memory_store, backends=("ucx",), token="s3cret") as a, \
            transport.Transport("b", store=memory_store, backends=("ucx",), token="s3cret") as b:
        dst = torch.zeros(1024)
        b.register("r", dst)
        await a.peer("b", regions=["r"])
        await a.put(torch.ones(1024), "b", key="r")
        await anyio.sleep(0.2)  # the watcher's handshake runs in the background
        assert bool((dst == 1).all())
    assert "cannot watch" not in caplog.text
    assert "refused a connection" not in caplog.text


@needs_ucx
async def test_a_stopped_peer_on_another_host_delays_no_other_peer(hosts, procs, tmp_path):
    """SIGSTOP of one of two remote targets (TCP needs the target's progress thread, which is
    stopped too): the put to it ends by its timeout, and puts to the other target keep
    completing meanwhile."""
    store = f"tcp://{hosts.addr_a}:{_STORE_PORT}"
    out = str(tmp_path / "straggle.json")
    common = {"timeout": 20}
    init = procs("straggle", hosts.run_in(hosts.a, role({**common, "role": "straggle", "name": "ini", "slow_timeout": 2,
                                                         "store": store + "?host=1", "out": out})), tcp_env())
    peers = {}
    for name in ("slow", "fast"):
        victim_cmd = role({**common, "role": "victim", "name": name, "peer": "ini", "store": store,
                           "out": str(tmp_path / f"{name}.json")})
        peers[name] = procs(name, hosts.run_in(hosts.b, victim_cmd, own_pid_namespace=True), tcp_env())
    with anyio.fail_after(120):
        while not Path(out + ".stop").exists():
            assert all(p.proc.poll() is None for p in (init, *peers.values())), (
                init.tail() + peers["slow"].tail() + peers["fast"].tail()
            )
            await anyio.sleep(0.02)
    (slow_pid,) = _children(peers["slow"].proc.pid)
    os.kill(slow_pid, signal.SIGSTOP)
    try:
        Path(out + ".stopped").touch()
        assert await init.wait(90) == 0, init.tail()
    finally:
        os.kill(slow_pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too
    res = json.loads(Path(out).read_text())
    assert res["slow"] in ("TransferTimeoutError", "PeerLostError"), res
    assert res["fast_puts"] >= 1, res


@pytest.mark.parametrize("lanes", [1, 3])
async def test_explicit_lanes(memory_store, lanes):
    """lanes= chooses how many workers (and endpoints per peer) the ucx backend uses."""
    async with transport.Transport("a", store=memory_store, backends=("ucx",), lanes=lanes) as a, \
            transport.Transport("b", store=memory_store, backends=("ucx",), lanes=lanes) as b:
        dst = torch.zeros(8 << 20, dtype=torch.uint8)
        b.register("w", dst)
        await a.peer("b", regions=["w"])
        src = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)
        await a.put(src, "b", key="w")
        assert torch.equal(dst, src)


async def test_bad_lanes_is_a_clear_error(memory_store):
    with pytest.raises(transport.TransportError, match="lanes"):
        async with transport.Transport("a", store=memory_store, backends=("ucx",), lanes=0):
            pass


@pytest.mark.parametrize("tls, cma", [
    (None, True), ("", True), ("all", True), ("sm,self", True), ("tcp,cma", True), ("shm", True),
    ("tcp", False), ("tcp,self", False), ("^cma", False), ("^sm", False), ("^tcp,posix", True), (" ^ cma ", False),
])
def test_ucx_tls_decides_whether_same_host_runs_use_cma(tls, cma):
    from transport.backends.ucx import _ucx_allows_cma

    assert _ucx_allows_cma(tls) is cma
