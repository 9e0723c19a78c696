"""Small tcp transfers and signals to a peer that listens on several addresses survive a cut
link: the connection to the address in use ends (the kernel watches it), and the next goes to
another of the peer's addresses (``transport._addresses``).

Host T (initiator) and host R (target), two NICs each (tests/_support/netns.py; NIC i of one
reaches NIC i of the other), and no transfer large enough to stripe. R is the striping tests'
target (tests/peers/stripe_peer.py), waiting for the signal "done"; T is this module run as a
program. At each step T puts fresh bytes (one range: the direct lane), gets them back, puts a
prepared transfer of two ranges (the pool's connection), gets those back, and signals R. The
test cuts a link between steps: R's NIC 0 (T's connections to it go silent and a connection
to it gets no answer), then, NIC 0 back, T's NIC 1 (no route from T to R's second address).
Each step must move every byte exactly, over the NIC left, within the operations' timeout;
R's final check is that its region holds T's last bytes. Needs root (network namespaces).
"""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import pytest
import torch
import trio

import transport
from tests._support import PYTHON, ROOT, python_env
from tests._support.netns import Fabric
from tests.backends.test_tcp_striping import RATE_MBIT, Pair, _line, netns
from tests.peers.stripe_peer import payload
from transport._addresses import ADDRESS_RETRY_S, Routes

NBYTES = 1 << 20  # R's region: below the striping size (and the direct lane's limit)
PIECE = 64 << 10  # the prepared put's two ranges
TIMEOUT = 10.0  # each of T's operations (a link cut costs one of them a few seconds)
WAIT_S = 120.0
_PROGRAM = "tests.backends.test_tcp_nic_failover"  # T runs this module


@pytest.fixture
def pair(tmp_path):
    with Fabric({"T": 2, "R": 2}, rate_mbit=RATE_MBIT) as fab:
        yield Pair(fab, f"file://{tmp_path / 'store'}", tmp_path)


class _Initiator:
    """This module as T's program: one step per :meth:`step`."""

    def __init__(self, pair: Pair) -> None:
        spec = {"name": "T", "peer": "R", "store": pair.store, "listen": ",".join(pair.fab.addrs("T")),
                "nbytes": NBYTES, "seed": 7, "timeout": TIMEOUT}
        with open(pair.logs / "initiator.log", "w") as log:  # (the child keeps its own descriptor)
            self.proc = pair.fab.popen("T", [PYTHON, "-m", _PROGRAM, json.dumps(spec)], env=python_env(), cwd=ROOT,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)

    async def step(self, last: bool = False) -> dict:
        await _line(self.proc, "WAITING")
        self.proc.stdin.write("last\n" if last else "go\n")
        self.proc.stdin.flush()
        return json.loads((await _line(self.proc, "STEP"))[len("STEP "):])


@netns
async def test_small_transfers_and_signals_move_to_the_nic_left(pair):
    fab = pair.fab
    target = pair.start("target", "R", nbytes=NBYTES, poll=False)
    init = _Initiator(pair)
    steps = []
    with anyio.fail_after(WAIT_S):
        steps.append(await init.step())  # every link up
        fab.link("R", 0, up=False)
        steps.append(await init.step())
        fab.link("R", 0, up=True)
        fab.link("T", 1, up=False)
        steps.append(await init.step())
        fab.link("T", 1, up=True)
        steps.append(await init.step(last=True))
        landed = json.loads((await _line(target, "RESULT"))[len("RESULT "):])
    for step in steps:
        assert step["error"] is None and step["exact"], (steps, pair.logged())
    assert landed["exact"], "R's region does not hold T's last bytes"


def test_address_order_fails_over_and_comes_back_after_the_retry_time():
    a, b, c = ("10.0.1.1", 1), ("10.0.2.1", 2), ("10.0.3.1", 3)
    routes = Routes()
    assert routes.get("p", "i", [a]) is None  # one address: nothing to choose
    route = routes.get("p", "i", [a, b, c])
    assert route is not None and route.address == a and route.order(0.0) == [0, 1, 2]
    conn = object()
    assert route.fail(a, 100.0, conn) and route.address == b
    assert not route.fail(a, 101.0, conn)  # the same connection's other requests say the same
    assert route.order(100.0 + ADDRESS_RETRY_S) == [1, 2, 0]  # failed: last, until its retry time
    assert route.order(100.1 + ADDRESS_RETRY_S) == [0, 1, 2]  # then the first again
    assert route.fail(b, 110.0, object()) and route.fail(c, 120.0, object())
    assert route.order(125.0) == [0, 1, 2]  # every one failed: the longest ago first
    assert routes.get("p", "i2", [a, b, c]) is not route  # another incarnation starts afresh


# -- T's program ----------------------------------------------------------------------------


async def _initiator(spec: dict) -> None:
    async with transport.Transport(spec["name"], store=spec["store"], backends=("tcp",), listen=spec["listen"],
                                   timeout=spec["timeout"]) as t:
        peer = spec["peer"]
        await t.wait_signal("ready", timeout=spec["timeout"])
        await t.peer(peer, regions=["w"])
        gen = torch.Generator().manual_seed(spec["seed"])
        back = torch.empty(NBYTES, dtype=torch.uint8)
        pieces = [torch.empty(PIECE, dtype=torch.uint8) for _ in range(2)]
        for n in range(1, 100):
            print("WAITING", flush=True)
            last = (await trio.to_thread.run_sync(sys.stdin.readline)).strip() == "last"
            src = payload(NBYTES, spec["seed"]) if last else torch.randint(0, 256, (NBYTES,), dtype=torch.uint8,
                                                                            generator=gen)
            out: dict = {"step": n, "error": None, "exact": False}
            try:
                await t.put(src, peer, key="w")
                await t.get(back, peer, key="w")
                exact = torch.equal(back, src)
                fresh = [torch.randint(0, 256, (PIECE,), dtype=torch.uint8, generator=gen) for _ in range(2)]
                await t.put_many(peer, [(fresh[0], "w", 0), (fresh[1], "w", 2 * PIECE)])
                await t.get_many(peer, [(pieces[0], "w", 0), (pieces[1], "w", 2 * PIECE)])
                exact = exact and all(torch.equal(a, b) for a, b in zip(pieces, fresh, strict=True))
                await t.put(src[: 3 * PIECE], peer, key="w")  # the region holds src again
                await t.signal(peer, "done" if last else "step", n)
                out["exact"] = exact
            except transport.TransportError as exc:
                out["error"] = [type(exc).__name__, str(exc)]
            print("STEP " + json.dumps(out), flush=True)
            if last:
                return


if __name__ == "__main__":
    trio.run(_initiator, json.loads(sys.argv[1]))
