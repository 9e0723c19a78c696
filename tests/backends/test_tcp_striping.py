"""Striping tcp transfers over NICs: a peer that listens on several addresses gets a large
transfer over one lane per (local, remote) address pair; a lane whose link is cut mid-transfer
hands its bytes to the other; every link cut fails the transfer with a typed error within its
timeout; a record's address list is hostile input until checked.

The multi-host cases run real processes in network namespaces (tests/_support/netns.py: host
T and host R with two NICs each, NIC i of one reaching NIC i of the other) and need root. What
they assert comes from the flight record and the lanes' counters, never from timing.
"""

from __future__ import annotations

import json
import subprocess
import time

import anyio
import pytest
import torch

import transport
from tests._support import PYTHON, ROOT, python_env
from tests._support.netns import Fabric, unavailable_reason
from transport._errors import PeerNotFoundError, WireError
from transport._listen import parse_listen
from transport._peers import PEER_PREFIX
from transport._wire import MAX_AGENT_ADDRESSES, PeerRecord

NBYTES = 96 << 20  # at 200 Mbit/s a link, about 2 s over both lanes: long enough to cut one midway
RATE_MBIT = 200
TIMEOUT = 40.0
WAIT_S = 120.0

netns = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


class Pair:
    """Host T (initiator) and host R (target), two NICs each, one store."""

    def __init__(self, fab: Fabric, store: str, logs) -> None:
        self.fab, self.store, self.logs = fab, store, logs

    def start(self, role: str, host: str, **extra: object) -> subprocess.Popen:
        names = {"target": "R", "initiator": "T"}
        spec = {"role": role, "name": names[role], "peer": names["initiator" if role == "target" else "target"],
                "store": self.store, "listen": ",".join(self.fab.addrs(host)), "nbytes": NBYTES, "seed": 7,
                "timeout": TIMEOUT, "linger": TIMEOUT, **extra}  # (the fabric ends the target)
        with open(self.logs / f"{role}.log", "w") as log:  # (the child keeps its own descriptor)
            return self.fab.popen(host, [PYTHON, "-m", "tests.peers.stripe_peer", json.dumps(spec)],
                                  env=python_env(), cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=log, text=True)

    def logged(self) -> str:
        """The tail of both processes' logs (for a failure's message)."""
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.logs.glob("*.log")))


@pytest.fixture
def pair(tmp_path):
    with Fabric({"T": 2, "R": 2}, rate_mbit=RATE_MBIT) as fab:
        yield Pair(fab, f"file://{tmp_path / 'store'}", tmp_path)


async def _line(proc: subprocess.Popen, prefix: str) -> str:
    while True:
        line = await anyio.to_thread.run_sync(proc.stdout.readline)
        if not line:
            raise AssertionError(f"no {prefix!r} line (exit {proc.wait()})")
        if line.startswith(prefix):
            return line


async def _result(proc: subprocess.Popen) -> dict:
    return json.loads((await _line(proc, "RESULT"))[len("RESULT "):])


def _nics(lanes: dict[str, int]) -> set[tuple[str, str]]:
    """The (local, remote) address pairs of a flight record's lanes."""
    return {(lane.split(">")[0], lane.split(">")[1].rsplit(":", 1)[0]) for lane in lanes}


@netns
async def test_transfer_uses_both_lanes_byte_exact(pair):
    fab = pair.fab
    target = pair.start("target", "R")
    init = pair.start("initiator", "T")
    with anyio.fail_after(WAIT_S):
        result = await _result(init)
        landed = await _result(target)
    assert result["error"] is None, result
    assert landed["exact"], "the target's region does not hold the initiator's bytes"
    lanes = result["lanes"]
    # NIC i of T paired with NIC i of R, both carried a share, and the shares add up
    assert _nics(lanes) == {(fab.addr("T", i), fab.addr("R", i)) for i in (0, 1)}, lanes
    assert all(n > 0 for n in lanes.values()), lanes
    assert sum(lanes.values()) == NBYTES
    assert all(s["failures"] == 0 for s in result["stats"]), result["stats"]


@netns
@pytest.mark.parametrize("nic", [0, 1])
async def test_link_cut_mid_transfer_moves_bytes_to_the_other_lane(pair, nic):
    fab = pair.fab
    target = pair.start("target", "R")
    init = pair.start("initiator", "T")
    with anyio.fail_after(WAIT_S):
        await _line(init, "START")
        await anyio.sleep(0.5)  # both lanes are moving bytes by now (a transfer takes ~2 s)
        fab.link("T", nic, up=False)
        result = await _result(init)
        landed = await _result(target)
    assert result["error"] is None, (result, pair.logged())
    assert landed["exact"], "the target's region does not hold the initiator's bytes"
    lanes = result["lanes"]
    cut, kept = (fab.addr("T", nic), fab.addr("R", nic)), (fab.addr("T", 1 - nic), fab.addr("R", 1 - nic))
    assert kept in _nics(lanes), lanes
    assert sum(lanes.values()) == NBYTES  # every chunk delivered once, the cut lane's included
    stats = {(s["lane"].split(">")[0], s["lane"].split(">")[1].rsplit(":", 1)[0]): s for s in result["stats"]}
    assert stats[cut]["failures"] == 1 and not stats[cut]["up"], stats
    assert stats[kept]["failures"] == 0, stats


