"""A prepared transfer started with some of its runs (``PreparedTransfer.start(runs=...)``): a
transfer between two fixed buffers, prepared once with every run it may move, whose rows change
from start to start. Exact bytes on every backend against a real target process; typed errors
before any byte moves; cancellation, timeouts and a restarted peer as for ``start()``."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch

import transport
from tests._support import backend_params, serving_target

REGION = 1 << 20  # bytes


def windows(rng: np.random.Generator, n: int, item: int) -> np.ndarray:
    """``n`` runs that pack distinct, gapped places of a ``REGION``-byte region into a smaller
    local buffer (each at its own local-to-remote displacement), as an encoder's staging
    buffer maps into a slot."""
    size = rng.integers(4, 64, n) * item
    remote = np.sort(rng.choice(REGION // (256 * item), n, replace=False)) * 256 * item
    local = np.concatenate([[0], np.cumsum(size)[:-1]])
    return np.stack([local, remote, size], axis=1).astype(np.int64)


def inside(rng: np.random.Generator, win: np.ndarray, share: float, item: int) -> np.ndarray:
    """Rows inside a random ``share`` of the runs ``win``: each a random piece of its run, at
    the same place on both sides, in a random order."""
    pick = win[rng.random(len(win)) < share]
    items = pick[:, 2] // item
    start = rng.integers(0, items) * item
    length = (rng.integers(0, items - start // item) + 1) * item
    rows = np.stack([pick[:, 0] + start, pick[:, 1] + start, length], axis=1)
    return rows[rng.permutation(len(rows))]


def landed(base: np.ndarray, src: np.ndarray, rows: np.ndarray) -> np.ndarray:
    out = base.copy()
    for a, b, n in rows.tolist():
        out[b:b + n] = src[a:a + n]
    return out


@pytest.mark.parametrize("backend", backend_params())
async def test_each_start_moves_exactly_its_rows_and_nothing_else(backend, targets, file_store):
    rng = np.random.default_rng(3)
    async with transport.Transport("init", store=file_store, backends=(backend,), timeout=30) as t:
        target = await serving_target(t, targets, file_store, backend, [{"key": "w", "numel": REGION // 4,
                                                                        "dtype": "float32"}])
        win = windows(rng, 400, 4)
        src = torch.randn(int(win[:, 2].sum()) // 4)
        prepared = t.prepare_put_runs(target.name, src, "w", win)
        back = torch.zeros(REGION // 4)
        want = np.zeros(REGION, np.uint8)
        for share in (0.05, 0.5, 1.0):  # three starts of one prepared transfer, each its own rows
            src.copy_(torch.randn(src.numel()))
            rows = inside(rng, win, share, 4)
            h = prepared.start(runs=rows)
            assert h.nbytes == int(rows[:, 2].sum()) and h.segments == len(rows)
            await h
            assert h.backend == backend and h.same_host is (backend == "ipc")
            await t.get(back, target.name, key="w")
            want = landed(want, src.numpy().view(np.uint8), rows)
            assert np.array_equal(back.numpy().view(np.uint8), want), share

        # A get of some of its runs reads exactly those bytes into the local buffer.
        dst = torch.zeros_like(src)
        rows = inside(rng, win, 0.3, 4)
        await t.prepare_get_runs(target.name, dst, "w", win).start(runs=torch.from_numpy(rows))
        got = dst.numpy().view(np.uint8)
        assert np.array_equal(got, landed(np.zeros(src.nbytes, np.uint8), want, rows[:, [1, 0, 2]]))
        await t.signal(target.name, "done", 1)
        await target.result()


@pytest.mark.parametrize("backend", ["ipc", "tcp"])
async def test_bad_rows_are_typed_errors_before_any_byte_moves(backend, memory_store):
    async with transport.Transport("a", store=memory_store, backends=(backend,), timeout=10) as a, \
            transport.Transport("b", store=memory_store, backends=(backend,), timeout=10) as b:
        region = b.empty("w", 1024, torch.float32)
        await a.peer("b", regions=["w"])
        src = torch.arange(1, 257, dtype=torch.float32)
        win = np.array([[0, 0, 256], [256, 2048, 256], [512, 1024, 512]])  # bytes; 3 displacements
        prepared = a.prepare_put_runs("b", src, "w", win)
        for rows, err in [
            (np.zeros((2, 2), np.int64), TypeError),
            (np.array([[0, 0, 4]], np.float64), TypeError),  # not integers
            (np.zeros((0, 3), np.int64), ValueError),  # no rows
            (np.array([[0, 0, 0]]), ValueError),  # none with bytes
            (np.array([[0, 0, 8], [-4, 16, 4]]), transport.BoundsError),  # negative
            (np.array([[2, 2, 4]]), transport.BoundsError),  # misaligned for float32
            (np.array([[(1 << 62) - 1792, 1 << 62, 1 << 62]]), transport.BoundsError),  # its end overflows
            (np.array([[0, 4, 8]]), transport.BoundsError),  # local and remote at another distance
            (np.array([[252, 252, 8]]), transport.BoundsError),  # runs past the end of its run
            (np.array([[0, 3000, 4]]), transport.BoundsError),  # where no run goes
            (np.array([[256, 2048, 8], [0, 0, 8], [260, 2052, 8]]), transport.BoundsError),  # two write 2052..2056
        ]:
            with pytest.raises(err):
                prepared.start(runs=rows)
        with pytest.raises(transport.BoundsError):  # its local end overflows: never read past the tensor
            a.prepare_put_runs("b", src, "w", np.array([[(1 << 63) - 8, 0, 16]]))
        items = a.prepare_put("b", [(src[:8], "w", 0)])
        with pytest.raises(ValueError, match="one array of runs"):
            items.start(runs=np.array([[0, 0, 4]]))
        await anyio.sleep(0.05)
        assert not region.any(), "a refused start wrote bytes"

        # Rows across two runs that are contiguous on both sides (coalesced when prepared) are inside.
        joined = a.prepare_put_runs("b", src, "w", np.array([[0, 0, 128], [128, 128, 128]]))
        await joined.start(runs=np.array([[64, 64, 128]]))
        assert torch.equal(region[16:48], src[16:48]) and not region[:16].any() and not region[48:].any()


async def test_a_get_whose_runs_share_remote_bytes_takes_rows_inside_any_of_them(memory_store):
    """A get's runs may read the same remote bytes twice (at other local places): a row is
    inside when it lies in one run, or in runs at the same local-to-remote distance that
    overlap or touch."""
    async with transport.Transport("a", store=memory_store, backends=("ipc",), timeout=10) as a, \
            transport.Transport("b", store=memory_store, backends=("ipc",), timeout=10) as b:
        region = b.empty("w", 1024, torch.uint8)
        region.copy_(torch.arange(1024) % 251)
        await a.peer("b", regions=["w"])
        dst = torch.zeros(1024, dtype=torch.uint8)
        win = np.array([[0, 0, 100], [600, 50, 100], [100, 100, 50], [800, 20, 60]])
        prepared = a.prepare_get_runs("b", dst, "w", win)
        rows = np.array([[50, 50, 80], [620, 70, 30], [805, 25, 10]])  # the first spans two runs at distance 0
        await prepared.start(runs=rows)
        want = landed(np.zeros(1024, np.uint8), region.numpy(), rows[:, [1, 0, 2]])
        assert np.array_equal(dst.numpy(), want)
        with pytest.raises(transport.BoundsError):
            prepared.start(runs=np.array([[590, 40, 20]]))  # at 600's distance, but before that run


async def test_a_cancelled_or_late_start_of_some_runs_reports_it_as_start_does(targets, file_store):
    """Over tcp, to a target that serves, then blocks its thread (its agent cannot run)."""
    async with transport.Transport("init", store=file_store, backends=("tcp",), timeout=30) as t:
        target = targets({"name": "sleeper", "store": file_store, "backends": ["tcp"], "initiator": "init",
                          "mode": "sleep", "sleep_on_signal": True,
                          "regions": [{"key": "w", "numel": 1 << 16, "dtype": "uint8"}]})
        await t.wait_signal("ready", timeout=60)
        await t.peer("sleeper", regions=["w"])
        src = torch.ones(1 << 16, dtype=torch.uint8)
        prepared = t.prepare_put_runs("sleeper", src, "w", np.array([[0, 0, 1 << 15], [1 << 15, 1 << 15, 1 << 15]]))
        rows = np.array([[0, 0, 4096], [40000, 40000, 4096]])  # two runs apart: not a single put

        h = prepared.start(runs=rows)
        h.cancel()  # before its task ran: nothing moves, and the handle says so
        with pytest.raises(transport.TransferAbortedError) as info:
            await h
        assert not info.value.partial
        await prepared.start(runs=rows)  # connected, while it serves

        await t.signal("sleeper", "sleep", 1)
        await t.wait_signal("sleeping", timeout=30)
        await anyio.sleep(0.2)  # asleep now
        for start in (lambda: prepared.start(runs=rows, timeout=0.5), lambda: prepared.start(timeout=0.5)):
            with pytest.raises(transport.TransferTimeoutError):
                await start()
        with pytest.raises(ValueError):
            prepared.start(runs=rows, timeout=-1)
        target.go()
        await target.result()


async def test_a_restarted_peer_is_checked_and_reached_anew(memory_store):
    """The same prepared transfer, started with some runs after its peer restarted (a new
    incarnation): its runs are checked against the new record (a smaller region refuses them,
    before any byte) and the bytes land in the new process's memory, not the old one's."""
    async with transport.Transport("a", store=memory_store, backends=("ipc",), timeout=10) as a:
        src = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
        prepared = None
        rows = np.array([[100, 1100, 50], [3000, 200, 96]])
        for size, fits in ((4096, True), (1024, False), (4096, True)):
            async with transport.Transport("b", store=memory_store, backends=("ipc",), timeout=10) as b:
                region = b.empty("w", size, torch.uint8)
                await a.peer("b", regions=["w"])
                if prepared is None:
                    prepared = a.prepare_put_runs("b", src, "w", np.array([[0, 1000, 1024], [2800, 0, 512]]))
                if not fits:
                    with pytest.raises(transport.BoundsError):
                        await prepared.start(runs=rows)
                    assert not region.any()
                    continue
                await prepared.start(runs=rows)
                want = landed(np.zeros(size, np.uint8), src.numpy(), rows)
                assert np.array_equal(region.numpy(), want)


async def test_a_closed_transport_refuses_a_start_of_some_runs(memory_store):
    async with transport.Transport("a", store=memory_store, backends=("ipc",)) as a, \
            transport.Transport("b", store=memory_store, backends=("ipc",)) as b:
        b.empty("w", 64, torch.uint8)
        await a.peer("b", regions=["w"])
        prepared = a.prepare_put_runs("b", torch.zeros(64, dtype=torch.uint8), "w", np.array([[0, 0, 8]]))
    with pytest.raises(transport.ClosedError):
        prepared.start(runs=np.array([[0, 0, 4]]))
