"""The crossover a stream publisher chooses per version from what it measured: the link's dense
push time, the diff, and a copy and a scatter timed on this host (real native calls)."""

from __future__ import annotations

import uuid

import pytest
import torch

import transport
from transport.weights import Publisher, Subscriber
from transport.weights._codec.policy import CROSSOVER, DIFF_STALE_S, NETWORK_MAX, Crossover, wire_share
from transport.weights._control import DIFFING

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
    assert Crossover(0.3, MODEL_BYTES, ELEMENTS, 2).value(["gen"]) == {"gen": 0.3}
    fresh = Crossover(None, MODEL_BYTES, ELEMENTS, 2)
    fresh.pushed_dense("gen", 1.0)
    assert fresh.of("gen") == CROSSOVER  # not calibrated yet
    assert fresh.first_s(MODEL_BYTES, MODEL_BYTES) == 0.0
    assert calibrated.of("gen") == CROSSOVER  # no push measured


def modeled(copy_gbps: float = 13.0, scatter_ns: float = 2.0, sum_gbps: float = 20.0) -> Crossover:
    """A Crossover with given host figures (a memcpy, a checksum pass and a checked scatter per
    changed element, as this 2-core VM measures them idle): what it chooses then depends on the
    links alone, not on how busy the machine running the test is."""
    c = Crossover(None, MODEL_BYTES, ELEMENTS, 2)
    c.copy_gbps, c.scatter_ns, c.sum_gbps = copy_gbps, scatter_ns, sum_gbps
    return c


def test_calibration_measures_this_host(calibrated: Crossover):
    assert calibrated.calibrated and calibrated.copy_gbps is not None and calibrated.scatter_ns is not None
    assert calibrated.copy_gbps > 0 and calibrated.scatter_ns > 0 and calibrated.sum_gbps and calibrated.emit_ns >= 0
    # Whatever the host measured: a slower link never lowers the crossover, nor does a first
    # delta's extra cost raise it.
    copy_s = MODEL_BYTES / (calibrated.copy_gbps * 1e9)
    chosen = []
    for i, push in enumerate((copy_s, 4 * copy_s, 40 * copy_s)):
        calibrated.pushed_dense(f"link{i}", push)
        chosen.append(calibrated.of(f"link{i}"))
        assert calibrated.of(f"link{i}", calibrated.first_s(MODEL_BYTES, MODEL_BYTES)) <= chosen[-1]
    assert 0.0 <= chosen[0] <= chosen[1] <= chosen[2] <= NETWORK_MAX, chosen
    assert chosen[2] > 0  # 40 copies' time on the wire: a delta pays


def test_a_diff_measured_slow_stands_only_for_a_while():
    """One diff measured slow (a busy moment) sends every subscriber dense, undiffed: nothing
    would measure it again. After DIFF_STALE_S it no longer stands, and the link's crossover
    is back to what the host's figures predict (the next version is diffed and measured)."""
    c = modeled()
    copy_s = MODEL_BYTES / (13.0 * 1e9)
    c.pushed_dense("fast", 4 * copy_s)
    fresh = c.of("fast")
    assert fresh > 0
    c.diffed(100 * copy_s, 0.02)
    assert c.of("fast") == 0.0 and not c.worth_readying("fast", None)
    c._diff_at -= DIFF_STALE_S + 1  # (as if that long had passed)
    assert c.of("fast") == fresh and c.worth_readying("fast", None)


