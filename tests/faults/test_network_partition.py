"""Two "hosts" on one machine: network namespaces joined by a veth pair. The link is cut in
the middle of a transfer loop over tcp: the transfer to the far peer fails with a typed error
within its timeout, a near peer keeps receiving, and the flight recorder names the stalled
operation. Needs root (ip netns)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import anyio
import pytest

from tests._support import PYTHON, ROOT, python_env
from transport._flight import analyze, load_dumps

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 (ip netns)"
)

SUBNET = "10.78.0"  # only ever configured inside the namespaces this test creates


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    tag = uuid.uuid4().hex[:6]
    a, b = f"txa-{tag}", f"txb-{tag}"
    va, vb = f"va{tag}", f"vb{tag}"
    try:
        sh("ip", "netns", "add", a)
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        sh("ip", "link", "set", va, "netns", a)
        sh("ip", "link", "set", vb, "netns", b)
        for ns, dev, ip in ((a, va, f"{SUBNET}.1"), (b, vb, f"{SUBNET}.2")):
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {exc}")
    yield {"a": a, "b": b, "va": va}
    for ns in (a, b):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


INITIATOR = """
import json, sys, time, trio, torch, transport
spec = json.loads(sys.argv[1])
async def main():
    async with transport.Transport("init", store=spec["store"], backends=("tcp",), timeout=30,
                                   flight_dir=spec["flight"]) as t:
        for _ in range(2):
            await t.wait_signal("ready", timeout=60)
        await t.peer("far", regions=["w"])
        await t.peer("near", regions=["w"])
        src = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
        print("LOOP", flush=True)
        far_error, near_ok = None, 0
        t0 = time.monotonic()
        async with trio.open_nursery() as n:
            async def far():
                nonlocal far_error
                for _ in range(1000):
                    try:
                        await t.put(src, "far", key="w", timeout=4)
                    except transport.TransportError as exc:
                        far_error = (type(exc).__name__, str(exc), round(time.monotonic() - t0, 2))
                        return
            n.start_soon(far)
            while far_error is None and time.monotonic() - t0 < 60:
                await t.put(src, "near", key="w")
                near_ok += 1
        back = torch.empty_like(src)
        await t.get(back, "near", key="w")
        await t.signal("near", "done", 1)
        result = {"far_error": far_error, "near_ok": near_ok, "near_correct": bool(torch.equal(back, src))}
        print("RESULT", json.dumps(result), flush=True)
trio.run(main)
"""


async def test_cut_link_mid_transfer_over_tcp(two_hosts, tmp_path):
    store = f"file://{tmp_path / 'store'}"
    flight = tmp_path / "flight"
    out = str(tmp_path / "t")

    def target(ns: str, name: str, listen: str) -> subprocess.Popen:
        spec = {"name": name, "store": store, "backends": ["tcp"], "initiator": "init", "mode": "serve", "timeout": 120,
                "regions": [{"key": "w", "dtype": "uint8", "numel": 64 << 20}], "out": f"{out}-{name}.json"}
        env = {**python_env(), "TRANSPORT_LISTEN": listen}
        return subprocess.Popen(["ip", "netns", "exec", ns, PYTHON, "-m", "tests.peers.peer_target", json.dumps(spec)],
                                env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    procs = [target(two_hosts["b"], "far", f"{SUBNET}.2"), target(two_hosts["a"], "near", "127.0.0.1")]
    init = subprocess.Popen(["ip", "netns", "exec", two_hosts["a"], PYTHON, "-c", INITIATOR,
                             json.dumps({"store": store, "flight": str(flight)})],
                            env={**python_env(), "TRANSPORT_LISTEN": f"{SUBNET}.1"}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(init)
    try:
        with anyio.fail_after(90):
            line = await anyio.to_thread.run_sync(init.stdout.readline)
            assert line.startswith("LOOP"), (line, init.stderr.read()[-3000:] if init.poll() is not None else "")
            await anyio.sleep(0.5)
            sh("ip", "netns", "exec", two_hosts["a"], "ip", "link", "set", two_hosts["va"], "down")  # cut
            stdout, stderr = await anyio.to_thread.run_sync(init.communicate)
        assert init.returncode == 0, stderr[-3000:]
        result = json.loads(stdout.split("RESULT", 1)[1])
        name, message, _ = result["far_error"]
        assert name in ("TransferTimeoutError", "PeerLostError"), result
        assert "far" in message
        assert result["near_ok"] > 0 and result["near_correct"]
        report = analyze(load_dumps(sorted(flight.glob("*.json"))))
        assert "init -> far" in report and name in report
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
