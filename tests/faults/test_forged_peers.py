"""Same-host peers whose records lie (tests/peers/forged_peer.py), against a real initiator process
(tests/peers/hostile_victim.py) next to a legitimate peer.

The rules: nothing a peer names is opened in a way that can block (a FIFO where a memfd should
be); no peer-supplied bytes reach UCX's parsers unchecked (an empty rkey, random worker
addresses). Each forged peer costs at most a typed error for itself, within bounded time, and
the legitimate peer's put and get succeed in the same process. A crash (SIGSEGV/SIGABRT) or a
hang of the initiator fails the test through its exit status or its timeout.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
import torch

import transport
from tests._support import PYTHON, ROOT, python_env
from transport.backends import REGISTRY
from transport.weights import Publisher, Subscriber

_UCX_WHY = REGISTRY["ucx"].unavailable_reason()
needs_ucx = pytest.mark.skipif(_UCX_WHY is not None, reason=f"ucx unavailable: {_UCX_WHY}")


class _Peers:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.store, self.procs = tmp, f"file://{tmp / 'store'}", []

    def start(self, name: str, forge: str, backends: list[str], seed: int = 0, **extra: object) -> None:
        out = self.tmp / f"{name}.ready"
        spec = {"name": name, "store": self.store, "backends": backends, "forge": forge, "seed": seed, "out": str(out),
                **extra}
        log = open(self.tmp / f"{name}.log", "wb")
        proc = subprocess.Popen([PYTHON, "-m", "tests.peers.forged_peer", json.dumps(spec)], env=python_env(), cwd=ROOT,
                                stderr=log)
        self.procs.append((proc, log))
        deadline = time.monotonic() + 90
        while not out.exists():
            assert proc.poll() is None, (self.tmp / f"{name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"{name} not ready"
            time.sleep(0.05)

    def victim(self, peers: list[str], backends: list[str]) -> dict[str, dict[str, str]]:
        spec = {"store": self.store, "backends": backends, "peers": peers, "timeout": 2.0}
        try:
            done = subprocess.run([PYTHON, "-m", "tests.peers.hostile_victim", json.dumps(spec)], env=python_env(),
                                  cwd=ROOT, capture_output=True, timeout=120)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"the initiator hung (killed after 120 s): {exc.stderr!r:.3000}")
        err = done.stderr.decode(errors="replace")[-4000:]
        assert done.returncode == 0, f"the initiator died ({done.returncode}):\n{err}"
        return json.loads(done.stdout.decode().strip().splitlines()[-1])

    def close(self) -> None:
        for proc, log in self.procs:
            proc.kill()
            proc.wait(timeout=30)
            log.close()


@pytest.fixture
def peers(tmp_path):
    p = _Peers(tmp_path)
    yield p
    p.close()


def _assert_typed_or_ok(outcomes: dict[str, str]) -> None:
    for op, what in outcomes.items():
        assert what == "ok" or what.split(":")[0].endswith("Error"), (op, what)


@pytest.mark.parametrize("forge", ["fifo-ipc-ctl", "fifo-ro-region"])
def test_a_fifo_named_by_an_ipc_record_is_never_opened_blocking(peers, forge):
    peers.start("good", "none", ["ipc"])
    peers.start("liar", forge, ["ipc"])
    out = peers.victim(["liar", "good"], ["ipc"])
    assert out["good"] == {"lookup": "ok", "put": "ok", "get": "ok"}, out
    _assert_typed_or_ok(out["liar"])
    assert out["liar"]["lookup"] == "ok", out  # the record itself is fine: only the fd lies
    if forge == "fifo-ipc-ctl":  # the control page is only a cache: the copy goes by cma instead
        assert out["liar"]["put"] == "ok", out


@needs_ucx
def test_a_fifo_named_as_the_ucx_control_page_is_never_opened_blocking(peers):
    peers.start("good", "none", ["ucx"])
    peers.start("liar", "fifo-ucx-ctl", ["ucx"])
    out = peers.victim(["liar", "good"], ["ucx"])
    assert out["good"] == {"lookup": "ok", "put": "ok", "get": "ok"}, out
    _assert_typed_or_ok(out["liar"])


@needs_ucx
@pytest.mark.parametrize("forge", ["empty-rkey", "garbage-rkey", "random-address"])
def test_malformed_ucx_descriptors_never_reach_ucx(peers, forge):
    # Three liars forged from different seeds, met one after the other by one initiator process
    # and the good peer last: each refusal leaves that process whole for the next peer.
    liars = [f"liar{seed}" for seed in range(3)]
    peers.start("good", "none", ["ucx"])
    for seed, liar in enumerate(liars):
        peers.start(liar, forge, ["ucx"], seed=seed)
    out = peers.victim([*liars, "good"], ["ucx"])
    assert out["good"] == {"lookup": "ok", "put": "ok", "get": "ok"}, out
    for liar in liars:
        _assert_typed_or_ok(out[liar])
        assert out[liar]["put"] != "ok", out
        assert "ucx" in out[liar]["put"], out  # the refusal names the backend and why
        if forge != "random-address":
            assert out[liar]["get"] == "ok", out  # only w's rkey lies: ro still works


@pytest.mark.parametrize("backend,forge", [("ipc", "fifo-ipc-ctl"),
                                           pytest.param("ucx", "fifo-ucx-ctl", marks=needs_ucx)])
async def test_a_subscriber_naming_a_fifo_does_not_stall_a_publish(peers, backend, forge):
    """A forged subscriber of the stream (a real Subscriber, then its record's control page fd
    pointed at a FIFO): ``publish(deadline=2)`` still returns in bounded time and the legitimate
    subscriber gets the version. Before, the publisher's lookup opened the FIFO and its event
    loop blocked forever."""
    numel = 1 << 14
    model = {"w0": torch.arange(numel, dtype=torch.float32)}
    async with transport.Transport("trainer", store=peers.store, backends=(backend,), timeout=10) as t, \
            transport.Transport("good", store=peers.store, backends=(backend,), timeout=10) as g:
        async with Publisher(t, model, name="s", deadline=2) as pub:
            await anyio.to_thread.run_sync(lambda: peers.start(
                "liar", forge, [backend], subscribe={"publisher": "trainer", "stream": "s", "numel": numel}))
            live = {"w0": torch.zeros(numel)}
            good = Subscriber(g, live, publisher="trainer", name="s")
            await good.start()
            with anyio.fail_after(60):
                report = await pub.publish(1)
                assert await good.wait_version(1, timeout=10) == 1
            assert torch.equal(live["w0"], model["w0"])
            assert "good" in str(report), report
