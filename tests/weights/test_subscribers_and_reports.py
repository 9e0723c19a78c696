"""What a publisher and its subscribers promise each other: strict name matching both ways, subscribers
that leave or die between publishes, ``apply_async`` under concurrent publishes, and a
``PublishReport`` whose phases account for the whole call."""

from __future__ import annotations

import logging
import signal
import time
import uuid

import anyio
import pytest
import torch

import transport
from tests._support import LoopTicks
from tests.weights._support import Peers, publish_cycles, versioned
from transport.weights import LayoutMismatchError, Publisher, Subscriber, SyncStatus
from transport.weights import __all__ as weights_all
from transport.weights._control import NO_SLOT, READING


@pytest.fixture
def store():
    return f"memory://{uuid.uuid4().hex}"


@pytest.fixture
def peers(tmp_path):
    ps = Peers(tmp_path, f"file://{tmp_path / 'store'}")
    yield ps
    ps.close()


def test_layout_mismatch_error_is_in_the_error_tree_and_exported():
    assert issubclass(LayoutMismatchError, transport.LayoutError)
    assert "LayoutMismatchError" in weights_all
    assert LayoutMismatchError.__module__ == "transport.weights"


# --- strict ---------------------------------------------------------------------------------


async def test_strict_refuses_local_tensors_the_publisher_does_not_send(store, caplog):
    """A generator with more layers than the trainer: strict (the default) refuses to subscribe
    and names the extra tensors; strict=False subscribes, warns, and leaves them alone."""
    src = {"embed": torch.randn(8, 4), "layers.0.w": torch.randn(4, 4)}
    extra = [f"layers.{i}.w" for i in range(1, 8)]  # seven local layers the trainer lacks

    def local() -> dict[str, torch.Tensor]:
        out = {k: torch.zeros_like(v) for k, v in src.items()}
        out.update({k: torch.full((4, 4), -1.0) for k in extra})
        return out

    async with transport.Transport("trainer", store=store) as tt, transport.Transport("gen", store=store) as tg:
        async with Publisher(tt, src) as pub:
            with pytest.raises(LayoutMismatchError) as info:
                await Subscriber(tg, local(), publisher="trainer").start()
            msg = str(info.value)
            assert "7 local tensor(s) are not sent" in msg, msg
            assert all(f"'{n}'" in msg for n in extra[:5]) and "and 2 more" in msg, msg
            assert "strict=False" in msg
            assert info.value.not_sent == tuple(extra) and info.value.not_received == ()
            assert await pub.subscribers() == []

            # Both directions at once: a wire tensor with no local name is listed too.
            mixed = {"embed": torch.zeros(8, 4), "head": torch.zeros(2)}
            with pytest.raises(LayoutMismatchError, match=r"no local counterpart: 'layers\.0\.w'") as info:
                await Subscriber(tg, mixed, publisher="trainer").start()
            assert info.value.not_sent == ("head",) and info.value.not_received == ("layers.0.w",)

            dst = local()
            with caplog.at_level(logging.WARNING, logger="transport.weights"):
                sub = Subscriber(tg, dst, publisher="trainer", strict=False)
                await sub.start()
            try:
                warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
                assert any("7 local tensor(s)" in m and "'layers.1.w'" in m for m in warned), warned
                assert (await pub.publish(1)).done == ["gen"]
                assert await sub.apply_async() == 1
                assert all(torch.equal(dst[k], src[k]) for k in src)
                assert all(torch.equal(dst[k], torch.full((4, 4), -1.0)) for k in extra)  # unsynced, untouched
            finally:
                await sub.aclose()


# --- subscribers that leave or die ---------------------------------------------------------


async def test_killed_subscriber_is_reported_in_the_next_report_and_a_leaver_in_left(peers):
    """Between two publishes a subscriber process is SIGKILLed and another subscriber closes
    its Transport. The next report has the killed one failed (PeerLostError) and the other in
    ``left``; the one after reports neither again, and the survivor got every version."""
    src = versioned(0)
    async with transport.Transport("trainer", store=peers.store, timeout=30) as t, \
            transport.Transport("gen-0", store=peers.store, timeout=30) as t0:
        async with Publisher(t, src, deadline=10) as pub, \
                Subscriber(t0, survivor := versioned(-1), publisher="trainer") as sub0:
            peers.start("gen-1")
            await t.wait_signal("ready.gen-1", timeout=60)
            async with transport.Transport("gen-2", store=peers.store, timeout=30) as t2, \
                    Subscriber(t2, versioned(-1), publisher="trainer"):
                reports = await publish_cycles(t, pub, src, 1, 2)
            # gen-2 has closed its Transport (its record is withdrawn); now SIGKILL gen-1.
            assert all(r.done == ["gen-0", "gen-1", "gen-2"] and r.left == () for r in reports), reports
            victim = peers.procs["gen-1"]
            victim.send_signal(signal.SIGKILL)
            victim.wait(timeout=30)

            [after] = await publish_cycles(t, pub, src, 3, 1)
            assert after.done == ["gen-0"], after.results
            assert after.failed == ["gen-1"], after.results
            dead = after.results["gen-1"]
            assert dead.status == SyncStatus.FAILED and dead.nbytes == 0
            assert dead.error is not None and dead.error.startswith("PeerLostError: gen-1"), dead.error
            assert after.left == ("gen-2",)

            [later] = await publish_cycles(t, pub, src, 4, 1)  # reported once, then left out
            assert later.done == ["gen-0"] and later.failed == [] and later.left == (), later.results
            assert await pub.subscribers() == ["gen-0"]
            assert await sub0.apply_async() == 4 and one_version(survivor) == {4.0}


