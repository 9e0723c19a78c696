"""Which generator ranks of a mesh stream get a version as a delta: the crossover each is
judged by, per version, from what the trainer rank measured on its path (the crossover model
the stream publisher uses, in its mesh form: first on given figures alone), a crossover given
by the caller, and a rank whose slot holds an older base than the version two back.

One trainer rank and tp=1 generator replicas in this process, on real Transports: ``F`` reached
over ``ipc`` (a link as fast as memory), ``S`` over tcp through a link shaped to
``RATE_BPS`` (:class:`ShapedTcp`: each transfer waits for its bytes' time on the link, one
after another, then moves for real). Every version changes ``CHANGE`` of the weights' 2-byte
units, and every generator rank checks what it applied bit for bit.

Where a test sets this host's figures (the checked patch's cost per changed unit, as the stream
crossover's tests do), the decision depends only on the links: a dense push over ``ipc`` takes
well under a millisecond for the megabyte here, one over the shaped link over 100 ms."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import anyio
import pytest
import torch

import transport
from transport.backends import Backend, LocalBuffer, RemoteTarget
from transport.backends.tcp import TcpBackend
from transport.plan import GeneratorRank, LocalTensor, MeshSharding, Piece, Shard, TensorSpec, TrainerLayout, full_box
from transport.testing import temporary_backend
from transport.weights import MeshPublisher, MeshPublishReport, MeshSubscriber, SyncStatus
from transport.weights._codec.policy import RUNS, RUNS_CROSSOVER, Crossover, wire_share

SHAPE = (512, 1024)  # 1 MiB of bfloat16: 2**19 units
UNITS = SHAPE[0] * SHAPE[1]
CHANGE = 0.005  # of the units, each version: 1% since the version two back, a delta's base
RATE_BPS = 10e6  # the shaped link: about 105 ms for a dense version
SHAPED = "shapedtcp"


class ShapedTcp(TcpBackend):
    """tcp behind a link of ``RATE_BPS``: each put and get first takes its bytes' time on the
    link (one transfer at a time, as on a wire), then moves the bytes over tcp. Every transfer
    takes put/get (no synchronous path; a prepared transfer's runs go one ``move`` each)."""

    name = SHAPED

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self._wire = anyio.Lock()

    def mover(self, op, peer, region):
        return None

    def prepare_runs(self, op, peer, lists):
        return Backend.prepare_runs(self, op, peer, lists)

    async def put(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        async with self._wire:
            await anyio.sleep(remote.nbytes / RATE_BPS)
        await super().put(local, remote)

    async def get(self, local: LocalBuffer, remote: RemoteTarget) -> None:
        async with self._wire:
            await anyio.sleep(remote.nbytes / RATE_BPS)
        await super().get(local, remote)


LAYOUT = TrainerLayout.of([TensorSpec("w", SHAPE, "bfloat16", MeshSharding((1,), (Shard(0),), (0,)))])
NEED = GeneratorRank.of([LocalTensor("w", SHAPE, "bfloat16", (Piece("w", full_box(SHAPE), full_box(SHAPE)),))])
LINKS = {"F": ("ipc", SHAPED), "S": (SHAPED,)}  # replica -> the backends its rank speaks (the first serves it)


@dataclass
class Mesh:
    """The trainer rank's publisher and weights, and the generator ranks by replica."""

    pub: MeshPublisher
    w: torch.Tensor
    subs: dict[str, MeshSubscriber]
    step: int = 0
    published: dict[int, torch.Tensor] = field(default_factory=dict)  # version -> the weights then

    @property
    def model(self) -> Crossover:
        model = self.pub._pushes.crossover
        assert model is not None
        return model

    def host(self, scatter_ns: float) -> None:
        """As if this host measured a memcpy at 10 GB/s, a checksum pass at 20 GB/s and the
        generators' checked patch at ``scatter_ns`` a changed unit (after the calibration the
        publisher may have begun in the background, which would write its own figures)."""
        self.model.calibrate()
        self.model.copy_gbps, self.model.sum_gbps, self.model.scatter_ns = 10.0, 20.0, scatter_ns

    def change(self, fraction: float = CHANGE) -> None:
        """Changes ``fraction`` of the weights' units (a new value at every 1/fraction-th, shifted
        each time, so each change lands on units the last did not touch)."""
        self.step += 1
        every = round(1 / fraction)
        self.w.view(-1)[self.step % every :: every] += 1.0

    async def publish(self, version: int, fraction: float = CHANGE,
                      apply: Sequence[str] | None = None) -> MeshPublishReport:
        """Publishes the next version (``fraction`` changed); each generator rank of ``apply``
        (default: all) commits it, applies it and checks it bit for bit."""
        if version:
            self.change(fraction)
        self.published[version] = self.w.clone()
        report = await self.pub.publish(version)
        for replica in self.subs if apply is None else apply:
            await self.take(replica, version)
        return report

    async def take(self, replica: str, version: int) -> None:
        sub = self.subs[replica]
        assert await sub.commit(timeout=10) == version
        assert sub.apply() == version
        assert torch.equal(sub.tensors["w"].view(torch.int16), self.published[version].view(torch.int16)), \
            (replica, version)


@asynccontextmanager
async def mesh(replicas: Sequence[str], **kw) -> AsyncIterator[Mesh]:
    """A trainer rank (``kw`` goes to its MeshPublisher) and a generator rank per replica."""
    store = f"memory://{uuid.uuid4().hex}"
    w = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with temporary_backend(ShapedTcp):
        async with AsyncExitStack() as stack:
            tt = await stack.enter_async_context(transport.Transport("trainer", store=store, backends=("ipc", SHAPED)))
            subs = {}
            for r in replicas:
                tg = await stack.enter_async_context(transport.Transport(f"gen-{r}", store=store, backends=LINKS[r]))
                subs[r] = await stack.enter_async_context(
                    MeshSubscriber(tg, "m", replica=r, rank=0, size=1, layout=NEED, timeout=10))
            pub = await stack.enter_async_context(MeshPublisher(tt, "m", {"w": w}, LAYOUT, rank=0, **kw))
            yield Mesh(pub, w, subs)


def deltas(report: MeshPublishReport) -> dict[str, bool]:
    assert all(r.status is SyncStatus.DONE for r in report.results.values()), report
    return {label.split("/")[0]: r.delta for label, r in report.results.items()}


def test_the_runs_form_counts_what_a_mesh_version_pays():
    # A trainer rank of 200 MB (10**8 units) on a host with a 13 GB/s copy and a 2 ns checked
    # patch a unit: what it chooses depends on the links (and the diff it measured) alone.
    nbytes = 200 << 20
    c = Crossover(None, nbytes, nbytes // 2, 2, 1, RUNS)
    c.copy_gbps, c.sum_gbps, c.scatter_ns = 13.0, 20.0, 2.0
    copy_s = nbytes / 13e9
    assert c.of("new") == RUNS_CROSSOVER  # its path unmeasured
    assert wire_share(0.1, 2, bitmask=False) == pytest.approx(0.15)  # values and a varint gap, no bitmask
    for name, push in (("memory", copy_s), ("fast", 4 * copy_s), ("slow", 40 * copy_s)):
        c.pushed_dense(name, push, nbytes)
    # As fast as a copy: before any diff is measured, it is taken to read the base beside the
    # packing (a copy's time), as much as the dense push: no delta. A slow link: up to the most
    # a generator's delta area holds.
    assert c.of("memory") == 0.0 and c.of("slow") == RUNS.most
    # Only the diff's excess over the dense packing pass counts: a diff as fast as packing
    # leaves more room than one three times as slow.
    c.packed(copy_s)
    c.diffed(1.2 * copy_s, 0.02)
    cheap = c.of("fast")
    c.diffed(3 * copy_s, 0.02)
    assert 0 < c.of("fast") < cheap
    # The generator's check of the base, in a first delta into a slot after a dense write.
    assert c.of("fast", c.first_s(nbytes, 0)) <= c.of("fast")
    # A rank fed a quarter of the bytes over the same link is pushed a quarter as long, while
    # the diff is the whole rank's: its crossover is lower.
    c.pushed_dense("quarter", copy_s, nbytes // 4)
    assert c.of("quarter") < c.of("fast")


async def test_each_generator_rank_is_judged_by_its_own_path():
    # Versions 0-2 go dense (no base in a slot yet, or the ranks' delta areas not seen yet).
    # Then, on a host whose generators' checked patch costs 6 µs a changed unit: a delta of
    # the 1 MiB at 0.5% is predicted at about 16 ms, more than the dense push over ipc, far
    # less than the dense push over the shaped link. So F gets every version dense and S
    # takes it as a delta, at the same change; the version is diffed (S takes it) and its cut
    # goes to S alone.
    async with mesh("FS", delta=True) as m:
        for v in range(3):
            report = await m.publish(v)
            assert deltas(report) == {"F": False, "S": False} and report.changed is None
        m.host(scatter_ns=6000.0)
        for v in range(3, 6):
            report = await m.publish(v)
            assert report.crossovers.get("F/0", 0.0) == 0.0, (v, report.crossovers)
            assert 2 * CHANGE < report.crossovers["S/0"] <= RUNS.most, report.crossovers
            assert report.sampled is not None and report.sampled < report.crossovers["S/0"]
            assert report.changed == pytest.approx(2 * CHANGE, rel=0.05)
            assert deltas(report) == {"F": False, "S": True}, (v, report)
            assert report.results["S/0"].nbytes < 0.05 * report.results["F/0"].nbytes


async def test_a_slow_link_takes_deltas_by_this_hosts_own_figures():
    # Calibrated for real: over a link a hundred times slower than memory a delta pays at
    # denser changes than this one.
    async with mesh("S") as m:
        for v in range(5):
            report = await m.publish(v)
            assert deltas(report) == {"S": v >= 3}, (v, report)
        assert m.model.calibrated
        assert report.crossovers["S/0"] > 4 * CHANGE and report.changed is not None


async def test_no_diff_where_no_rank_holding_the_base_would_take_a_delta():
    # Measured on a host whose checked patch takes a millisecond a unit: no delta pays even
    # over the slow link. The version is packed as a dense one: not sampled, not diffed,
    # dense to S; and as none pays, S's slices are not checksummed after those dense pushes.
    async with mesh("S", delta=True) as m:
        for v in range(3):
            await m.publish(v)
        m.host(scatter_ns=1e6)
        for v in (3, 4):
            report = await m.publish(v)
            assert report.crossovers == {"S/0": 0.0}
            assert report.changed is None and report.sampled is None and deltas(report) == {"S": False}
        # Patches at 6 µs a unit: a delta would pay, but no slot of S holds a base whose
        # checksum is known (versions 3 and 4 were not readied), so versions 5 and 6 go dense
        # undiffed, and are readied: from version 7 on S takes deltas again.
        m.host(scatter_ns=6000.0)
        for v in range(5, 9):
            report = await m.publish(v)
            assert deltas(report) == {"S": v >= 7}, (v, report)
            assert (report.changed is None) == (v < 7) and bool(report.crossovers) == (v >= 7), (v, report)


async def test_a_given_crossover_is_used_as_it_is():
    async with transport.Transport("trainer", store=f"memory://{uuid.uuid4().hex}") as tt:
        for bad in (0.0, -0.1, 0.6):
            with pytest.raises(ValueError, match="delta_crossover"):
                MeshPublisher(tt, "m", {"w": torch.zeros(SHAPE, dtype=torch.bfloat16)}, LAYOUT, rank=0,
                              delta_crossover=bad)
    async with mesh("FS", delta=True, delta_crossover=0.02) as m:
        m.host(scatter_ns=1e6)  # the model would send every version dense: it is not asked
        for v in range(3):
            await m.publish(v)
        for v in (3, 4):
            report = await m.publish(v)
            assert report.crossovers == {"F/0": 0.02, "S/0": 0.02}
            assert deltas(report) == {"F": True, "S": True}, (v, report)
        # 5% changed: its sample says so, and the version goes dense to both without a diff.
        report = await m.publish(5, fraction=0.05)
        assert report.sampled is not None and report.sampled > 0.02 and report.changed is None
        assert deltas(report) == {"F": False, "S": False}


async def test_a_rank_whose_slot_holds_an_older_base_gets_the_version_dense_undiffed():
    # F leaves version 4 committed but unapplied, so version 6 cannot go into that slot (it
    # is a straggler there), and the slot still holds 4 when version 8 comes, whose base is 6:
    # F gets 8 dense, and as no rank holds 6, version 8 is not diffed at all. Version 7 (its
    # base 5 is in F's other slot) goes as a delta.
    async with mesh("F", delta=True, delta_crossover=0.2) as m:
        for v in range(4):
            await m.publish(v)
        assert deltas(await m.publish(4, apply=())) == {"F": True}
        assert await m.subs["F"].commit(timeout=10) == 4  # committed, not applied
        assert deltas(await m.publish(5, apply=())) == {"F": True}
        report = await m.publish(6, apply=())
        assert report.results["F/0"].status is SyncStatus.STRAGGLER and "committed" in str(report.results["F/0"].error)
        assert m.subs["F"].apply() == 4
        await m.take("F", 5)
        report = await m.publish(7)
        assert deltas(report) == {"F": True} and report.crossovers == {"F/0": 0.2}
        report = await m.publish(8)
        assert deltas(report) == {"F": False}
        assert report.crossovers == {} and report.changed is None and report.sampled is None
