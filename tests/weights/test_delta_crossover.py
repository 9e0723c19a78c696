"""The crossover a stream publisher chooses per version from what it measured: the link's dense
push time, the diff, and a copy and a scatter timed on this host (real native calls)."""

from __future__ import annotations

import uuid

import pytest
import torch

import transport
from transport.weights import Publisher, Subscriber
from transport.weights._codec.policy import CROSSOVER, NETWORK_MAX, Crossover, wire_share

MODEL_BYTES = 200 << 20
ELEMENTS = MODEL_BYTES // 2


@pytest.fixture(scope="module")
def calibrated() -> Crossover:
    c = Crossover(None, MODEL_BYTES, ELEMENTS, 2)
    c.calibrate()
    return c


def test_wire_share_is_the_smaller_of_gaps_and_bitmask():
    assert wire_share(0.01, 2) == pytest.approx(0.015)  # values + a byte a gap
    assert wire_share(0.4, 2) == pytest.approx(0.4 + 1 / 16)  # values + a bitmask
    assert wire_share(0.1, 4) == pytest.approx(0.125)


def test_given_or_unmeasured_crossovers(calibrated: Crossover):
    assert Crossover(0.3, MODEL_BYTES, ELEMENTS, 2).value(["gen"]) == 0.3
    fresh = Crossover(None, MODEL_BYTES, ELEMENTS, 2)
    fresh.pushed_dense("gen", 1.0)
    assert fresh.value(["gen"]) == CROSSOVER  # not calibrated yet
    assert calibrated.value(["gen"]) == CROSSOVER  # no push measured


def modeled(copy_gbps: float = 13.0, scatter_ns: float = 2.0) -> Crossover:
    """A Crossover with given host figures (a memcpy and a checked scatter per changed element,
    as this 2-core VM measures them idle): what it chooses then depends on the links alone, not
    on how busy the machine running the test is."""
    c = Crossover(None, MODEL_BYTES, ELEMENTS, 2)
    c.copy_gbps, c.scatter_ns = copy_gbps, scatter_ns
    return c


def test_calibration_measures_this_host(calibrated: Crossover):
    assert calibrated.copy_gbps is not None and calibrated.scatter_ns is not None
    assert calibrated.copy_gbps > 0 and calibrated.scatter_ns > 0
    # Whatever the host measured: a slower link never lowers the crossover.
    copy_s = MODEL_BYTES / (calibrated.copy_gbps * 1e9)
    chosen = []
    for i, push in enumerate((copy_s, 4 * copy_s, 40 * copy_s)):
        calibrated.pushed_dense(f"link{i}", push)
        chosen.append(calibrated.value([f"link{i}"]))
    assert CROSSOVER <= chosen[0] <= chosen[1] <= chosen[2] <= NETWORK_MAX, chosen


def test_the_crossover_follows_the_link():
    c = modeled()
    copy_s = MODEL_BYTES / (13.0 * 1e9)
    chosen = {}
    for name, push in (("memory", copy_s), ("fast", 4 * copy_s), ("slow", 40 * copy_s)):
        c.pushed_dense(name, push)
        chosen[name] = c.value([name])
    # As fast as a copy: the diff alone costs more than the bytes saved. A slow link: bytes
    # dominate, and a dense change still pays up to the cap.
    assert chosen["memory"] == CROSSOVER
    assert CROSSOVER < chosen["fast"] < chosen["slow"] == NETWORK_MAX, chosen
    # One encoding serves every taker: the fastest link decides.
    assert c.value(["slow", "memory"]) == CROSSOVER
    c.forget("memory")
    assert c.value(["slow", "memory"]) == chosen["slow"]
    # A measured diff slower than a copy lowers it.
    c.diffed(20 * copy_s)
    assert c.value(["slow"]) < chosen["slow"]
    # A host whose scatter is slower (subscribers sharing their cores) lowers it too.
    slow_host = modeled(scatter_ns=8.0)
    slow_host.pushed_dense("slow", 40 * copy_s)
    assert slow_host.value(["slow"]) < chosen["slow"]


async def test_the_report_names_the_crossover_each_version_was_judged_by():
    store = f"memory://{uuid.uuid4().hex}"
    src = {"a": torch.randn(1 << 16)}
    async with transport.Transport("trainer", store=store, backends=("tcp",)) as tt, \
            transport.Transport("far", store=store, backends=("tcp",)) as tf:
        async with Publisher(tt, src, name="fixed", delta_crossover=0.3) as fixed, \
                Publisher(tt, src, name="chosen") as chosen, \
                Subscriber(tf, {"a": torch.zeros(1 << 16)}, publisher="trainer", name="fixed") as s1, \
                Subscriber(tf, far := {"a": torch.zeros(1 << 16)}, publisher="trainer", name="chosen") as s2:
            for v in range(1, 4):
                src["a"][v : v + 3] += 1
                r1, r2 = await fixed.publish(v), await chosen.publish(v)
                assert await s1.wait_version(v) == v and await s2.wait_version(v) == v
                if v > 1:  # diffed against the version before
                    assert r1.delta is not None and r1.delta.crossover == 0.3 and r1.results["far"].delta
                    assert r2.delta is not None and r2.delta.crossover is not None
                    assert CROSSOVER <= r2.delta.crossover <= NETWORK_MAX and r2.results["far"].delta
            assert torch.equal(far["a"], src["a"])