async def test_unsubscribed_and_excluded_subscribers(store):
    """In one process: a subscriber that unsubscribes is in ``left`` once and may come back;
    one that this Transport excludes fails once (PeerLostError) and is left out afterwards."""
    async with transport.Transport("trainer", store=store) as tt, transport.Transport("gen", store=store) as tg, \
            transport.Transport("gen-x", store=store) as tx:
        async with Publisher(tt, {"w": torch.ones(4)}) as pub:
            sub = Subscriber(tg, {"w": torch.zeros(4)}, publisher="trainer")
            await sub.start()
            async with Subscriber(tx, {"w": torch.zeros(4)}, publisher="trainer"):
                assert (await pub.publish(1)).done == ["gen", "gen-x"]
                await sub.aclose()
                tt.exclude("gen-x")
                r2 = await pub.publish(2)
                assert r2.left == ("gen",) and r2.done == [], r2.results
                assert r2.failed == ["gen-x"] and "PeerLostError" in (r2.results["gen-x"].error or "")
                r3 = await pub.publish(3)
                assert r3.results == {} and r3.left == ()
                async with Subscriber(tg, dst := {"w": torch.zeros(4)}, publisher="trainer") as again:
                    r4 = await pub.publish(4)
                    assert r4.done == ["gen"] and r4.left == () and r4.failed == []
                    assert again.apply() == 4 and torch.equal(dst["w"], torch.ones(4))


# --- apply_async --------------------------------------------------------------------------

FILL_SHAPES = {f"big.{i}": (512, 1024) for i in range(6)} | {f"small.{i}": (33,) for i in range(20)}


