"""Per-host relays of the stream Publisher, with real processes on "hosts" that are network
namespaces joined by shaped links (tests/_support/netns.py): the trainer on host T, three
generators on host A (one relay, two members) and one alone on host B.

Every generator prints the sha256 of its live weights for each version it made live, the trainer
the digest of what it published as that version: a torn or mixed version anywhere fails the
test. The faults: host A's relay stopped (SIGSTOP) in the middle of a version and resumed once
that version was published, and killed in the middle of one: its members get that version
through the next relay in the same publish. Needs root (ip netns)."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Callable

import pytest

from tests._support.fabric_run import FabricRun
from tests._support.netns import Fabric, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

SHAPES = {f"layers.{i}.w": [[1024, 1024], "bfloat16"] for i in range(4)} | {"norm": [[1024], "float32"]}
GENS = {"gen-a0": "A", "gen-a1": "A", "gen-a2": "A", "gen-b0": "B"}
RATE_MBIT = 200  # a version (8 MB) takes about 0.3 s a copy: a fault lands in the middle of one
DEADLINE = 3.0
WAIT_S = 120


class Run(FabricRun):
    """The trainer and the generators of one test, their JSON lines gathered as they come."""

    def __init__(self, fab: Fabric, store: str, trainer: dict, flight: str) -> None:
        super().__init__(fab, flight)
        for name, host in GENS.items():
            spec = {"name": name, "store": store, "publisher": "trainer", "shapes": SHAPES,
                    "backends": ["ipc", "tcp"], "listen": fab.addr(host), "flight": flight}
            self.start(name, host, "tests.peers.relay_peer", spec)
        spec = {"store": store, "generators": list(GENS), "shapes": SHAPES, "deadline": DEADLINE,
                "listen": fab.addr("T"), "flight": flight, "bucket": 1 << 20} | trainer
        self.start("trainer", "T", "tests.peers.relay_trainer", spec)

    def trainer(self, on: Callable[[dict], None] = lambda doc: None) -> list[dict]:
        """The trainer's publish reports, once it ended; ``on`` sees every line as it comes."""
        return self.reports("trainer", on, time.monotonic() + WAIT_S)


@pytest.fixture
def fabric():
    with Fabric({"T": 1, "A": 1, "B": 1}, rate_mbit=RATE_MBIT) as fab:
        yield fab


def run(fab: Fabric, trainer: dict, on: Callable[[Run, dict], None] | None = None):
    with tempfile.TemporaryDirectory() as d:
        flight = os.path.join(d, "flight")
        os.makedirs(flight)
        r = Run(fab, f"file://{d}/store", trainer, flight)
        reports = r.trainer((lambda doc: on(r, doc)) if on is not None else (lambda doc: None))
        gens = {name: r.generator(name) for name in GENS}
        return reports, gens, r.events("trainer")


def check_whole(reports: list[dict], gens: dict) -> None:
    """Every version a generator made live is the one the trainer published, byte for byte, and
    every generator that ended itself ended on the last version."""
    sha = {rep["version"]: rep["sha"] for rep in reports}
    for name, (lives, summary) in gens.items():
        for live in lives:
            assert live["sha"] == sha[live["live"]], f"{name}: version {live['live']} is torn or mixed"
        if summary is not None:
            assert summary["version"] == reports[-1]["version"], (name, summary)