@netns
async def test_an_address_that_cannot_be_reached_gives_no_lane(tmp_path):
    with Fabric({"T": 1, "R": 2}, rate_mbit=RATE_MBIT) as fab:  # T has no NIC on R's second subnet
        pair = Pair(fab, f"file://{tmp_path / 'store'}", tmp_path)
        target = pair.start("target", "R")
        init = pair.start("initiator", "T")
        with anyio.fail_after(WAIT_S):
            result = await _result(init)
            landed = await _result(target)
    assert result["error"] is None, (result, pair.logged())
    assert landed["exact"]
    assert _nics(result["lanes"]) == {(fab.addr("T", 0), fab.addr("R", 0))}, result["lanes"]
    dropped = [s for s in result["stats"] if f">{fab.addr('R', 1)}:" in s["lane"]]
    assert len(dropped) == 1 and dropped[0]["failures"] == 1 and dropped[0]["bytes"] == 0, result["stats"]
    assert "(connect)" in dropped[0]["why"], dropped


@netns
async def test_an_address_that_does_not_answer_does_not_hold_the_transfer(pair):
    fab = pair.fab
    target = pair.start("target", "R")
    init = pair.start("initiator", "T", wait_go=True)
    with anyio.fail_after(WAIT_S):
        await _line(init, "WAITING")
        fab.link("R", 1, up=False)  # R's second address: a connect to it gets no answer (SYNs dropped)
        init.stdin.write("go\n")
        init.stdin.flush()
        result = await _result(init)
        landed = await _result(target)
    assert result["error"] is None, (result, pair.logged())
    assert landed["exact"]
    assert _nics(result["lanes"]) == {(fab.addr("T", 0), fab.addr("R", 0))}, result["lanes"]
    silent = [s for s in result["stats"] if f">{fab.addr('R', 1)}:" in s["lane"]]
    assert len(silent) == 1 and silent[0]["bytes"] == 0, result["stats"]


@netns
async def test_every_link_cut_fails_typed_within_the_timeout(pair):
    fab = pair.fab
    timeout = 10.0
    pair.start("target", "R")
    init = pair.start("initiator", "T", timeout=timeout)
    with anyio.fail_after(WAIT_S):
        await _line(init, "START")
        await anyio.sleep(0.5)
        t0 = time.monotonic()
        fab.link("T", 0, up=False)
        fab.link("T", 1, up=False)
        result = await _result(init)
        waited = time.monotonic() - t0
    assert result["error"] is not None, result
    name, message, seconds = result["error"]
    assert name in ("TransferTimeoutError", "PeerLostError"), result["error"]
    assert "R" in message
    assert seconds <= timeout + 5 and waited <= timeout + 15  # bounded by the put's timeout, not a hang


# -- the record's address list ----------------------------------------------------------------


def _record(drop: str = "", **fields: object) -> bytes:
    """A record of two addresses, with ``fields`` replaced and ``drop`` left out."""
    rec = PeerRecord(name="p", incarnation="i", seq=1, pid=1, pid_start=1,
                     host=transport._wire.HostId("h", "b", 1), agent=("10.0.0.1", 5000), backends={}, regions={},
                     agents=(("10.0.0.1", 5000), ("10.0.1.1", 5001)))
    doc = json.loads(rec.encode())
    doc.update(fields)
    doc.pop(drop, None)
    return json.dumps(doc).encode()


def test_record_round_trips_every_address():
    rec = PeerRecord.decode(_record())
    assert rec.addresses == (("10.0.0.1", 5000), ("10.0.1.1", 5001))
    one = PeerRecord.decode(_record(drop="agents"))
    assert one.agents == () and one.addresses == (("10.0.0.1", 5000),)  # an older record: its one agent