def test_the_crossover_follows_the_link():
    c = modeled()
    copy_s = MODEL_BYTES / (13.0 * 1e9)
    chosen = {}
    for name, push in (("memory", copy_s), ("fast", 4 * copy_s), ("slow", 40 * copy_s)):
        c.pushed_dense(name, push)
        chosen[name] = c.of(name)
    # As fast as a copy: the diff alone costs about the bytes saved, so no delta pays there and
    # that subscriber gets every version dense. A slow link: bytes dominate, and a dense change
    # still pays up to the cap.
    assert chosen["memory"] == 0.0
    assert CROSSOVER < chosen["fast"] < chosen["slow"] == NETWORK_MAX, chosen
    # Readying for a delta after a dense version (the background passes): never where none
    # pays; where one pays only below CROSSOVER (twice a copy's time on the wire: 2%), only
    # while the versions change that little; on a slower link whatever they change.
    c.pushed_dense("near", 2 * copy_s)
    assert 0 < c.of("near") < CROSSOVER
    assert not c.worth_readying("memory", None)
    assert c.worth_readying("near", None) and c.worth_readying("near", c.of("near"))
    assert not c.worth_readying("near", 0.03)
    assert c.worth_readying("fast", 0.3) and c.worth_readying("slow", 0.9)
    c.forget("near")
    # Each subscriber by its own path (one encoding serves those it pays for).
    assert c.value(["slow", "memory"]) == {"slow": chosen["slow"], "memory": 0.0}
    c.forget("slow")
    assert c.of("slow") == CROSSOVER  # unmeasured again
    c.pushed_dense("slow", 40 * copy_s)
    # The first delta after a dense version pays a checksum pass and a copy more: on a fast
    # link that leaves less room, on a slow one it hardly matters.
    first = c.first_s(MODEL_BYTES, MODEL_BYTES)
    assert first == pytest.approx(MODEL_BYTES / 20e9 + MODEL_BYTES / 13e9)
    assert c.of("fast", first) < chosen["fast"] and c.of("slow", first) == chosen["slow"]
    # A measured diff slower than a copy lowers it.
    c.diffed(20 * copy_s)
    assert c.of("slow") < chosen["slow"]
    # A diff that spends more per changed element (AVX2 against AVX-512: 5 ns against 1 ns
    # here) is predicted slower at a denser change, so it lowers the crossover too.
    c.diffed(copy_s, 0.02)
    fast_emit = c.of("slow")
    c.emit_ns = 5.0
    assert c.diff_s(0.3) > c.diff_s(0.02) >= copy_s
    assert c.of("slow") < fast_emit
    # A host whose scatter is slower (subscribers sharing their cores) lowers it too.
    slow_host = modeled(scatter_ns=8.0)
    slow_host.pushed_dense("slow", 40 * copy_s)
    assert slow_host.of("slow") < chosen["slow"]


async def test_the_report_names_the_crossover_each_version_was_judged_by():
    store = f"memory://{uuid.uuid4().hex}"
    src = {"a": torch.randn(1 << 16)}
    async with transport.Transport("trainer", store=store, backends=("tcp",)) as tt, \
            transport.Transport("far", store=store, backends=("tcp",)) as tf:
        async with Publisher(tt, src, name="fixed", delta_crossover=0.3) as fixed, \
                Publisher(tt, src, name="chosen") as chosen, \
                Publisher(tt, src, name="never") as never, \
                Subscriber(tf, {"a": torch.zeros(1 << 16)}, publisher="trainer", name="fixed") as s1, \
                Subscriber(tf, far := {"a": torch.zeros(1 << 16)}, publisher="trainer", name="chosen") as s2, \
                Subscriber(tf, never_live := {"a": torch.zeros(1 << 16)}, publisher="trainer", name="never") as s3:
            for v in range(1, 5):
                src["a"][v : v + 3] += 1
                r1, r2, r3 = await fixed.publish(v), await chosen.publish(v), await never.publish(v)
                assert [await s.wait_version(v) for s in (s1, s2, s3)] == [v, v, v]
                if v == 1:
                    # As if this host's scatter took a second per element: no delta can pay, on
                    # any link, so every later version goes to it dense, undiffed.
                    await never.wait_snapshot()
                    never._pipeline.crossover.calibrate()
                    never._pipeline.crossover.scatter_ns = 1e9
                    continue
                # diffed against the version before, by the given crossover
                assert r1.delta is not None and r1.delta.crossover == 0.3 and r1.results["far"].delta
                # by the chosen one: whichever it is, the report says which and the result agrees
                assert r2.delta is not None and r2.delta.crossover is not None
                if r2.delta.crossover > 0:  # a small model: the diff's fixed costs may outweigh the bytes
                    assert r2.delta.crossover <= NETWORK_MAX and r2.results["far"].delta and r2.delta.base == v - 1
                else:
                    assert not r2.results["far"].delta and r2.delta.base is None and not r2.delta.sampled
                assert r3.delta is not None and r3.delta.crossover == 0.0 and not r3.delta.sampled
                assert r3.delta.base is None and not r3.results["far"].delta and r3.delta.encode_s == 0.0
                # Its control block says no delta is coming, so its subscriber checksums nothing
                # ahead after a dense apply; the other publishers' say one may.
                assert int(never._pipeline.snapshots.ctl[DIFFING]) == 0
                assert s3._delta is not None and s3._delta._pass is None
                assert int(fixed._pipeline.snapshots.ctl[DIFFING]) == 1 and s1._delta is not None
            assert torch.equal(far["a"], src["a"]) and torch.equal(never_live["a"], src["a"])
            # The host measures as it is again: a delta pays once more (this once: its measured
            # diff then outweighs so small a push), and it goes to a subscriber that learnt
            # nothing ahead, which checks it against checksums it makes then.
            never._pipeline.crossover.scatter_ns = 2.0
            src["a"][5:8] += 1
            r3 = await never.publish(5)
            assert await s3.wait_version(5) == 5 and torch.equal(never_live["a"], src["a"])
            assert r3.results["far"].delta and s3.refused_deltas == 0