def fill_model(v: float, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    return {k: torch.full(s, v, dtype=dtype) for k, s in FILL_SHAPES.items()}


def one_version(m: dict[str, torch.Tensor]) -> set[float]:
    """The fills seen anywhere in ``m`` (first, min and max of every tensor)."""
    seen: set[float] = set()
    for x in m.values():
        seen |= {float(x.flatten()[0]), float(x.min()), float(x.max())}
    return seen


async def _apply_async_under_concurrent_publishes(store: str, versions: int) -> tuple[list[int], int]:
    """The publisher publishes ``versions`` versions back to back (each a distinct fill) while
    the subscriber loops ``apply_async`` and checks after each apply that every tensor holds
    the fill of the version applied. Returns the versions applied and how many publishes
    completed while an ``apply_async`` was running."""
    src = fill_model(0)
    # Transposed float32 here, bfloat16 on the wire: applying converts into strided memory, so
    # it takes longer than a whole publish, and publishes land while it runs.
    dst = {k: torch.full(s[::-1], -1.0).t() if len(s) == 2 else torch.full(s, -1.0) for k, s in FILL_SHAPES.items()}
    applied: list[int] = []
    overlapped = 0
    async with transport.Transport("trainer", store=store, timeout=30) as tt, \
            transport.Transport("gen", store=store, timeout=30) as tg:
        async with Publisher(tt, src, bucket_bytes=256 << 10, deadline=20) as pub, \
                Subscriber(tg, dst, publisher="trainer") as sub:

            async def publisher() -> None:
                for v in range(1, versions + 1):
                    for x in src.values():
                        x.fill_(float(v % 128))  # exact in bfloat16: a mixed copy cannot hide
                    assert (await pub.publish(v)).done == ["gen"]

            with anyio.fail_after(120):
                async with anyio.create_task_group() as group:
                    group.start_soon(publisher)
                    while sub.version != versions:
                        before = pub.version
                        v = await sub.apply_async()
                        if v is not None:
                            overlapped += pub.version != before
                            applied.append(v)
                            seen = one_version(dst)
                            assert seen == {float(v % 128)}, (v, seen)  # exactly one version, never mixed
                            assert sub.version == v
    return applied, overlapped


async def test_apply_async_under_concurrent_publishes(store):
    applied, overlapped = await _apply_async_under_concurrent_publishes(store, 100)
    assert applied[-1] == 100 and applied == sorted(set(applied)), (applied, overlapped)


def test_apply_async_under_concurrent_publishes_asyncio():
    store = f"memory://{uuid.uuid4().hex}"
    applied, overlapped = anyio.run(_apply_async_under_concurrent_publishes, store, 30, backend="asyncio")
    assert applied[-1] == 30 and applied == sorted(set(applied)), (applied, overlapped)


async def test_cancelled_apply_async_applies_the_version_whole(store):
    """Cancelled while its thread copies, apply_async finishes that copy (the version is live,
    whole) and then raises the cancellation."""
    shapes = {f"w{i}": (2048, 2048) for i in range(8)}  # 128 MiB: the copy takes a while
    src = {k: torch.full(s, 0.0) for k, s in shapes.items()}
    dst = {k: torch.full(s, -1.0) for k, s in shapes.items()}
    async with transport.Transport("trainer", store=store) as tt, transport.Transport("gen", store=store) as tg:
        async with Publisher(tt, src) as pub, Subscriber(tg, dst, publisher="trainer") as sub:
            caught_mid_copy = 0
            for v in range(1, 6):
                for x in src.values():
                    x.fill_(float(v))
                await pub.publish(v)
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as group:
                        group.start_soon(sub.apply_async)
                        with anyio.fail_after(30):
                            while int(sub._ctl[READING]) == NO_SLOT and sub.version != v:
                                await anyio.sleep(0)
                        mid_copy = int(sub._ctl[READING]) != NO_SLOT
                        scope.cancel()
                if mid_copy:
                    assert scope.cancelled_caught
                assert sub.version == v and one_version(dst) == {float(v)}, (v, sub.version, one_version(dst))
                caught_mid_copy += mid_copy
            assert caught_mid_copy > 0, "never cancelled during a copy"


async def test_apply_async_yields_when_there_is_nothing_new(store):
    async with transport.Transport("trainer", store=store) as tt, transport.Transport("gen", store=store) as tg:
        async with Publisher(tt, {"w": torch.ones(4)}), \
                Subscriber(tg, {"w": torch.zeros(4)}, publisher="trainer") as sub:
            ticks = LoopTicks()
            async with anyio.create_task_group() as group:
                group.start_soon(ticks.run)
                for _ in range(50):  # the README's loop: it must let other tasks run
                    assert await sub.apply_async() is None
                group.cancel_scope.cancel()
            assert ticks.n >= 10


# --- the report's time ---------------------------------------------------------------------


async def test_report_phases_account_for_the_whole_publish(store):
    src = fill_model(1.0, torch.float32) | {"fp8": torch.randn(64, 64).bfloat16()}
    async with transport.Transport("trainer", store=store) as tt, transport.Transport("g0", store=store) as t0, \
            transport.Transport("g1", store=store) as t1:
        async with Publisher(tt, src, bucket_bytes=1 << 20, fp8=lambda n, _: n == "fp8") as pub, \
                Subscriber(t0, {k: torch.zeros_like(v) for k, v in src.items()}, publisher="trainer"), \
                Subscriber(t1, {k: torch.zeros_like(v) for k, v in src.items()}, publisher="trainer"):
            for v in range(1, 6):
                start = time.perf_counter()
                report = await pub.publish(v)
                wall = time.perf_counter() - start
                assert report.done == ["g0", "g1"]
                phases = report.phases
                assert list(phases) == ["queued_s", "pack_s", "discover_s", "push_s", "snapshot_s"]
                assert all(x >= 0 for x in phases.values()), phases
                assert report.total_s >= sum(phases.values()) - 1e-6, (report.total_s, phases)
                assert abs(report.total_s - sum(phases.values())) < 1e-6, (report.total_s, phases)
                # Accounting, not speed: the report covers the call, give or take a scheduler slice.
                assert wall - 0.1 <= report.total_s <= wall, (wall, report.total_s)
                assert report.seconds == report.total_s and report.snapshot_seconds == report.pack_s
                assert all(r.seconds <= report.total_s for r in report.results.values())


async def test_max_inflight_is_deprecated_and_ignored(memory_store):
    async with transport.Transport("trainer", store=memory_store, backends=("tcp",)) as t:
        with pytest.warns(DeprecationWarning, match="max_inflight"):
            Publisher(t, {"w": torch.zeros(4)}, max_inflight=2)