@pytest.mark.parametrize("agents", [
    "10.0.0.1:5000",                                                 # not a list
    [["10.0.0.1", 5000]],                                            # one address: not how one is written
    [["10.0.0.1", 5000]] + [[f"10.0.{i}.1", 5000] for i in range(1, MAX_AGENT_ADDRESSES + 1)],  # too many
    [["10.0.0.1", 5000], ["10.0.0.1", 5000]],                        # twice
    [["10.0.0.1", 5000], ["10.0.1.1"]],                              # no port
    [["10.0.0.1", 5000], ["10.0.1.1", 0]],                           # port out of range
    [["10.0.0.1", 5000], ["10.0.1.1", 70000]],
    [["10.0.0.1", 5000], ["10.0.1.1", True]],                        # a bool is no port
    [["10.0.0.1", 5000], ["10.0.1.1", "5001"]],
    [["10.0.0.1", 5000], ["", 5001]],                                # no host
    [["10.0.0.1", 5000], ["a" * 300, 5001]],                         # too long
    [["10.0.0.1", 5000], ["evil host/../x", 5001]],                  # neither an IP nor a DNS name
    [["10.0.0.1", 5000], [["10.0.1.1"], 5001]],
    [["10.0.9.9", 5000], ["10.0.1.1", 5001]],                        # does not start with the agent
])
def test_hostile_address_list_is_refused(agents):
    with pytest.raises(WireError, match="malformed peer record"):
        PeerRecord.decode(_record(agents=agents))


async def test_hostile_record_is_refused_by_a_transport(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    async with transport.Transport("a", store=store, backends=("tcp",), listen="127.0.0.1,127.0.0.2") as t:
        mine = json.loads(t._store.get(PEER_PREFIX + "a"))
        mine.update(name="evil", agents=[mine["agent"], ["127.0.0.1", 99999]])
        t._store.set(PEER_PREFIX + "evil", json.dumps(mine).encode())
        with pytest.raises(PeerNotFoundError) as err:
            await t.peer("evil", timeout=5)
        assert isinstance(err.value.__cause__, WireError), err.value.__cause__


def test_listen_parsing():
    assert parse_listen("10.1.1.2, 10.1.2.2:7000") == [("10.1.1.2", 0), ("10.1.2.2", 7000)]
    assert parse_listen(["[::1]:5", "fe80::1"]) == [("::1", 5), ("fe80::1", 0)]
    assert parse_listen(None) is None and parse_listen("") is None
    for bad in ("10.1.1.2,10.1.1.2", "10.1.1.2,", ":5", "h:x", "h:70000", ",".join(f"10.0.0.{i}" for i in range(20))):
        with pytest.raises(ValueError):
            parse_listen(bad)
    with pytest.raises(TypeError):
        parse_listen([1, 2])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        transport.Transport("x", listen="10.1.1.2,10.1.1.2")


async def test_one_listen_address_means_no_striping(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    async with transport.Transport("a", store=store, backends=("tcp",)) as a, \
            transport.Transport("b", store=store, backends=("tcp",), listen="127.0.0.1,127.0.0.2") as b:
        w = torch.zeros(32 << 20, dtype=torch.uint8)
        a.register("w", w)
        src = torch.randint(0, 256, (32 << 20,), dtype=torch.uint8)
        await b.peer("a", regions=["w"])
        await b.put(src, "a", key="w")  # a listens on one address: one connection
        assert torch.equal(w, src)
        assert not b._flight.snapshot("t")["records"][-1].get("lanes")
        await a.peer("b")
        b.register("w", torch.zeros(32 << 20, dtype=torch.uint8))
        await a.peer("b", regions=["w"])
        await a.put(src, "b", key="w")  # b listens on two: striped, one lane each
        lanes = a._flight.snapshot("t")["records"][-1]["lanes"]
        assert len(lanes) == 2 and sum(lanes.values()) == 32 << 20, lanes


# -- the end of a striped transfer ------------------------------------------------------------


class _OpenChannel:
    broken = False


def test_a_slow_lane_leaves_the_last_chunks_to_a_fast_one():
    from transport.backends.tcp._stripe import STRIPE_CHUNK, Lane, Stripes, _Run

    fast, slow = Lane(("10.0.0.1", 1), rate=4e8, chan=_OpenChannel()), Lane(("10.0.1.1", 1), rate=1e8,
                                                                              chan=_OpenChannel())
    lanes = [fast, slow]
    run = _Run([STRIPE_CHUNK] * 40, lambda n: n, lanes)
    run.inflight, fast.pending = 2, 2 * STRIPE_CHUNK
    assert Stripes._worth_taking(slow, run, STRIPE_CHUNK)  # much left: the slow lane carries its share
    run = _Run([STRIPE_CHUNK], lambda n: n, lanes)
    run.inflight = 2
    assert not Stripes._worth_taking(slow, run, STRIPE_CHUNK)  # the fast one delivers the last sooner
    assert Stripes._worth_taking(fast, run, STRIPE_CHUNK)
    run.inflight, fast.pending = 0, 0
    assert Stripes._worth_taking(slow, run, STRIPE_CHUNK)  # nothing on the wire: no change to wait for
    assert Stripes._worth_taking(Lane(("10.0.2.1", 1)), run, STRIPE_CHUNK)  # no rate measured yet