def test_relayed_dense_and_delta_versions_arrive_whole(fabric):
    reports, gens, events = run(fabric, {"versions": 5, "change": 0.01, "delta": True, "pause": 0.3})
    check_whole(reports, gens)
    for rep in reports:
        res = rep["results"]
        assert {n: s[0] for n, s in res.items()} == dict.fromkeys(GENS, "done"), rep
        # Host A: one relay (the first by name), pushed to; the others copy from it, except one
        # that has not applied the delta's base yet (it gets the version dense, pushed). Host
        # B's only generator is pushed to.
        assert res["gen-a0"][1] is None and res["gen-b0"][1] is None, rep
        assert {res["gen-a1"][1], res["gen-a2"][1]} <= {"gen-a0", None}, rep
    assert [reports[0]["results"][n][1] for n in GENS] == [None, "gen-a0", "gen-a0", None], reports[0]
    # The versions after the first go as deltas, through the relay too.
    relayed_deltas = [rep["version"] for rep in reports[1:] for n in ("gen-a1", "gen-a2")
                      if rep["results"][n][1] == "gen-a0" and rep["results"][n][2]]
    assert relayed_deltas, reports
    for name in ("gen-a1", "gen-a2"):
        _, summary = gens[name]
        assert summary is not None and summary["followed"] >= 1 and summary["refused_deltas"] == 0, summary
    relayed = [e for e in events if e["event"] == "relay"]
    assert relayed and all(e["peer"] == "gen-a0" for e in relayed), relayed


def test_a_stopped_relay_costs_its_host_the_relay_timeout_and_is_rotated_out(fabric):
    stopped: list[float] = []

    def fault(r: Run, doc: dict) -> None:
        if doc.get("publishing") == 3:
            time.sleep(0.1)  # the version is on its way into the relay
            os.kill(r.procs["gen-a0"].pid, signal.SIGSTOP)
            stopped.append(time.time())
        if doc.get("version") == 3:  # (resumed before its lease runs out: it is slow, not dead)
            os.kill(r.procs["gen-a0"].pid, signal.SIGCONT)

    # A deadline well past the relay timeout: the relay is found stalled by the latter.
    reports, gens, events = run(fabric, {"versions": 6, "change": 1.0, "pause": 0.3, "deadline": 30.0,
                                         "relay_timeout": 1.0}, fault)
    check_whole(reports, gens)
    v3 = reports[2]["results"]
    assert v3["gen-a0"][0] == "straggler" and "stalled as the relay" in v3["gen-a0"][4], v3
    # Its members were asked to stop and got the version through the next relay by name, in the
    # same publish; host B never waited.
    assert v3["gen-a1"][:2] == ["done", None] and v3["gen-a2"][:2] == ["done", "gen-a1"], v3
    assert v3["gen-b0"][:2] == ["done", None], v3
    # The next versions go through the next relay by name, to the resumed one too.
    for rep in reports[3:]:
        res = rep["results"]
        assert res["gen-a1"][:2] == ["done", None] and res["gen-a2"][:2] == ["done", "gen-a1"], rep
        assert res["gen-a0"][0] == "done", rep
    assert any(e["event"] == "relay-failed" and e["peer"] == "gen-a0" for e in events), events
    # Resumed, the old relay catches up whole (checked above) and the others never took a mixed version.
    _, summary = gens["gen-a0"]
    assert summary is not None and summary["version"] == 6, summary


def kill_relay_in_version_3(r: FabricRun, doc: dict) -> None:
    """Kills host A's relay (gen-a0) while version 3 is on its way into it."""
    if doc.get("publishing") == 3:
        time.sleep(0.1)
        os.kill(r.procs["gen-a0"].pid, signal.SIGKILL)


def test_a_killed_relay_costs_its_host_one_more_push(fabric):
    reports, gens, events = run(fabric, {"versions": 5, "change": 1.0, "pause": 0.3}, kill_relay_in_version_3)
    check_whole(reports, gens)
    v3 = reports[2]["results"]
    assert v3["gen-a0"][0] != "done", v3
    assert v3["gen-a1"][:2] == ["done", None] and v3["gen-a2"][:2] == ["done", "gen-a1"], v3
    assert v3["gen-b0"][:2] == ["done", None], v3
    for rep in reports[3:]:
        res = rep["results"]
        assert res["gen-a2"][:2] == ["done", "gen-a1"] and res["gen-a1"][:2] == ["done", None], rep
    assert gens["gen-a0"][1] is None  # it died
    assert any(e["event"] == "relay-failed" and e["peer"] == "gen-a0" for e in events), events
